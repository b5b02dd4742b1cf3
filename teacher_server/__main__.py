"""`python -m teacher_server serve ...` is `opd-teacher serve ...`."""

from teacher_server.cli import main

main()
