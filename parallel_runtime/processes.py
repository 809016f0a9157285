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


def memory_cgroup(pid: int) -> str | None:
    """The directory of ``pid``'s memory cgroup (v2, or v1's memory controller), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):  # cgroup v1
            return "/sys/fs/cgroup/memory" + path
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and controllers == "":  # cgroup v2
            return "/sys/fs/cgroup" + path
    return None


def oom_kills(cgroup: str | None) -> int | None:
    """How many processes the kernel's OOM killer has killed in a memory cgroup (None when it does not say)."""
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            with open(f"{cgroup}/{name}") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def children(pid: int) -> list[int]:
    """``pid``'s child processes (empty when it has none or is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []
