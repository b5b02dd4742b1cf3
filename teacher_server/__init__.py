"""The standalone teacher service: log-probs of given token spans, with prefix reuse.

Importing this package is light (no torch): rollout code uses `teacher_server.client`.
"""
