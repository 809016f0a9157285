"""Control messages: length-prefixed JSON over a Unix socket. No pickle: a message is data, never code.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. ``Channel`` buffers
partial frames, so a wait can time out mid-frame and resume without losing bytes.
"""
from __future__ import annotations

import json
import select
import socket
import struct
import threading

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20  # control only; tensors travel through the arena


class ChannelClosed(ConnectionError):
    """The peer closed the connection."""


class Channel:
    """One end of a control connection. ``send`` is thread-safe; ``recv`` belongs to one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._send_lock = threading.Lock()

    def send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {len(data)} bytes is too large; send tensors through the arena")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _pop_frame(self) -> dict | None:
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > MAX_MESSAGE_BYTES:
            raise ValueError(f"peer sent a {length}-byte control frame (limit {MAX_MESSAGE_BYTES})")
        if len(self._buf) < _HEADER.size + length:
            return None
        data = bytes(self._buf[_HEADER.size : _HEADER.size + length])
        del self._buf[: _HEADER.size + length]
        msg = json.loads(data)
        if not isinstance(msg, dict):
            raise ValueError("control message is not a JSON object")
        return msg

    def recv(self, timeout: float | None) -> dict | None:
        """The next message, or None when ``timeout`` seconds pass first. Raises ChannelClosed at EOF."""
        msg = self._pop_frame()
        if msg is not None:
            return msg
        while True:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ChannelClosed("the other end closed the control connection")
            self._buf += chunk
            msg = self._pop_frame()
            if msg is not None:
                return msg
            # A partial frame: keep waiting for the rest with whatever time the caller allowed.

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
