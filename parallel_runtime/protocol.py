"""Control messages between the client and rank 0: typed frames, as length-prefixed JSON over a Unix socket.

A frame on the socket is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON: an object whose
``type`` names one of the frame classes below and whose other keys are that class's fields. ``Channel.recv`` rebuilds
the frame and checks every field (``serial``); anything else is a ``BadFrame`` carrying the id it claimed, so rank 0
can answer it with an error instead of falling over. No pickle: a message is data, never code. Tensors travel
through the arena; a frame carries only their ``TensorDesc``. ``Channel`` buffers partial frames, so a wait can time
out mid-frame and resume without losing bytes.

    client                                   rank 0
    Hello(token)                       ──▶
                                       ◀──   Welcome | Refused
    Call(id, op, args, tensors)        ──▶
    Cancel(id)                         ──▶   (any time while the call runs)
                                       ◀──   Progress(id, step, total, text)*
                                       ◀──   Result | Error | CancelledReply | Fatal
    Shutdown                           ──▶
                                       ◀──   Bye
"""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import struct
import threading
from typing import Any, ClassVar

from .arena import TensorDesc
from .serial import WireError, from_json, to_json

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20  # control only; tensors travel through the arena


class ChannelClosed(ConnectionError):
    """The peer closed the connection."""


class BadFrame(ValueError):
    """A frame that is not JSON, names no known type, or has a missing or mistyped field.

    ``call_id`` is the id the frame claimed (when it had a string one), so the reply can name the call it refuses.
    """

    def __init__(self, message: str, call_id: str | None = None):
        super().__init__(message)
        self.call_id = call_id


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: ClassVar[str]


@dataclasses.dataclass(frozen=True)
class Hello(Frame):
    kind: ClassVar[str] = "hello"
    token: str


@dataclasses.dataclass(frozen=True)
class Welcome(Frame):
    kind: ClassVar[str] = "welcome"
    world_size: int
    pid: int


@dataclasses.dataclass(frozen=True)
class Refused(Frame):
    kind: ClassVar[str] = "refused"
    reason: str


@dataclasses.dataclass(frozen=True)
class Call(Frame):
    """Run op ``op``; ``args`` is the op's arguments dataclass as JSON (``wire``), checked by rank 0."""

    kind: ClassVar[str] = "call"
    id: str
    op: str
    args: dict[str, Any]
    tensors: dict[str, TensorDesc]


@dataclasses.dataclass(frozen=True)
class Cancel(Frame):
    kind: ClassVar[str] = "cancel"
    id: str


@dataclasses.dataclass(frozen=True)
class Shutdown(Frame):
    kind: ClassVar[str] = "shutdown"


@dataclasses.dataclass(frozen=True)
class Bye(Frame):
    kind: ClassVar[str] = "bye"


@dataclasses.dataclass(frozen=True)
class Progress(Frame):
    """Step ``step`` of ``total`` of the running call; ``text`` names a stage ("loading transformer")."""

    kind: ClassVar[str] = "progress"
    id: str
    step: int
    total: int
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class Result(Frame):
    """The call succeeded on every rank: rank 0's result, every rank's (by rank), rank 0's output tensors."""

    kind: ClassVar[str] = "result"
    id: str
    result: Any
    per_rank: tuple[Any, ...]
    tensors: dict[str, TensorDesc]


@dataclasses.dataclass(frozen=True)
class Error(Frame):
    """The call failed on ``rank`` (None: before any rank ran it) and every rank got back in step. ``widget`` names the
    input a request that cannot work should change (the client raises it as InvalidInput)."""

    kind: ClassVar[str] = "error"
    id: str | None
    rank: int | None
    error_type: str
    message: str
    traceback: str = ""
    widget: str | None = None


@dataclasses.dataclass(frozen=True)
class CancelledReply(Frame):
    """Every rank stopped the call at the same step boundary (``steps_by_rank``); ``reached_at_step`` is the last step
    rank 0 had reported when the Cancel reached it, so the ranks stop there or one step later."""

    kind: ClassVar[str] = "cancelled"
    id: str
    steps_by_rank: tuple[int | None, ...]
    reached_at_step: int | None = None


@dataclasses.dataclass(frozen=True)
class Fatal(Frame):
    """A rank failed and left the others stuck in a collective: the group is going down."""

    kind: ClassVar[str] = "fatal"
    id: str
    rank: int | None
    message: str
    traceback: str = ""


FRAMES: dict[str, type[Frame]] = {
    cls.kind: cls
    for cls in (Hello, Welcome, Refused, Call, Cancel, Shutdown, Bye, Progress, Result, Error, CancelledReply, Fatal)
}


def encode_frame(frame: Frame) -> bytes:
    return json.dumps({"type": frame.kind, **to_json(frame)}, separators=(",", ":")).encode()


def decode_frame(data: bytes) -> Frame:
    """The frame in ``data``, every field checked; BadFrame otherwise."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadFrame(f"control frame is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise BadFrame("control frame is not a JSON object")
    call_id = message.get("id") if isinstance(message.get("id"), str) else None
    kind = FRAMES.get(message.pop("type", None)) if isinstance(message.get("type"), str) else None
    if kind is None:
        raise BadFrame(f"unknown control frame type; known: {', '.join(FRAMES)}", call_id)
    try:
        return from_json(kind, message)
    except (WireError, RecursionError) as e:
        raise BadFrame(f"bad {kind.kind} frame: {e}", call_id) from None


class Channel:
    """One end of a control connection. ``send`` is thread-safe; ``recv`` belongs to one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._send_lock = threading.Lock()

    def send(self, frame: Frame) -> None:
        data = encode_frame(frame)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {len(data)} bytes is too large; send tensors through the arena")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _pop_frame(self) -> Frame | None:
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > MAX_MESSAGE_BYTES:
            # The stream cannot be resynchronised after this: the caller must drop the connection.
            raise ChannelClosed(f"peer sent a {length}-byte control frame (limit {MAX_MESSAGE_BYTES})")
        if len(self._buf) < _HEADER.size + length:
            return None
        data = bytes(self._buf[_HEADER.size : _HEADER.size + length])
        del self._buf[: _HEADER.size + length]
        return decode_frame(data)

    def recv(self, timeout: float | None) -> Frame | None:
        """The next frame, or None when ``timeout`` seconds pass first. Raises ChannelClosed at EOF and BadFrame for a
        frame that does not check (the connection stays usable: the next frame is read normally)."""
        frame = self._pop_frame()
        if frame is not None:
            return frame
        while True:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ChannelClosed("the other end closed the control connection")
            self._buf += chunk
            frame = self._pop_frame()
            if frame is not None:
                return frame
            # A partial frame: keep waiting for the rest with whatever time the caller allowed.

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
