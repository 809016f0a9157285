"""torchrun's entry point of a backend rank (``python -m parallel_runtime.worker``): rank 0 serves the client, the
other ranks follow it."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..internals import check, untested_diffusers

# Before the imports below reach into diffusers: a renamed internal is one error naming it and the versions, in the
# rank's log that the client's start-up failure shows, not an ImportError from deep inside a module.
check("worker/")

from ..arena import remove_segments  # noqa: E402
from ..processes import process_alive  # noqa: E402
from ..rundir import RunDir  # noqa: E402
from . import remote  # noqa: E402
from .heartbeat import Heartbeat  # noqa: E402
from .rank import Rank  # noqa: E402
from .server import Server  # noqa: E402

log = logging.getLogger("parallel_runtime.worker")


def _redirect_output(run_dir: RunDir, rank: int) -> None:
    """Send this rank's stdout/stderr (Python and C++ alike) to ``rank<N>.log`` in the run directory."""
    fd = os.open(run_dir.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _watch_for_orphaning(client_pid: int, clean_up: Callable[[], None]) -> None:
    """Exit when the client process dies or torchrun's agent (our parent) does: nobody is left to talk to. Only a
    dead client leaves the clean-up to the ranks: a living one owns the run directory and tears the group down."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            client_gone = not process_alive(client_pid)
            if client_gone or os.getppid() != parent:
                log.warning("%s died; exiting", "the client" if client_gone else "torchrun's agent")
                if client_gone:
                    clean_up()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main() -> None:
    run_dir = RunDir(os.environ["COMFY_PARALLEL_RUN_DIR"])
    rank_id = int(os.environ["RANK"])
    if os.environ.get("COMFY_PARALLEL_LOG_TO_FILES", "1") == "1":
        _redirect_output(run_dir, rank_id)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank_id} %(name)s %(levelname)s: %(message)s")
    if (untested := untested_diffusers()) is not None:
        log.warning(untested)
    with open(run_dir.rank_pid(rank_id), "w") as f:
        f.write(str(os.getpid()))
    heartbeat = Heartbeat(run_dir.rank_heartbeat(rank_id))
    # Only the ComfyUI host's ranks have one: a machine that joined (``comfy-parallel join``) has no arena.
    shm_prefix = os.environ.get("COMFY_PARALLEL_SHM_PREFIX")

    def clean_up_for_the_dead_client() -> None:
        # Whichever rank of the client's machine notices first cleans up: torchrun's agent stops the others as
        # soon as one exits, possibly before they get to it. Both steps are safe to repeat. On a machine that
        # joined, the client is ``comfy-parallel join``: its run directory goes too.
        run_dir.remove(shm_prefix)

    _watch_for_orphaning(int(os.environ["COMFY_PARALLEL_CLIENT_PID"]), clean_up=clean_up_for_the_dead_client)
    remote.refuse_object_collectives()
    me = Rank()
    me.state["heartbeat"] = heartbeat
    me.init()
    try:
        if me.rank == 0:
            Server(me, run_dir, shm_prefix=shm_prefix).serve()
        else:
            me.follow()
    finally:
        if me.rank == 0:
            remove_segments(shm_prefix)
    dist.destroy_process_group()
    log.info("rank %d shut down", me.rank)


main()
