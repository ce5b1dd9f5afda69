"""Framed, authenticated connections: Unix sockets on one host, TCP across hosts.

Why plain sockets and not ZeroMQ: measured by ``benchmarks/transport_choice.py`` (see the
README): for Python request/response traffic a framed Unix socket had the lowest round trip and
the highest pipelined rate, and it needs no extra dependency.

Frame layout (little endian)::

    b"MD" | u16 nbuf | u64 payload_len | nbuf * u64 buffer_len | payload | buffer 0 | ...

``payload`` is a pickle; the buffers are its out-of-band pickle-5 buffers (tensor bytes).

Every connection starts with a mutual HMAC-SHA256 challenge/response over the job's secret token
before a single byte is unpickled: the listener sends a nonce, the dialer answers with its own
nonce and a MAC over both, and the listener proves itself the same way. Anything else is refused,
logged and closed.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy

from monarch_dsl.runtime import serialize
from monarch_dsl.runtime.messages import WIRE_INDEX, WIRE_TYPES

log = logging.getLogger("monarch_dsl.transport")

_HEADER = struct.Struct("<2sHQ")
_LEN = struct.Struct("<Q")
_MAGIC = b"MD"
_HELLO_MAGIC = b"MDv1"
_REFUSED = b"MDno"  # the listener's last words to a dialer whose MAC was wrong
_NONCE = 32
_MAX_BUFFERS = 4096
# A bound on any one part of a frame, so that a corrupt header is an error rather than a wait
# for terabytes. MONARCH_DSL_MAX_MESSAGE_GB raises it.
_MAX_FRAME = int(float(os.environ.get("MONARCH_DSL_MAX_MESSAGE_GB", "64")) * (1 << 30))


def _part_buffer(n: int) -> memoryview:
    """A writable buffer for one frame part. Big ones are ``numpy.empty``: memory the OS maps
    only as bytes arrive (a corrupt header does not make us touch what it claims), 64-byte
    aligned for the tensors built on it, and never zero-filled first."""
    if n < _SMALL:
        return memoryview(bytearray(n))
    return memoryview(numpy.empty(n, dtype=numpy.uint8))


_SMALL = 64 * 1024  # parts smaller than this are read through the shared buffer
HANDSHAKE_TIMEOUT = 10.0
BURST_GAP = 50e-6  # a send this soon after the previous one is part of a burst: batch it
HOLD_BYTES = 256 * 1024


def _nbytes(parts: list) -> int:
    return sum(memoryview(p).nbytes for p in parts)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


class AuthError(ProtocolError):
    """The peer does not hold the job's token."""


def new_token() -> bytes:
    return secrets.token_bytes(32)


# --------------------------------------------------------------------------- addresses


def parse_address(address: str) -> tuple[int, Any]:
    """``unix:/path`` or ``tcp:host:port`` -> (family, sockaddr)."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    if address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected 'tcp:HOST:PORT', got {address!r}")
        return socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))
    raise ValueError(f"expected an address 'unix:/path' or 'tcp:HOST:PORT', got {address!r}")


def listen(address: str) -> tuple[socket.socket, str]:
    """Listen on ``address``; returns the socket and the address to dial (the real port)."""
    family, sockaddr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_UNIX:
        # The socket file lives in a 0700 directory (see controller.py); 0600 on the file too.
        old = os.umask(0o177)
        try:
            sock.bind(sockaddr)
        finally:
            os.umask(old)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    sock.listen(1024)
    if family == socket.AF_UNIX:
        return sock, address
    host, port = sock.getsockname()[:2]
    return sock, f"tcp:{host}:{port}"


def dial(address: str, timeout: float = HANDSHAKE_TIMEOUT) -> socket.socket:
    family, sockaddr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(sockaddr)
    _tune(sock)
    return sock


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --------------------------------------------------------------------------- handshake


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if bytes(data) == _REFUSED:
                raise ProtocolError(_REFUSED)
            raise ProtocolError(f"connection closed during handshake ({len(data)}/{n} bytes)")
        data += chunk
    return bytes(data)


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def handshake_listener(sock: socket.socket, token: bytes, timeout: float = HANDSHAKE_TIMEOUT):
    """Run the listener side of the handshake on an accepted socket; raises AuthError."""
    sock.settimeout(timeout)
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO_MAGIC + ours)
    answer = _recv_exact(sock, len(_HELLO_MAGIC) + _NONCE + 32)
    if answer[:4] != _HELLO_MAGIC:
        raise AuthError(f"not a monarch_dsl peer (first bytes {answer[:4]!r})")
    theirs, mac = answer[4 : 4 + _NONCE], answer[4 + _NONCE :]
    if not hmac.compare_digest(mac, _mac(token, b"dialer", ours, theirs)):
        try:
            sock.sendall(_REFUSED)  # say why, so the dialer's error is clear
        except OSError:
            pass
        raise AuthError("the peer does not hold this job's token")
    sock.sendall(_mac(token, b"listener", theirs, ours))
    sock.settimeout(None)
    _tune(sock)


def handshake_dialer(sock: socket.socket, token: bytes, timeout: float = HANDSHAKE_TIMEOUT):
    sock.settimeout(timeout)
    hello = _recv_exact(sock, len(_HELLO_MAGIC) + _NONCE)
    if hello[:4] != _HELLO_MAGIC:
        raise AuthError(f"not a monarch_dsl listener (first bytes {hello[:4]!r})")
    theirs = hello[4:]
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO_MAGIC + ours + _mac(token, b"dialer", theirs, ours))
    try:
        proof = _recv_exact(sock, 32)
    except ProtocolError as e:
        if e.args and e.args[0] == _REFUSED:
            raise AuthError("the controller refused this connection: wrong token") from None
        raise
    if not hmac.compare_digest(proof, _mac(token, b"listener", ours, theirs)):
        raise AuthError("the listener does not hold this job's token")
    sock.settimeout(None)


# --------------------------------------------------------------------------- frames


def encode(msg: Any) -> list:
    """The parts of one frame, ready for ``sendmsg``. ``msg`` is one of ``WIRE_TYPES``. A
    message holding ``serialize.PerRank`` values gives a ``PerRankParts``: the same for
    every rank but those buffers (``for_rank``)."""
    payload, buffers = serialize.dumps((WIRE_INDEX[type(msg)], *msg))
    header = _HEADER.pack(_MAGIC, len(buffers), len(payload))
    if not buffers:
        return [header + payload] if len(payload) < _SMALL else [header, payload]
    if any(isinstance(b, serialize._PerRankSlot) for b in buffers):
        return PerRankParts([header, payload, *buffers])
    return _frame(header, payload, buffers)


def _frame(header: bytes, payload: bytes, buffers: list) -> list:
    """A frame with out-of-band buffers: the header and the buffers' lengths, the payload,
    the buffers."""
    return [header + b"".join(_LEN.pack(b.nbytes) for b in buffers), payload, *buffers]


class PerRankParts(list):
    """A frame's parts in which some buffers (``serialize._PerRankSlot``) are each rank's
    own: ``[header (no lengths), payload, *buffers]`` until ``for_rank`` makes a frame. Not
    sendable as it is: only the controller's ``Job._send_all`` sends these (tensor batches),
    through ``for_rank``."""


def for_rank(parts: list, rank: int) -> list:
    """The frame ``parts`` (from ``encode``) as rank ``rank`` is sent it."""
    if type(parts) is not PerRankParts:
        return parts
    header, payload, *buffers = parts
    mine = [
        b.per_rank.buffer(rank) if isinstance(b, serialize._PerRankSlot) else b for b in buffers
    ]
    return _frame(header, payload, mine)


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send every byte of ``parts`` (sendmsg may send only some of them)."""
    if len(parts) == 1:
        sock.sendall(parts[0])
        return
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            n = views[0].nbytes
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and views[0].nbytes == 0:
            views.pop(0)


class FrameReader:
    """Reassembles frames from a stream socket.

    ``read()`` performs exactly one ``recv`` (so it never blocks after a selector said the
    socket is readable) and returns the messages completed by it. Small frames are parsed out of
    one shared buffer; big parts are received straight into buffers of their own.
    """

    def __init__(self, sock: socket.socket, size: int = 256 * 1024):
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.pending: list[list] | None = None  # [buffer, bytes filled, size] per frame part
        self.part = 0  # the first part of ``pending`` not filled yet

    def read(self) -> list[Any]:
        if self.pending is not None:
            return self._fill_pending()
        if self.end == len(self.buf):
            self._compact()
        n = self.sock.recv_into(self.view[self.end :])
        if n == 0:
            raise EOFError("connection closed")
        self.end += n
        return self._parse()

    def _compact(self) -> None:
        live = self.end - self.start
        self.buf[:live] = self.buf[self.start : self.end]
        self.start, self.end = 0, live

    def _parse(self) -> list[Any]:
        out = []
        while True:
            avail = self.end - self.start
            if avail < _HEADER.size:
                break
            magic, nbuf, plen = _HEADER.unpack_from(self.buf, self.start)
            if magic != _MAGIC or nbuf > _MAX_BUFFERS or plen > _MAX_FRAME:
                raise ProtocolError(
                    f"bad frame header {bytes(self.buf[self.start : self.start + 12])!r}"
                )
            if not nbuf and _HEADER.size + plen <= len(self.buf):  # the common small frame
                total = _HEADER.size + plen
                if avail < total:
                    if self.start + total > len(self.buf):
                        self._compact()
                    break
                p0 = self.start + _HEADER.size
                self.start += total
                out.append(_loads(bytes(self.view[p0 : p0 + plen]), ()))
                continue
            head = _HEADER.size + nbuf * _LEN.size
            if avail < head:
                break
            lens = [
                _LEN.unpack_from(self.buf, self.start + _HEADER.size + i * _LEN.size)[0]
                for i in range(nbuf)
            ]
            if any(n > _MAX_FRAME for n in lens):
                raise ProtocolError(
                    f"bad frame header: a buffer of {max(lens)} bytes (the limit is {_MAX_FRAME})"
                )
            total = head + plen + sum(lens)
            # A frame with out-of-band buffers or larger than the shared buffer: give every
            # part a buffer of its own and copy what has arrived already.
            self.pending = [[_part_buffer(n), 0, n] for n in (plen, *lens)]
            self.part = 0
            self.start += head
            self._take_from_buffer()
            if self._pending_done():
                out.append(self._finish_pending())
                continue
            break
        if self.start == self.end:
            self.start = self.end = 0
        return out

    def _take_from_buffer(self) -> None:
        """Fill the parts from the shared buffer, from the first one not filled yet (a batch
        of calls can have hundreds of parts: each read costs the parts it fills, not all)."""
        assert self.pending is not None
        pending, i = self.pending, self.part
        while i < len(pending):
            part = pending[i]
            buf, filled, size = part
            take = min(size - filled, self.end - self.start)
            if take:  # (a slice assignment: buf may already be grown past `filled`)
                buf[filled : filled + take] = self.view[self.start : self.start + take]
                self.start += take
                part[1] = filled = filled + take
            if filled < size:
                break
            i += 1
        self.part = i

    def _pending_done(self) -> bool:
        return self.part == len(self.pending)  # type: ignore[arg-type]

    def _finish_pending(self) -> Any:
        parts = [buf.obj for buf, _, _ in self.pending]  # type: ignore[union-attr]
        self.pending = None
        return _loads(parts[0], parts[1:])

    def _fill_pending(self) -> list[Any]:
        assert self.pending is not None
        part = self.pending[self.part]
        buf, filled, size = part
        if size - filled >= _SMALL:  # receive straight into the part
            n = self.sock.recv_into(buf[filled:])
            if n == 0:
                raise EOFError("connection closed in the middle of a frame")
            part[1] = filled + n
            # (the shared buffer is empty: this only moves past the parts now full)
            self._take_from_buffer()
        else:
            self.start = self.end = 0
            n = self.sock.recv_into(self.view)
            if n == 0:
                raise EOFError("connection closed in the middle of a frame")
            self.end = n
            self._take_from_buffer()
        if not self._pending_done():
            return []
        out = [self._finish_pending()]
        return out + self._parse()


def _loads(payload, buffers) -> Any:
    try:
        wire = serialize.loads(payload, buffers)
        return WIRE_TYPES[wire[0]](*wire[1:])
    except Exception as e:  # noqa: BLE001 - anything a bad pickle (or tuple) raises
        return UndecodableMessage(f"{type(e).__name__}: {e}", *_which(payload, buffers))


class _Missing:
    """Stands in for a class or function this process cannot import (``_which``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _Tolerant(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except Exception:  # noqa: BLE001 - a module missing here: keep reading
            return _Missing


def _which(payload, buffers) -> tuple[str, int | None]:
    """The kind of message an undecodable frame is, and its call id when it has one: the
    frame read again with what cannot be imported here replaced (so the caller waiting for
    the answer gets an error instead of nothing)."""
    try:
        wire = _Tolerant(io.BytesIO(payload), buffers=buffers).load()
        kind = WIRE_TYPES[wire[0]]
    except Exception:  # noqa: BLE001 - not even that
        return "", None
    call_id = None
    if kind._fields and kind._fields[0] == "call_id" and isinstance(wire[1], int):
        call_id = wire[1]
    return kind.__name__, call_id


class UndecodableMessage:
    """Stands in for a frame whose pickle could not be loaded: ``kind`` and ``call_id`` when
    they could be read (the receiver fails that call with ``reason``), else it is dropped."""

    def __init__(self, reason: str, kind: str = "", call_id: int | None = None):
        self.reason = reason
        self.kind = kind
        self.call_id = call_id

    def __repr__(self) -> str:
        return f"UndecodableMessage({self.kind or 'a message'}: {self.reason!r})"


class Connection:
    """An authenticated connection: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, sock: socket.socket, peer: str = ""):
        self.sock = sock
        self.peer = peer
        self.reader = FrameReader(sock)
        self._send_lock = threading.Lock()
        self._inbox: list[Any] = []
        self._held: list = []
        self._held_bytes = 0
        self._last_send = 0.0

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        self.send_encoded(encode(msg))

    def send_encoded(self, parts: list) -> None:
        """Send now (after anything held back, so the order on the wire is the call order)."""
        with self._send_lock:
            if self._held:
                parts = self._take_held() + parts
            send_parts(self.sock, parts)

    def send_batched(self, parts: list, on_hold: Callable[[Connection], None]) -> None:
        """Send ``parts`` now, or -- when messages are coming in a burst (the previous one left
        less than ``BURST_GAP`` s ago) -- hold them back to go out with the next ones: one
        syscall and one wake-up of the peer for many messages. Held messages go out when
        ``HOLD_BYTES`` are held, before any immediate send, when a caller is about to wait
        for a result (``future.before_block``), and at the latest when the controller's
        flusher runs ``flush()`` (``on_hold(self)`` is called when holding starts)."""
        now = time.perf_counter()
        with self._send_lock:
            burst = now - self._last_send < BURST_GAP
            self._last_send = now
            if not self._held and not burst:
                send_parts(self.sock, parts)
                return
            start = not self._held
            self._held += parts
            self._held_bytes += len(parts[0]) if len(parts) == 1 else _nbytes(parts)
            if self._held_bytes >= HOLD_BYTES or len(self._held) >= 1000:
                send_parts(self.sock, self._take_held())
                return
        if start:
            on_hold(self)

    def flush(self) -> None:
        """Send whatever is held back."""
        with self._send_lock:
            if self._held:
                send_parts(self.sock, self._take_held())

    def _take_held(self) -> list:
        held, self._held, self._held_bytes = self._held, [], 0
        return held

    def recv(self, before_block: Callable[[], None] | None = None) -> Any:
        """Blocking: the next message (raises EOFError when the peer is gone).
        ``before_block()`` runs whenever no message is at hand and we are about to wait."""
        while not self._inbox:
            if before_block is not None:
                before_block()
            self._inbox.extend(reversed(self.reader.read()))
        return self._inbox.pop()

    def has_buffered(self) -> bool:
        """True if a message has been received but not yet taken by ``recv``."""
        return bool(self._inbox)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
