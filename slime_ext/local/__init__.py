"""The embedded single-machine trainer and the small-model factory."""
