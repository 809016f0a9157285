"""A rank's heartbeat: a file in the run directory whose modification time the rank renews every second, from a
thread of its own.

The client reads the file's age (watchdog.py). A rank that computes, loads weights or waits in a collective keeps
beating; a rank that is stopped (SIGSTOP, a debugger), frozen with the interpreter lock held, or gone does not, and
the client names it within the heartbeat deadline instead of waiting for it forever.
"""

from __future__ import annotations

import os
import threading

HEARTBEAT_S = 1.0


class Heartbeat:
    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        with open(self.path, "w"):
            pass
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the run directory is gone: the backend is being torn down
                return

    def stop(self) -> None:
        """Stop beating (the fault drills use this to play a rank that hangs)."""
        self._stop.set()
