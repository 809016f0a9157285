"""What a process is doing, read from /proc: shared by the launcher, the client and the ranks (a leaf module)."""

from __future__ import annotations


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, Z zombie, ...); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """True for a running (or stopped) process; False for a gone or zombie one."""
    return process_state(pid) not in (None, "Z", "X")
