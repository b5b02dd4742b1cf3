"""Evaluation: statistics of pass rates and paired comparisons of evaluation runs."""
