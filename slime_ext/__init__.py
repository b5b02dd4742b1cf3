"""slime_ext."""
