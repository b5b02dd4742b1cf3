"""Rewards: math answers checked with math-verify, SWE submissions graded by their tests."""
