"""The backend's private run directory (0700): what lives in it, named once for the launcher, the client and the
ranks.

    control.sock        rank 0's control socket          token               the backend's secret (0600)
    client.pid          the client that started it       launcher.log        torchrun's output
    torchelastic/       torchrun's own logs              rank<N>.log         a rank's stdout and stderr
    rank<N>.pid         a rank's pid                     rank<N>.traceback   why a rank left the group
    rank<N>.heartbeat   renewed every second by the rank (its modification time is the heartbeat)
    beacon              over several machines: the backend's sealed beacon, which node 0's agent publishes
    rank<N>.node        a rank on another machine: {node, host, pid} (JSON); rank 0 renews its heartbeat file and
                        copies its traceback here from the store
    stopping            the client is stopping the group itself (it then removes what the group leaves)
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

from .arena import remove_segments


class RunDir:
    def __init__(self, path: str):
        self.path = path

    def _at(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def socket(self) -> str:
        return self._at("control.sock")

    @property
    def token(self) -> str:
        return self._at("token")

    @property
    def client_pid(self) -> str:
        return self._at("client.pid")

    @property
    def launcher_log(self) -> str:
        return self._at("launcher.log")

    @property
    def torchelastic(self) -> str:
        return self._at("torchelastic")

    def rank_log(self, rank: int) -> str:
        return self._at(f"rank{rank}.log")

    def rank_pid(self, rank: int) -> str:
        return self._at(f"rank{rank}.pid")

    def rank_traceback(self, rank: int) -> str:
        return self._at(f"rank{rank}.traceback")

    def rank_heartbeat(self, rank: int) -> str:
        return self._at(f"rank{rank}.heartbeat")

    @property
    def stopping(self) -> str:
        return self._at("stopping")

    def remove(self, shm_prefix: str | None) -> None:
        """Remove the run directory and the arena segments named ``shm_prefix`` (None or empty: a machine that joined
        has none). Safe to repeat, and from several processes at once."""
        if shm_prefix:
            remove_segments(shm_prefix)
        shutil.rmtree(self.path, ignore_errors=True)

    @property
    def beacon(self) -> str:
        return self._at("beacon")

    def rank_node(self, rank: int) -> str:
        return self._at(f"rank{rank}.node")

    def _ranks_with(self, suffix: str) -> dict[int, str]:
        found = {}
        for path in glob.glob(self._at(f"rank*.{suffix}")):
            match = re.search(rf"rank(\d+)\.{suffix}$", path)
            if match:
                found[int(match.group(1))] = path
        return found

    def rank_pids(self) -> dict[int, int]:
        """Rank → pid for the ranks of this machine that have started."""
        pids = {}
        for rank, path in self._ranks_with("pid").items():
            try:
                with open(path) as f:
                    pids[rank] = int(f.read().strip())
            except (OSError, ValueError):
                pass
        return pids

    def remote_ranks(self) -> dict[int, dict]:
        """Rank → {node, host, pid} for the ranks on other machines."""
        found = {}
        for rank, path in self._ranks_with("node").items():
            try:
                with open(path) as f:
                    found[rank] = json.load(f)
            except (OSError, ValueError):
                pass
        return found

    def heartbeat_ages(self, now: float) -> dict[int, float]:
        """Rank → seconds since its last heartbeat (wall clock: the file's modification time)."""
        ages = {}
        for rank, path in self._ranks_with("heartbeat").items():
            try:
                ages[rank] = now - os.path.getmtime(path)
            except OSError:
                pass
        return ages

    def first_traceback(self) -> int | None:
        """The rank that left a traceback first, if any did."""
        tracebacks = self._ranks_with("traceback")
        try:
            return min(tracebacks, key=lambda rank: os.path.getmtime(tracebacks[rank])) if tracebacks else None
        except OSError:
            return None

    def tail(self, path: str, lines: int = 30) -> str:
        try:
            with open(path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""
