"""Data files of the launch package (demo conversations)."""
