"""Rank 0's side of the control connection: authenticate the client, run its calls, stream events.

One client at a time. A reader thread handles the socket (so a ``cancel`` arrives while an op runs); the
main thread runs ops in order, so everything the ranks do stays in one sequence.
"""
from __future__ import annotations

import hmac
import logging
import os
import queue
import socket
import threading

from ..arena import Arena, ArenaReader
from ..protocol import Channel, ChannelClosed
from .rank import SHUTDOWN_OP, Rank

log = logging.getLogger("parallel_runtime.worker.server")

HELLO_TIMEOUT_S = 5.0


class Server:
    def __init__(self, rank: Rank, *, socket_path: str, shm_prefix: str):
        self.rank = rank
        self.socket_path = socket_path
        with open(os.path.join(os.path.dirname(socket_path), "token")) as f:
            self.token = f.read().strip()
        self.arena = Arena(f"{shm_prefix}-out")
        self.inputs = ArenaReader()
        self.requests: queue.Queue = queue.Queue()
        self.channel: Channel | None = None
        self.current_call: str | None = None
        self.seq = 0  # ops posted to the group so far
        rank.send_progress = self._send_progress

    # -- socket side ----------------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path + ".tmp")
        os.chmod(self.socket_path + ".tmp", 0o600)
        # Appear under the final name only once listening, so a client that sees the file can connect.
        listener.listen(4)
        os.rename(self.socket_path + ".tmp", self.socket_path)
        return listener

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            sock, _ = listener.accept()
            channel = Channel(sock)
            try:
                hello = channel.recv(HELLO_TIMEOUT_S)
                token = hello.get("token", "") if hello and hello.get("type") == "hello" else ""
                if not hmac.compare_digest(str(token).encode(), self.token.encode()):
                    log.warning("refused a connection with a wrong or missing token")
                    channel.send({"type": "refused", "reason": "wrong token"})
                    channel.close()
                    continue
                channel.send({"type": "welcome", "world_size": self.rank.world_size, "pid": os.getpid()})
            except (OSError, ValueError, ChannelClosed):
                channel.close()
                continue
            old, self.channel = self.channel, channel  # a reconnecting client replaces its old connection
            if old is not None:
                old.close()
            threading.Thread(target=self._read_loop, args=(channel,), name="control-reader", daemon=True).start()

    def _read_loop(self, channel: Channel) -> None:
        while True:
            try:
                msg = channel.recv(None)
            except (OSError, ValueError, ChannelClosed):
                return
            kind = msg.get("type")
            if kind == "cancel":
                if msg.get("id") == self.current_call:
                    self.rank.cancel_event.set()
            elif kind in ("call", "shutdown"):
                self.requests.put((channel, msg))

    def _send(self, channel: Channel, msg: dict) -> None:
        try:
            channel.send(msg)
        except OSError:
            log.warning("client went away before %s could be delivered", msg.get("type"))

    def _send_progress(self, step: int, total: int, text: str | None) -> None:
        if self.channel is not None and self.current_call is not None:
            self._send(self.channel, {"type": "progress", "id": self.current_call, "step": step, "total": total,
                                      "text": text})

    # -- op side --------------------------------------------------------------------------------------
    def serve(self) -> None:
        listener = self._listen()
        threading.Thread(target=self._accept_loop, args=(listener,), name="control-accept", daemon=True).start()
        try:
            while True:
                channel, msg = self.requests.get()
                if msg["type"] == "shutdown":
                    self.seq += 1
                    self.rank.group.post(self.seq, {"op": SHUTDOWN_OP})
                    self._send(channel, {"type": "bye"})
                    return
                self._run_call(channel, msg)
        finally:
            listener.close()
            self.arena.close()
            self.inputs.close()

    def _run_call(self, channel: Channel, msg: dict) -> None:
        call_id = msg["id"]
        try:
            tensors = self.inputs.view(msg.get("tensors") or {})
        except (OSError, ValueError, TypeError) as e:
            self._send(channel, {"type": "error", "id": call_id, "rank": 0, "error_type": type(e).__name__,
                                 "message": f"could not read the input tensors: {e}", "traceback": ""})
            return
        layout = {k: {"dtype": d["dtype"], "shape": d["shape"]} for k, d in (msg.get("tensors") or {}).items()}
        header = {"op": msg["op"], "args": msg.get("args") or {}, "tensors": layout}
        self.rank.cancel_event.clear()
        self.current_call = call_id
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
            failed = own if not own.get("ok") else {"message": "another rank failed and the rest are stuck"}
            self._send(channel, {"type": "fatal", "id": call_id, "rank": 0 if gave_up is None else gave_up,
                                 "message": failed.get("message", "") if gave_up is None else
                                 f"rank {gave_up} failed while the others were in a collective"})
            self.rank.die(failed)
        self._send(channel, self._reply(call_id, outcomes, out_tensors))
        self.rank.group.finish(seq)

    def _reply(self, call_id: str, outcomes: list[dict], out_tensors: dict) -> dict:
        errors = [(r, o) for r, o in enumerate(outcomes) if not o.get("ok") and o.get("kind") == "error"]
        if errors:
            r, o = errors[0]
            return {"type": "error", "id": call_id, "rank": r, "error_type": o["type"], "message": o["message"],
                    "traceback": o["traceback"]}
        if any(not o.get("ok") for o in outcomes):
            return {"type": "cancelled", "id": call_id, "steps_by_rank": [o.get("step") for o in outcomes]}
        try:
            descs = self.arena.write(out_tensors)
        except (OSError, TypeError) as e:
            return {"type": "error", "id": call_id, "rank": 0, "error_type": type(e).__name__,
                    "message": f"could not return the output tensors: {e}", "traceback": ""}
        return {"type": "result", "id": call_id, "result": outcomes[0]["result"],
                "per_rank": [o["result"] for o in outcomes], "tensors": descs}
