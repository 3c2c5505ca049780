"""One authenticated TCP connection between the front end and a worker on another host.

Both ends hold the shared secret (``TRAVELATOR_TP_SECRET``, as tensor parallelism across
hosts). When the connection opens, each end sends a nonce, the two make the session, and each
proves the secret for it (``model/tp_auth.py``, the tensor-parallel control plane's scheme: the
front end is rank 0, the worker rank 1). Then every message is one frame, ``length | sequence
number | HMAC-SHA256 | payload``: a forged, altered, replayed or reordered frame is refused, and
the connection with it. One connection per worker, so a dead worker breaks only its own.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

from travelator.model.tp_auth import MAC_BYTES, NONCE_BYTES, ControlAuth, ControlAuthError, session_id

FRONT_END, WORKER = 0, 1
MAX_FRAME_BYTES = 256 << 20
HANDSHAKE_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("<I")


class LinkClosed(EOFError):
    """The connection ended (its peer went away, or it was refused)."""


class Link:
    """This end of a connection whose handshake is done."""

    def __init__(self, sock: socket.socket, auth: ControlAuth) -> None:
        self.sock = sock
        self._auth = auth
        self._peer = 1 - auth.rank
        self._send_lock = threading.Lock()  # a frame's sequence number and bytes go out together

    @classmethod
    def open(cls, sock: socket.socket, secret: bytes, rank: int) -> Link:
        """Prove ``secret`` to the other end of ``sock`` and check its proof."""
        sock.settimeout(HANDSHAKE_TIMEOUT_S)  # a peer that says nothing does not hold us
        try:
            nonce = os.urandom(NONCE_BYTES)
            sock.sendall(nonce)
            theirs = _read_exact(sock, NONCE_BYTES)
            auth = ControlAuth(secret, rank, 2, session_id([nonce, theirs] if rank == FRONT_END else [theirs, nonce]))
            sock.sendall(auth.proof())
            proofs = [b"", b""]
            proofs[rank], proofs[1 - rank] = auth.proof(), _read_exact(sock, MAC_BYTES)
            auth.check_proofs(proofs)
        except (OSError, ControlAuthError) as exc:
            sock.close()
            raise LinkClosed(f"the handshake failed: {exc}") from None
        sock.settimeout(None)
        _keep_alive(sock)
        return cls(sock, auth)

    def fileno(self) -> int:
        return self.sock.fileno()

    def local_address(self) -> str:
        """The address this end has on the connection: one the peer's host reaches."""
        return self.sock.getsockname()[0]

    def send_bytes(self, payload: bytes) -> None:
        with self._send_lock:
            frame = self._auth.seal(payload)
            try:
                self.sock.sendall(_LENGTH.pack(len(frame)) + frame)
            except OSError as exc:
                raise LinkClosed(f"the connection broke: {exc}") from None

    def recv_bytes(self) -> bytes:
        """The next message; ``LinkClosed`` when the connection ended or a frame was refused."""
        try:
            (size,) = _LENGTH.unpack(_read_exact(self.sock, _LENGTH.size))
            if size > MAX_FRAME_BYTES:
                raise LinkClosed(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
            return self._auth.open(self._peer, _read_exact(self.sock, size))
        except (OSError, ControlAuthError) as exc:
            raise LinkClosed(str(exc)) from None

    def shut(self) -> None:
        """End the connection both ways; a reader blocked on it sees the end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise LinkClosed("the connection closed")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle connection, so that a host that vanished without closing it (powered off,
    cut off) is noticed in about a minute rather than never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
