"""How ranks agree on what to run next and how it went, without collectives that can wedge.

Op headers and per-rank outcomes travel through torchrun's TCP store as sealed records (``sealed``: encrypted and
authenticated with the backend's secret, so another user who reaches the store's port can neither read a prompt nor
inject an op), not through collectives on the work group: a rank waiting for the next op, or for the others'
outcomes, waits with a deadline and can still notice that its client died. Only the op's own work (and the
input-tensor broadcast) uses collectives.

    op/<seq>          OpHeader        rank 0 posts the next op
    done/<seq>/<r>    Outcome         rank r's outcome of it
    ack/<seq>         "acked" | "gave-up:<r>"   one compare-and-set settles whether the group goes on
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..arena import TORCH_DTYPES
from ..sealed import Sealer, Tampered
from ..serial import WireError, from_json, to_json

log = logging.getLogger(__name__)

# After one rank reports an error, how long the others may take to report before we conclude they are
# stuck in a collective that the failed rank will never join (then the group must be torn down).
ERROR_GRACE_S = 5.0
# Store waits that time out make c10d log a warning each time, which would bury the NCCL warnings the rank logs keep.
# So an idle rank waits for the next op as long as it likes (it exits from its orphan watch when its client or
# torchrun's agent dies, never by polling), and rank 0 collecting outcomes waits a second for a rank that is not done
# yet before it looks at the others.
IDLE_WAIT_S = 3600.0
COLLECT_WAIT_S = 1.0
SHUTDOWN_OP = "__shutdown__"
_ACKED = "acked"
_TAMPERED_BACKOFF_S = 0.2  # a forged record is not re-read in a busy loop


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """An input tensor's dtype and shape: what the other ranks allocate to receive rank 0's broadcast of it."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES or any(d < 0 for d in self.shape):
            raise ValueError(f"bad tensor layout {self.dtype} {list(self.shape)}")


@dataclasses.dataclass(frozen=True)
class OpHeader:
    """The op every rank runs next: its name, its arguments (the op's ``wire`` dataclass as JSON), its inputs."""

    op: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, TensorLayout] = dataclasses.field(default_factory=dict)


class OutcomeStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"  # the op raised on this rank; the rank is back in step
    CANCELLED = "cancelled"  # the op stopped at the agreed step boundary


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How op ``seq`` went on one rank.

    Args:
        status: ok, error or cancelled.
        result: the op's result (its ``wire`` dataclass as JSON), when ok; None on ranks that return nothing.
        error_type, message, traceback: the exception, when it failed.
        step: the step it stopped at, when cancelled.
        widget: the widget a request that cannot work names (its message says the fix).
    """

    status: OutcomeStatus
    result: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    step: int | None = None
    widget: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is OutcomeStatus.OK


def _wait(store: dist.Store, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except (RuntimeError, dist.DistError):  # DistStoreError on timeout
        return False


class Group:
    """The op protocol between rank 0 and the other ranks."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, secret: str):
        self.store = dist.PrefixStore("parallel_diffusers", store)
        self.rank = rank
        self.world_size = world_size
        self._sealer = Sealer(secret)

    @property
    def sealer(self) -> Sealer:
        return self._sealer

    def put(self, key: str, value: Any) -> None:
        """A sealed record of the ranks' own at ``key`` (beside the op protocol's: ``remote``'s hellos)."""
        self._put(key, value)

    def get(self, key: str, kind: type) -> Any:
        """The ``kind`` sealed at ``key``; Tampered when it does not open."""
        return self._get(key, kind)

    def _put(self, key: str, value: Any) -> None:
        self.store.set(key, self._seal(key, value))

    def _seal(self, key: str, value: Any) -> bytes:
        return self._sealer.seal(key, json.dumps(to_json(value)).encode())

    def _get(self, key: str, kind: type) -> Any:
        """The record at ``key``; Tampered when it does not open or is not a ``kind``."""
        plain = self._sealer.open(key, self.store.get(key))
        try:
            return from_json(kind, json.loads(plain))
        except (ValueError, WireError) as e:
            raise Tampered(f"{key}: {e}") from None

    # -- rank 0 -----------------------------------------------------------------------------------
    def post(self, seq: int, header: OpHeader) -> None:
        self._put(f"op/{seq}", header)

    def _outcome(self, seq: int, rank: int) -> Outcome | None:
        """Rank ``rank``'s outcome of op ``seq``; None for a forged record (ignored: the rank's own may still come,
        and if it never does the client's watchdog ends the wait)."""
        try:
            return self._get(f"done/{seq}/{rank}", Outcome)
        except Tampered as e:
            log.error("ignored a forged outcome of op %d for rank %d: %s", seq, rank, e)
            time.sleep(_TAMPERED_BACKOFF_S)
            return None

    def collect(self, seq: int, own: Outcome) -> list[Outcome] | int | None:
        """Every rank's outcome of op ``seq`` (rank 0's is ``own``); or, when the group cannot go on, the rank
        that gave up on it (an int), or None when a rank failed and the rest did not report within
        ERROR_GRACE_S. Call ``finish(seq)`` afterwards."""
        outcomes: list[Outcome | None] = [own] + [None] * (self.world_size - 1)
        failed_since = None if own.ok else time.monotonic()

        def take(r: int) -> None:
            nonlocal failed_since
            outcomes[r] = self._outcome(seq, r)
            if outcomes[r] is not None and not outcomes[r].ok and failed_since is None:
                failed_since = time.monotonic()

        while (pending := next((r for r, o in enumerate(outcomes) if o is None), None)) is not None:
            # The common case costs one round trip per rank: wait (returns as soon as it is set), then get.
            if _wait(self.store, f"done/{seq}/{pending}", COLLECT_WAIT_S if failed_since is None else 0.2):
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
        key = f"ack/{seq}"
        acked = self._seal(key, _ACKED)
        settled = self.store.compare_set(key, "", acked)
        if settled != acked:
            gave_up = self._gave_up(key, settled)
            # A forged acknowledgement matters only to a rank that failed and waits for the real one.
            if gave_up is None and all(o.ok for o in outcomes):
                return outcomes  # type: ignore[return-value]
            return 0 if gave_up is None else gave_up
        return outcomes  # type: ignore[return-value]

    def _gave_up(self, key: str, record: bytes) -> int | None:
        """The rank that settled ``key`` as gone; None when a forged record settled it."""
        try:
            return int(json.loads(self._sealer.open(key, record)).rsplit(":", 1)[1])
        except (Tampered, ValueError, IndexError, AttributeError):
            log.error("%s was settled by a record that does not authenticate", key)
            return None

    def finish(self, seq: int) -> None:
        """Drop op ``seq``'s keys: after the reply, off the client's critical path."""
        for key in [f"op/{seq}", f"ack/{seq - 1}"] + [f"done/{seq}/{r}" for r in range(1, self.world_size)]:
            self.store.delete_key(key)

    # -- ranks 1..N-1 ---------------------------------------------------------------------------------
    def next_header(self, seq: int, poll_s: float = IDLE_WAIT_S) -> OpHeader | None:
        """Op ``seq``'s header, or None if it has not been posted within ``poll_s``. A forged header is ignored: rank
        0's own overwrites it when rank 0 posts the op."""
        key = f"op/{seq}"
        if not _wait(self.store, key, poll_s):
            return None
        try:
            return self._get(key, OpHeader)
        except Tampered as e:
            log.error("ignored a forged header for op %d: %s", seq, e)
            time.sleep(_TAMPERED_BACKOFF_S)
            return None

    def report(self, seq: int, outcome: Outcome) -> bool:
        """Send this rank's outcome. After a failure, wait for rank 0's acknowledgement: False means rank 0
        never came back (it is stuck in a collective this rank left), so this rank must end the group."""
        self._put(f"done/{seq}/{self.rank}", outcome)
        if outcome.ok:
            return True
        key = f"ack/{seq}"
        _wait(self.store, key, ERROR_GRACE_S + 2.0)
        gave_up = self._seal(key, f"gave-up:{self.rank}")
        settled = self.store.compare_set(key, "", gave_up)
        if settled == gave_up:
            return False
        try:
            return json.loads(self._sealer.open(key, settled)) == _ACKED
        except (Tampered, ValueError):
            return False


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | None, layout: dict[str, TensorLayout]
) -> dict[str, torch.Tensor]:
    """Rank 0's input tensors to every rank (as bytes, so bool and bfloat16 pass through gloo unchanged)."""
    out = {}
    for key in sorted(layout):
        d = layout[key]
        t = tensors[key] if tensors is not None else torch.empty(d.shape, dtype=TORCH_DTYPES[d.dtype])
        if t.numel():
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=0)
        out[key] = t
    return out
