"""Authenticated control messages between the ranks of one tensor-parallel group.

Every rank holds the same secret. When the group forms, each rank draws a nonce; all the
ranks' nonces make the session id, and each rank proves the secret with an HMAC of its rank
and the session, so a process that joined the group without the secret is refused before
any of its messages is read. Each message then carries the sender's sequence number and an
HMAC-SHA256 over the session, the sender, that number and the bytes: a forged, altered,
replayed or reordered message, or one from another session, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

NONCE_BYTES = 16
MAC_BYTES = 32
_SEQ = struct.Struct("<Q")
_RANK = struct.Struct("<I")


class ControlAuthError(ValueError):
    """A rank or a message that does not prove the group's secret."""


def session_id(nonces: list[bytes]) -> bytes:
    """The session of the ranks that drew ``nonces`` (in rank order)."""
    return hashlib.sha256(b"travelator-tp-session\0" + b"".join(nonces)).digest()


class ControlAuth:
    """Rank ``rank``'s side of one session: it seals what it sends and opens what it gets."""

    def __init__(self, key: bytes, rank: int, size: int, session: bytes) -> None:
        self._key = key
        self.rank = rank
        self._session = session
        self._sent = 0
        self._expected = [0] * size  # the next sequence number of each sender

    def proof(self, rank: int | None = None) -> bytes:
        """What rank ``rank`` (this one by default) shows to prove the secret in this session."""
        rank = self.rank if rank is None else rank
        return hmac.digest(self._key, b"join\0" + _RANK.pack(rank) + self._session, "sha256")

    def check_proofs(self, proofs: list[bytes]) -> None:
        """Refuse the group unless every other rank proved the secret."""
        bad = [r for r, p in enumerate(proofs) if r != self.rank and not hmac.compare_digest(p, self.proof(r))]
        if bad:
            raise ControlAuthError(f"tensor-parallel rank(s) {', '.join(map(str, bad))} did not prove the "
                                   f"shared secret (TRAVELATOR_TP_SECRET): refusing the group")

    def seal(self, payload: bytes) -> bytes:
        """``payload`` framed as ``sequence number | MAC | payload``."""
        seq = _SEQ.pack(self._sent)
        self._sent += 1
        return seq + self._mac(self.rank, seq, payload) + payload

    def open(self, sender: int, frame: bytes) -> bytes:
        """The payload of ``frame`` from ``sender``, if it is that sender's next message."""
        head = _SEQ.size + MAC_BYTES
        if len(frame) < head:
            raise ControlAuthError(f"control message from rank {sender} too short ({len(frame)} bytes)")
        seq, mac, payload = frame[:_SEQ.size], frame[_SEQ.size:head], frame[head:]
        if not hmac.compare_digest(mac, self._mac(sender, seq, payload)):
            raise ControlAuthError(f"control message from rank {sender} has a bad MAC (forged, altered, "
                                   f"or from another session)")
        (n,) = _SEQ.unpack(seq)
        if n != self._expected[sender]:
            raise ControlAuthError(f"control message from rank {sender} replayed or out of order: sequence "
                                   f"number {n}, expected {self._expected[sender]}")
        self._expected[sender] += 1
        return payload

    def _mac(self, sender: int, seq: bytes, payload: bytes) -> bytes:
        return hmac.digest(self._key, self._session + _RANK.pack(sender) + seq + payload, "sha256")
