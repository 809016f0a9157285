"""Sealed records: what the ranks put in torchrun's TCP store, encrypted and authenticated with the backend's secret.

torch's TCP store has no credentials: anyone who can reach its port can read and overwrite keys. The ranks carry
their op headers and outcomes through it, so each record is sealed with a key only the backend's processes hold (its
token, read from the private run directory; never written to the store):

    record = version (1 byte) || nonce (16) || tag (32) || ciphertext
    ciphertext = plaintext XOR SHAKE-256(enc_key || nonce)          (the XOF as a stream cipher)
    tag = HMAC-SHA256(mac_key, context || nonce || ciphertext)       (encrypt-then-MAC)

``context`` is the store key the record is written under, so a record moved to another key (a replayed header) does
not open. A record that does not open is refused (``Tampered``), never acted on. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

_VERSION = b"\x01"
_NONCE, _TAG = 16, 32


class Tampered(ValueError):
    """A record that was not sealed with this backend's secret, or was changed after it was."""


class Sealer:
    """Seals and opens records with keys derived from one secret."""

    def __init__(self, secret: str | bytes):
        secret = secret.encode() if isinstance(secret, str) else secret
        self._enc = hmac.new(secret, b"comfy-parallel/encrypt", hashlib.sha256).digest()
        self._mac = hmac.new(secret, b"comfy-parallel/authenticate", hashlib.sha256).digest()

    def _xor(self, nonce: bytes, data: bytes) -> bytes:
        stream = hashlib.shake_256(self._enc + nonce).digest(len(data))
        return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")

    def _tag(self, context: str, nonce: bytes, ciphertext: bytes) -> bytes:
        return hmac.new(self._mac, context.encode() + b"\0" + nonce + ciphertext, hashlib.sha256).digest()

    def name(self, label: str) -> str:
        """A name for ``label`` that only holders of the secret can work out: a store key a stranger cannot name."""
        return hmac.new(self._mac, b"name\0" + label.encode(), hashlib.sha256).hexdigest()[:32]

    def seal(self, context: str, plaintext: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        ciphertext = self._xor(nonce, plaintext)
        return _VERSION + nonce + self._tag(context, nonce, ciphertext) + ciphertext

    def open(self, context: str, record: bytes) -> bytes:
        """The plaintext of ``record`` written under ``context``; Tampered when it does not authenticate."""
        if len(record) < 1 + _NONCE + _TAG or record[:1] != _VERSION:
            raise Tampered(f"{context}: not a sealed record")
        nonce, tag, ciphertext = (
            record[1 : 1 + _NONCE],
            record[1 + _NONCE : 1 + _NONCE + _TAG],
            record[1 + _NONCE + _TAG :],
        )
        if not hmac.compare_digest(tag, self._tag(context, nonce, ciphertext)):
            raise Tampered(
                f"{context}: the record does not authenticate (written by someone without the secret, or changed since)"
            )
        return self._xor(nonce, ciphertext)
