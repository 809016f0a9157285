"""How ranks agree on what to run next and how it went, without collectives that can wedge.

Op headers and per-rank outcomes travel through torchrun's TCP store (plain JSON strings), not through
collectives on the work group: a rank waiting for the next op, or for the others' outcomes, waits with a
deadline and can still notice that its client died. Only the op's own work (and the input-tensor
broadcast) uses collectives.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..arena import DTYPES

# After one rank reports an error, how long the others may take to report before we conclude they are
# stuck in a collective that the failed rank will never join (then the group must be torn down).
ERROR_GRACE_S = 5.0
ACKED = b"acked"  # op seq's acknowledgement key is settled either so, or as b"gave-up:<rank>"


def _wait(store: dist.Store, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except (RuntimeError, dist.DistError):  # DistStoreError on timeout
        return False


class Group:
    """The op protocol between rank 0 and the other ranks."""

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store = dist.PrefixStore("parallel_diffusers", store)
        self.rank = rank
        self.world_size = world_size

    # -- rank 0 -----------------------------------------------------------------------------------
    def post(self, seq: int, header: dict) -> None:
        self.store.set(f"op/{seq}", json.dumps(header))

    def collect(self, seq: int, own: dict) -> list[dict] | int | None:
        """Every rank's outcome of op ``seq`` (rank 0's is ``own``); or, when the group cannot go on, the rank
        that gave up on it (an int), or None when a rank failed and the rest did not report within
        ERROR_GRACE_S. Call ``finish(seq)`` afterwards."""
        outcomes: list[dict | None] = [own] + [None] * (self.world_size - 1)
        failed_since = None if own.get("ok") else time.monotonic()

        def take(r: int) -> None:
            nonlocal failed_since
            outcomes[r] = json.loads(self.store.get(f"done/{seq}/{r}"))
            if not outcomes[r].get("ok") and failed_since is None:
                failed_since = time.monotonic()

        while (pending := next((r for r, o in enumerate(outcomes) if o is None), None)) is not None:
            # The common case costs one round trip per rank: wait (returns as soon as it is set), then get.
            if _wait(self.store, f"done/{seq}/{pending}", 0.05 if failed_since is None else 0.2):
                take(pending)
                continue
            # ``pending`` is slow: look at the others, so that a failure elsewhere starts the grace period.
            for r in range(pending + 1, self.world_size):
                if outcomes[r] is None and self.store.check([f"done/{seq}/{r}"]):
                    take(r)
            if failed_since is not None and time.monotonic() - failed_since > ERROR_GRACE_S:
                return None
        # The acknowledgement races a failed rank that gave up waiting for it (and is leaving the group): one
        # atomic compare-and-set decides, so both sides agree whether the group goes on.
        settled = self.store.compare_set(f"ack/{seq}", "", ACKED)
        if settled != ACKED:
            return int(settled.decode().rsplit(":", 1)[1])
        return outcomes  # type: ignore[return-value]

    def finish(self, seq: int) -> None:
        """Drop op ``seq``'s keys: after the reply, off the client's critical path."""
        for key in [f"op/{seq}", f"ack/{seq - 1}"] + [f"done/{seq}/{r}" for r in range(1, self.world_size)]:
            self.store.delete_key(key)

    # -- ranks 1..N-1 ---------------------------------------------------------------------------------
    def next_header(self, seq: int, poll_s: float = 1.0) -> dict | None:
        """Op ``seq``'s header, or None if it has not been posted within ``poll_s``."""
        key = f"op/{seq}"
        if not _wait(self.store, key, poll_s):
            return None
        return json.loads(self.store.get(key))

    def report(self, seq: int, outcome: dict) -> bool:
        """Send this rank's outcome. After a failure, wait for rank 0's acknowledgement: False means rank 0
        never came back (it is stuck in a collective this rank left), so this rank must end the group."""
        self.store.set(f"done/{seq}/{self.rank}", json.dumps(outcome))
        if outcome.get("ok"):
            return True
        _wait(self.store, f"ack/{seq}", ERROR_GRACE_S + 2.0)
        return self.store.compare_set(f"ack/{seq}", "", f"gave-up:{self.rank}") == ACKED


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, layout: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Rank 0's input tensors to every rank (as bytes, so bool and bfloat16 pass through gloo unchanged)."""
    out = {}
    for key in sorted(layout):
        d = layout[key]
        t = tensors[key] if tensors is not None else torch.empty(d["shape"], dtype=DTYPES[d["dtype"]])
        if t.numel():
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=0)
        out[key] = t
    return out
