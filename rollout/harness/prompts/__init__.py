"""Prompt files of the harnesses (YAML)."""
