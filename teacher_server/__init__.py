"""teacher_server."""
