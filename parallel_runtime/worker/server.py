"""Rank 0's side of the control connection: authenticate the client, run its calls, stream events.

One client at a time: a second connection that proves the token while the first is still open is refused with a
message saying so (never left waiting). Each new connection says hello in a thread of its own with a deadline, so a
peer that connects and sends nothing delays nobody. A reader thread handles the client's socket (so a ``Cancel``
arrives while an op runs); the main thread runs calls in order, so everything the ranks do stays in one sequence.
A frame that does not check gets an error reply and the connection goes on.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import socket
import threading

from ..arena import Arena, ArenaReader
from ..protocol import (
    BadFrame,
    Bye,
    Call,
    Cancel,
    CancelledReply,
    Channel,
    ChannelClosed,
    Error,
    Fatal,
    Frame,
    Hello,
    Progress,
    Refused,
    Result,
    Shutdown,
    Welcome,
)
from ..rundir import RunDir
from ..serial import WireError, from_json
from .group import SHUTDOWN_OP, OpHeader, Outcome, OutcomeStatus, TensorLayout
from .ops import OpError, PeerFailed, get_op
from .rank import Rank

log = logging.getLogger("parallel_runtime.worker.server")

HELLO_TIMEOUT_S = 5.0
MAX_PENDING_HELLOS = 128  # connections still saying hello (each for at most HELLO_TIMEOUT_S); more are closed


class Server:
    def __init__(self, rank: Rank, run_dir: RunDir, *, shm_prefix: str):
        self.rank = rank
        self.socket_path = run_dir.socket
        with open(run_dir.token) as f:
            self.token = f.read().strip()
        self.arena = Arena(f"{shm_prefix}-out")
        self.inputs = ArenaReader()
        self.requests: queue.Queue[tuple[Channel, Frame]] = queue.Queue()
        self.channel: Channel | None = None  # the client's connection
        self._channel_lock = threading.Lock()
        self._hellos = threading.BoundedSemaphore(MAX_PENDING_HELLOS)
        self.current_call: str | None = None
        # The current call's last reported step, and what it was when a Cancel arrived: the client's view of the
        # steps lags the ranks' by the socket and its own polling, so the reply says where the Cancel landed.
        self.last_step = 0
        self.cancel_reached_at: int | None = None
        self.seq = 0  # ops posted to the group so far
        rank.send_progress = self._send_progress

    # -- socket side ----------------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path + ".tmp")
        os.chmod(self.socket_path + ".tmp", 0o600)
        # Appear under the final name only once listening, so a client that sees the file can connect.
        listener.listen(16)
        os.rename(self.socket_path + ".tmp", self.socket_path)
        return listener

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            sock, _ = listener.accept()
            if not self._hellos.acquire(blocking=False):
                sock.close()  # a flood of silent connections: drop the newest rather than queue behind them
                continue
            threading.Thread(target=self._greet, args=(Channel(sock),), name="control-hello", daemon=True).start()

    def _greet(self, channel: Channel) -> None:
        try:
            hello = channel.recv(HELLO_TIMEOUT_S)
            token = hello.token if isinstance(hello, Hello) else ""
            if not hmac.compare_digest(token.encode(), self.token.encode()):
                log.warning("refused a connection with a wrong or missing token")
                channel.send(Refused("wrong token"))
                channel.close()
                return
            with self._channel_lock:
                if self.channel is not None:
                    log.warning("refused a second client while one is connected")
                    channel.send(
                        Refused(
                            "another client is connected to this backend; it serves one client (one ComfyUI) at a time"
                        )
                    )
                    channel.close()
                    return
                self.channel = channel
            channel.send(Welcome(world_size=self.rank.world_size, pid=os.getpid()))
        except (OSError, ValueError, ChannelClosed):
            channel.close()
            return
        finally:
            self._hellos.release()
        threading.Thread(target=self._read_loop, args=(channel,), name="control-reader", daemon=True).start()

    def _read_loop(self, channel: Channel) -> None:
        try:
            while True:
                try:
                    frame = channel.recv(None)
                except BadFrame as e:
                    log.warning("refused a control frame: %s", e)
                    self._send(channel, Error(id=e.call_id, rank=None, error_type="BadFrame", message=str(e)))
                    continue
                if isinstance(frame, Cancel):
                    if frame.id == self.current_call and not self.rank.cancel_event.is_set():
                        self.cancel_reached_at = self.last_step
                        self.rank.cancel_event.set()
                elif isinstance(frame, (Call, Shutdown)):
                    self.requests.put((channel, frame))
        except (OSError, ChannelClosed):
            with self._channel_lock:
                if self.channel is channel:
                    self.channel = None
            channel.close()

    def _send(self, channel: Channel, frame: Frame) -> None:
        try:
            channel.send(frame)
        except OSError:
            log.warning("client went away before %s could be delivered", frame.kind)

    def _send_progress(self, step: int, total: int, text: str | None) -> None:
        channel, call_id = self.channel, self.current_call
        self.last_step = step
        if channel is not None and call_id is not None:
            self._send(channel, Progress(id=call_id, step=step, total=total, text=text))

    # -- op side --------------------------------------------------------------------------------------
    def serve(self) -> None:
        listener = self._listen()
        threading.Thread(target=self._accept_loop, args=(listener,), name="control-accept", daemon=True).start()
        try:
            while True:
                channel, frame = self.requests.get()
                if isinstance(frame, Shutdown):
                    self.seq += 1
                    self.rank.group.post(self.seq, OpHeader(SHUTDOWN_OP))
                    self._send(channel, Bye())
                    return
                self._run_call(channel, frame)
        finally:
            listener.close()
            self.arena.close()
            self.inputs.close()

    def _refuse(self, channel: Channel, call: Call, e: Exception, what: str) -> None:
        self._send(channel, Error(id=call.id, rank=None, error_type=type(e).__name__, message=f"{what}: {e}"))

    def _run_call(self, channel: Channel, call: Call) -> None:
        # Everything that can be checked before the ranks act is checked here, so a bad call costs one error reply.
        try:
            from_json(get_op(call.op).args, call.args)
        except (OpError, WireError) as e:
            return self._refuse(channel, call, e, f"refused op {call.op!r}")
        try:
            tensors = self.inputs.view(call.tensors)
        except (OSError, ValueError, TypeError) as e:
            return self._refuse(channel, call, e, "could not read the input tensors")
        layout = {k: TensorLayout(d.dtype, d.shape) for k, d in call.tensors.items()}
        header = OpHeader(op=call.op, args=call.args, tensors=layout)
        self.rank.cancel_event.clear()
        self.last_step, self.cancel_reached_at = 0, None
        self.current_call = call.id
        self.seq += 1
        seq = self.seq
        self.rank.group.post(seq, header)
        own, out_tensors = self.rank.execute(header, tensors)
        outcomes = self.rank.group.collect(seq, own)
        self.current_call = None
        if not isinstance(outcomes, list):
            # ``outcomes`` is the rank that gave up on the group, or None: rank 0 failed and the others are
            # stuck in a collective. The client reads that rank's traceback from the run directory.
            gave_up = outcomes
            failed = (
                own
                if not own.ok
                else Outcome(OutcomeStatus.ERROR, message="another rank failed and the rest are stuck")
            )
            self._send(
                channel,
                Fatal(
                    id=call.id,
                    rank=0 if gave_up is None else gave_up,
                    message=failed.message
                    if gave_up is None
                    else f"rank {gave_up} failed while the others were in a collective",
                ),
            )
            self.rank.die(failed)
        self._send(channel, self._reply(call.id, outcomes, out_tensors))
        self.rank.group.finish(seq)

    def _reply(self, call_id: str, outcomes: list[Outcome], out_tensors: dict) -> Frame:
        # The rank that says what to change goes first, then a rank's own failure (the others only report that another
        # rank refused or failed).
        errors = sorted(
            ((r, o) for r, o in enumerate(outcomes) if o.status is OutcomeStatus.ERROR),
            key=lambda ro: (ro[1].widget is None, ro[1].error_type == PeerFailed.__name__),
        )
        if errors:
            r, o = errors[0]
            return Error(
                id=call_id, rank=r, error_type=o.error_type, message=o.message, traceback=o.traceback, widget=o.widget
            )
        if any(o.status is OutcomeStatus.CANCELLED for o in outcomes):
            return CancelledReply(
                id=call_id, steps_by_rank=tuple(o.step for o in outcomes), reached_at_step=self.cancel_reached_at
            )
        try:
            descs = self.arena.write(out_tensors)
        except (OSError, TypeError) as e:
            return Error(
                id=call_id, rank=0, error_type=type(e).__name__, message=f"could not return the output tensors: {e}"
            )
        return Result(id=call_id, result=outcomes[0].result, per_rank=tuple(o.result for o in outcomes), tensors=descs)
