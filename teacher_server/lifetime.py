"""A child process that ends with the one that started it: the teacher service's body
checker (teacher_server/body_route.py) and the embedded teacher a local run starts
(slime_ext/local/loop.py). Without it, a parent killed where its cleanup never runs
(SIGKILL, the OOM killer, an unhandled SIGTERM) leaves the child running: a checker
waiting for ever, or a teacher holding its model and port."""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
"""Looked up at import, so a forked child (a Popen preexec_fn) only calls it."""


def end_with_parent(parent: int, signal_number: int) -> None:
    """Called first in the child: `signal_number` is sent to it when the thread that
    started it ends (Linux; nothing elsewhere); if `parent` (that thread's process) has
    ended already, the child exits at once."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal_number, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)
