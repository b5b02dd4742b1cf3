"""What the tests ask of a host process by its pid."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """`pid` runs: it exists and is not a zombie (a killed process whose parent has not
    reaped it yet, or an orphan waiting for its reaper, has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
