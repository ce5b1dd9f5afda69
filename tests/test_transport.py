"""Tests of the control plane's transport (framing, the mutual HMAC handshake) and of how the
controller and a worker survive peers that are not what they claim to be.

The first half is pure: ``socket.socketpair()`` and threads, no processes. The second half
drives a real controller ``Job`` with fake workers written here, and real ``python -m
monarch_dsl worker`` processes (marked ``procs``). No test sleeps to synchronize: every wait is
a bounded wait on a condition.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import re
import resource
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import monarch_dsl as md
from monarch_dsl.errors import SupervisionError
from monarch_dsl.runtime import controller, serialize, transport
from monarch_dsl.runtime.messages import (
    CallEndpoint,
    Configure,
    ErrorReply,
    Hello,
    Reply,
    SpawnActor,
    StopWorker,
)

TOKEN = bytes(range(32))
OTHER_TOKEN = bytes(range(1, 33))
HEADER = struct.Struct("<2sHQ")  # the frame layout documented in transport.py
LEN = struct.Struct("<Q")
WAIT = 10.0  # the bound on every blocking wait of the pure tests

# ---- helpers ----------------------------------------------------------------------------------


def _frame(payload: bytes, buffers: tuple[bytes, ...] = (), magic: bytes = b"MD") -> bytes:
    """A raw frame built by hand from the documented layout (independent of ``encode``)."""
    lens = b"".join(LEN.pack(len(b)) for b in buffers)
    return HEADER.pack(magic, len(buffers), len(payload)) + lens + payload + b"".join(buffers)


def _wire(msg: Any) -> bytes:
    """Every byte ``encode`` puts on the wire for ``msg``."""
    return b"".join(bytes(memoryview(p).cast("B")) for p in transport.encode(msg))


@contextlib.contextmanager
def _pair():
    a, b = socket.socketpair()
    a.settimeout(WAIT)
    b.settimeout(WAIT)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


class _Background:
    """Runs ``fn`` in a thread; ``result()`` joins with a timeout and re-raises its error."""

    def __init__(self, fn: Callable[[], Any]):
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = WAIT) -> BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"background call still running after {timeout} s"
        return self.error

    def result(self, timeout: float = WAIT) -> Any:
        if self.join(timeout) is not None:
            raise self.error
        return self.value


def _read_messages(reader: transport.FrameReader, n: int, timeout: float = WAIT) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} messages in {timeout} s"
        out += reader.read()
    assert len(out) == n, f"expected {n} messages, got {len(out)}"
    return out


def _wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``cond`` until it is true; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in list(caplog.records)
        if r.name.startswith("monarch_dsl") and r.levelno >= logging.WARNING
    ]


def _wait_warning(caplog, *needles: str, timeout: float = 5.0) -> str:
    def find() -> str | None:
        for m in _warnings(caplog):
            if all(n in m for n in needles):
                return m
        return None

    found = _wait_for(find, timeout, f"a monarch_dsl warning containing {needles}")
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _r(value: Any, call_id: int = 1) -> Reply:
    """Any value travels as the value of a Reply (frames carry the wire message types)."""
    return Reply(call_id, 0, value)


SMALL_MESSAGES = [
    _r(None),
    _r(-(2**70)),
    _r(3.25),
    _r("héllo ✓"),
    _r(b"\x00MD\xff" * 5),
    _r([1, [2, [3]]]),
    _r({"a": (1, 2), "b": {"c": None}}),
    Hello(3, 1234, "host-a"),
    ErrorReply(4, 1, "Traceback ...\nValueError: x", pickle.dumps(ValueError("x"))),
    SpawnActor(5, 2, "name", dict, (1,), {"k": 2}, ("gpu",), (4,), (0, 1, 2, 3)),
    CallEndpoint(6, 2, "method", ("a", 1), {"b": [2]}),
    Configure(("host", "gpu"), (2, 4)),
    StopWorker(),
]


# ---- framing: round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("msg", SMALL_MESSAGES, ids=[repr(m)[:28] for m in SMALL_MESSAGES])
def test_small_message_round_trip(msg):
    with _pair() as (a, b):
        transport.send_parts(a, transport.encode(msg))
        [got] = _read_messages(transport.FrameReader(b), 1)
    assert _same(got, msg)


@pytest.mark.parametrize("reader_size", [256 * 1024, 1000])
def test_many_small_frames_arriving_in_one_recv(reader_size):
    msgs = [_r({"k": "v" * (i % 17)}, call_id=i) for i in range(500)]
    blob = b"".join(_wire(m) for m in msgs)
    assert len(blob) < 64 * 1024  # fits the socket buffer: one sendall, read afterwards
    with _pair() as (a, b):
        a.sendall(blob)
        reader = transport.FrameReader(b, size=reader_size)
        first = reader.read()
        if reader_size >= len(blob):
            assert len(first) == len(msgs)  # one recv carried every frame
        else:
            assert 1 < len(first) < len(msgs)  # frames straddle the end of the small buffer
        got = first + _read_messages(reader, len(msgs) - len(first))
    assert got == msgs


@pytest.mark.parametrize("reader_size", [256 * 1024, 64])
def test_frames_split_into_one_byte_sends(reader_size):
    """Lockstep: send one byte, read once. Each message must complete exactly at its last
    byte, whether small, bigger than the reader's buffer, or with out-of-band buffers."""
    msgs = [
        _r({"small": 1}),
        _r(("x" * 300, list(range(50)))),  # bigger than a 64-byte reader buffer
        _r({"t": torch.arange(40, dtype=torch.float32), "u": torch.tensor(2, dtype=torch.int8)}),
        Hello(0, 1, "h"),
        StopWorker(),
    ]
    wires = [_wire(m) for m in msgs]
    ends = set(itertools.accumulate(len(w) for w in wires))
    blob = b"".join(wires)
    got: list = []
    with _pair() as (a, b):
        reader = transport.FrameReader(b, size=reader_size)
        for i in range(len(blob)):
            a.sendall(blob[i : i + 1])
            new = reader.read()
            if i + 1 in ends:
                assert len(new) == 1, f"byte {i + 1}: expected a message to complete"
            else:
                assert new == [], f"byte {i + 1}: a message completed before its last byte"
            got += new
    assert len(got) == len(msgs)
    assert all(_same(g, m) for g, m in zip(got, msgs))


def test_large_tensors_travel_out_of_band_and_round_trip():
    big = torch.randn(4 * 1024 * 1024)  # 16 MiB of float32
    assert big.nbytes == 16 * 1024 * 1024
    view = big.view(2048, 2048).t()[::2, 1:]  # non-contiguous view of the big tensor
    assert not view.is_contiguous()
    small_view = torch.arange(64 * 64, dtype=torch.float64).reshape(64, 64).t()[::3, 1:]
    value = {
        "big": big,
        "view": view,
        "small_view": small_view,
        "bf16": torch.randn(37, 3).to(torch.bfloat16),
        "bf16_scalar": torch.tensor(1.5, dtype=torch.bfloat16),  # (numpy has no bfloat16)
        "complex": torch.randn(4, 2, dtype=torch.complex64),
        "empty_2d_int": torch.empty(3, 0, dtype=torch.int16),
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(-7, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "grad": torch.randn(5, requires_grad=True),
        "nested": [torch.ones(2, 2, dtype=torch.int32), "text"],
    }
    msg = Reply(9, 1, value)
    parts = transport.encode(msg)
    sizes = [memoryview(p).nbytes for p in parts]
    # The tensor bytes are out-of-band parts of their own, not copied into the pickle.
    assert big.nbytes in sizes
    assert sizes[1] < 64 * 1024, f"the pickle payload holds tensor bytes: {sizes[1]} bytes"

    with _pair() as (a, b):
        sender = _Background(lambda: transport.send_parts(a, parts))
        [got] = _read_messages(transport.FrameReader(b), 1)
        sender.result()
    assert type(got) is Reply and got[:2] == (9, 1)
    got = got.value
    assert got.keys() == value.keys()
    for k in value:
        assert _same(got[k], value[k]), k
    assert got["view"].shape == (1024, 2047)
    assert got["scalar"].dim() == 0 and got["int_scalar"].dim() == 0


def test_a_snapshot_is_an_independent_copy_of_every_kind_of_tensor_and_travels_as_it_is(
    monkeypatch,
):
    """serialize.snapshot (a call's local argument, md.to_mesh's value): equal to the tensor,
    contiguous, sharing no memory with it, unchanged by a later write to the original, a local
    tensor even under a mesh's activation, and it arrives as it is when sent (after a write to
    the copy, too), pickled from what it kept when it was made (no torch op when sent)."""
    from monarch_dsl.runtime.serialize import snapshot

    big = torch.randn(1 << 16)  # 256 KiB
    values = [
        big,
        big.view(512, -1)[:, 1:],  # not contiguous
        big.to(torch.bfloat16).view(256, 256),  # (numpy has no bfloat16: copied as bytes)
        torch.randn(4096, 8, dtype=torch.complex64),
        torch.arange(1 << 16, dtype=torch.int64).view(4, -1),
        torch.tensor(2.5),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.empty(0, 3),
        torch.randn(64, requires_grad=True),
        torch.randn(8, 8).conj(),  # (a real tensor's conj is itself)
        torch.randn(4, 4, dtype=torch.complex64).conj(),  # a lazy conjugate: cloned
    ]
    for v in values:
        s = snapshot(v)
        assert type(s) is torch.Tensor and s.is_contiguous() and not s.requires_grad
        assert s.shape == v.shape and s.dtype == v.dtype
        assert torch.equal(s, v.detach().resolve_conj())
        if v.numel():
            assert s.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
            before = s.clone()
            with torch.no_grad():
                v.add_(1)  # the caller changes the original after
            assert torch.equal(s, before)
            s.view(-1)[0] = 7  # and the copy changed before it is sent is sent so
        with monkeypatch.context() as m:
            if not (v.is_conj() and v.is_complex()):  # (a lazy conjugate's is a clone)
                m.setattr(serialize, "_array_of", lambda t: pytest.fail("a torch op when sent"))
            payload, buffers = serialize.dumps(s)
        got = serialize.loads(payload, [bytearray(b) for b in buffers])
        assert got.dtype == s.dtype and got.shape == s.shape and torch.equal(got, s)
    from torch.testing._internal.two_tensor import TwoTensor

    two = TwoTensor(torch.ones(3), torch.zeros(3))  # a subclass: copied by its own clone
    s = snapshot(two)
    assert type(s) is TwoTensor and torch.equal(s.a, two.a) and torch.equal(s.b, two.b)
    with md.Simulator(hosts=1, gpus=2).mesh.activate():  # factories make mesh tensors here
        s = snapshot(big)
    assert type(s) is torch.Tensor and torch.equal(s, big)


def test_a_per_rank_value_sends_each_rank_its_own_rows_in_one_encoding():
    """serialize.PerRank in a message (a data-parallel batch in a RunPlan): the message is
    pickled once; transport.for_rank gives each rank a frame holding only its rows, which
    arrive as a tensor of its own (rows 0 for a rank it lacks). Two threads encoding such
    messages at once each get their own ranks' rows."""
    from monarch_dsl import isa
    from monarch_dsl.runtime.messages import RunBatch
    from monarch_dsl.runtime.serialize import PerRank, snapshot

    def message(whole: torch.Tensor, rows: dict) -> tuple[Any, Any]:
        per_rank = PerRank(snapshot(whole), rows)
        scalar = snapshot(torch.tensor(3.0))  # (sent whole beside it)
        ins = isa.RunPlan(1, 0, (-1, -1), (5,), (), "main", "t.py:1", ((1, scalar),))
        return RunBatch(((0, ins._replace(parts=((0, per_rank),))),)), per_rank

    whole = torch.arange(64 * 256, dtype=torch.float32).view(64, 256)  # 1 KiB rows
    msg, per_rank = message(whole, {0: (0, 48), 1: (48, 64), 2: (0, 48)})
    parts = transport.encode(msg)
    sizes = {}
    for rank, want in ((0, whole[:48]), (1, whole[48:]), (2, whole[:48]), (3, whole[:0])):
        frame = transport.for_rank(parts, rank)
        sizes[rank] = sum(memoryview(p).nbytes for p in frame)
        with _pair() as (a, b):
            sender = _Background(lambda a=a, frame=frame: transport.send_parts(a, frame))
            [got] = _read_messages(transport.FrameReader(b), 1)
            sender.result()
        ins = got.items[0][1]
        (k, part), (j, scalar) = ins.parts[0], ins.sent[0]
        assert (k, j) == (0, 1) and torch.equal(scalar, torch.tensor(3.0))
        assert part.shape == want.shape and torch.equal(part, want), rank
        if len(part):
            part.add_(1)  # its own memory: writable
    assert sizes[0] - sizes[1] == 32 * 1024 and sizes[0] == sizes[2]
    assert sizes[3] < 1024  # no rows: the frame is the message alone
    assert torch.equal(per_rank.whole, whole)  # the sender's copy is untouched

    # Two threads at once, each its own PerRank values (the slot is the thread's own).
    def encode_many(offset: float) -> list:
        out = []
        for _ in range(200):
            m, _ = message(whole + offset, {0: (0, 32), 1: (32, 64)})
            frame = transport.for_rank(transport.encode(m), 1)
            out.append(b"".join(bytes(memoryview(p).cast("B")) for p in frame))
        return out

    threads = [_Background(lambda o=o: encode_many(o)) for o in (0.0, 0.5)]
    for o, t in zip((0.0, 0.5), threads):
        for wire in t.result():
            reader_sock, writer_sock = socket.socketpair()
            with reader_sock, writer_sock:
                writer_sock.sendall(wire)
                [got] = _read_messages(transport.FrameReader(reader_sock), 1)
            assert torch.equal(got.items[0][1].parts[0][1], whole[32:] + o)


class _Held:
    """A message's object, which a test watches through a weak reference."""

    def __reduce__(self):
        return (_Held, ())


def test_nothing_of_a_sent_message_stays_alive_in_the_pickler():
    """Once encoded and dropped, a message's objects (its tensors, its snapshots) are freed at
    once, by the thread that drops it. A pickler kept per thread held them in its memo until
    the next message, whose ``clear_memo()`` freed them: a tensor's dealloc releases the GIL,
    and another thread's garbage collection then walked the half-cleared memo into freed
    objects (the controller died of SIGSEGV now and then while issuing compiled calls)."""
    import weakref

    from monarch_dsl import isa
    from monarch_dsl.runtime.messages import RunBatch

    for make in (
        lambda: _Held(),
        lambda: serialize.snapshot(torch.randn(64, 64)),  # (from numpy: its dealloc's GIL)
        lambda: torch.randn(4, 4),
    ):
        held = make()
        gone = weakref.ref(held)
        msg = RunBatch(((0, isa.Fetch(1, 2, "main", "x.py:1")), (0, (held, [held]))))
        transport.encode(msg)
        del msg, held
        assert gone() is None, "an object of the sent message outlived it"


def test_big_frames_interleaved_with_small_ones():
    big = torch.arange(3 * 1024 * 1024, dtype=torch.int32)  # 12 MiB
    blob_msg = {"blob": os.urandom(300_000)}  # no out-of-band buffer, bigger than the buffer
    msgs = [_r(v) for v in (1, {"t": big}, "two", blob_msg, (3,), {"t": big[::7]}, "end")]
    with _pair() as (a, b):

        def send_all() -> None:
            for m in msgs:
                transport.send_parts(a, transport.encode(m))

        sender = _Background(send_all)
        got = _read_messages(transport.FrameReader(b), len(msgs))
        sender.result()
    assert all(_same(g, m) for g, m in zip(got, msgs))


def test_a_frame_of_hundreds_of_parts_round_trips():
    """A batch of compiled calls is one frame with two buffers per call: hundreds of parts, of
    every size the reader treats apart (through the shared buffer, straight into their own
    buffer, empty), arriving over many reads; then a small frame after it."""
    sizes = [16 * 1024, 0, 70 * 1024, 1, 4096, 200 * 1024]
    value = [torch.full((sizes[i % len(sizes)] // 4,), float(i)) for i in range(600)]
    msgs = [_r(value), _r("after")]
    with _pair() as (a, b):

        def send_all() -> None:
            for m in msgs:
                transport.send_parts(a, transport.encode(m))

        sender = _Background(send_all)
        reader = transport.FrameReader(b)
        got = _read_messages(reader, len(msgs))
        sender.result()
    assert len(transport.encode(msgs[0])) > 500  # (header, payload, and the tensors' parts)
    assert all(_same(g, m) for g, m in zip(got, msgs))
    assert reader.pending is None


# ---- framing: bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE GARBAGE GARBAGE GARBAGE",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        _frame(b"payload", magic=b"DM"),
        b"\x00" * 64,
    ],
    ids=["ascii", "http", "swapped-magic", "zeros"],
)
def test_bad_magic_is_a_protocol_error(data):
    with _pair() as (a, b):
        a.sendall(data)
        with pytest.raises(transport.ProtocolError):
            _read_messages(transport.FrameReader(b), 1)


@pytest.mark.parametrize(
    "data",
    [
        HEADER.pack(b"MD", 0, 2**64 - 1),
        HEADER.pack(b"MD", 65535, 8),
        HEADER.pack(b"MD", 1, 8) + LEN.pack(2**64 - 1),
    ],
    ids=["payload-2^64", "65535-buffers", "buffer-2^64"],
)
def test_impossible_length_header_is_a_protocol_error(data):
    with _pair() as (a, b):
        a.sendall(data)
        with pytest.raises(transport.ProtocolError):
            _read_messages(transport.FrameReader(b), 1)


def _no_huge_allocations(monkeypatch, limit: int = 1 << 30) -> None:
    """Make a frame-part buffer of more than ``limit`` bytes fail like a real allocation would
    (MemoryError), without trying it."""
    real = transport._part_buffer

    def guarded(n: int):
        if n > limit:
            raise MemoryError(f"transport.py asked for a {n}-byte buffer")
        return real(n)

    monkeypatch.setattr(transport, "_part_buffer", guarded)


ABSURD_HEADERS = [
    HEADER.pack(b"MD", 0, 1 << 39),  # a 512 GiB pickle, over the 64 GiB part bound
    HEADER.pack(b"MD", 2, 8) + LEN.pack(1 << 39) + LEN.pack(1 << 39),
]


@pytest.mark.parametrize("data", ABSURD_HEADERS, ids=["payload-512GiB", "buffers-2x512GiB"])
def test_absurd_length_header_is_a_protocol_error_not_an_allocation(monkeypatch, data):
    _no_huge_allocations(monkeypatch)
    with _pair() as (a, b):
        a.sendall(data)
        with pytest.raises(transport.ProtocolError):
            _read_messages(transport.FrameReader(b), 1)


@pytest.mark.parametrize(
    "cut",
    [5, "mid-header", "mid-payload", "mid-buffer", "last-byte"],
)
@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
def test_truncated_frame_then_eof_is_eof_error(cut, big):
    msg = _r({"t": torch.arange(200_000 if big else 10, dtype=torch.float32), "s": "x"})
    wire = _wire(msg)
    nbuf = HEADER.unpack_from(wire)[1]
    head = HEADER.size + nbuf * LEN.size
    plen = HEADER.unpack_from(wire)[2]
    at = {
        "mid-header": head - 3,
        "mid-payload": head + plen // 2,
        "mid-buffer": head + plen + 20,
        "last-byte": len(wire) - 1,
    }.get(cut, cut)
    with _pair() as (a, b):
        reader = transport.FrameReader(b)

        def send_truncated() -> None:
            a.sendall(_wire(_r("first")) + wire[:at])
            a.shutdown(socket.SHUT_WR)

        sender = _Background(send_truncated)  # more than a socket buffer holds: a thread
        got: list = []
        with pytest.raises(EOFError):
            for _ in range(10_000):  # each read() is one recv; EOF comes after the data
                got += reader.read()
        sender.result()
        assert got == [_r("first")]


def test_undecodable_pickle_is_reported_and_the_stream_goes_on():
    bad_frames = [
        _frame(b"this is not a pickle"),
        _frame(pickle.dumps((1, 2, 0, "x"))[:-3]),  # truncated pickle inside a complete frame
        _frame(b"\x80\x05\x95garbage", buffers=(b"abc", b"defg")),
        _frame(b"c__nonexistent_module__\nthing\n."),  # refers to a module that is not there
        _frame(pickle.dumps({"a": 1})),  # a valid pickle, but not a wire message
        _frame(pickle.dumps((99, 1, 2))),  # no such message type
        _frame(pickle.dumps((0, 1))),  # a Hello with fields missing
    ]
    blob = b"".join(f + _wire(_r("ok", i)) for i, f in enumerate(bad_frames))
    with _pair() as (a, b):
        a.sendall(blob)
        got = _read_messages(transport.FrameReader(b), 2 * len(bad_frames))
    for i in range(len(bad_frames)):
        assert isinstance(got[2 * i], transport.UndecodableMessage), got[2 * i]
        assert got[2 * i].reason
        assert got[2 * i + 1] == _r("ok", i)


# ---- handshake --------------------------------------------------------------------------------


@contextlib.contextmanager
def _stream_pair(kind: str):
    """A connected (listener side, dialer side) pair over a socketpair or TCP loopback."""
    if kind == "socketpair":
        with _pair() as pair:
            yield pair
        return
    lsock, address = transport.listen("tcp:127.0.0.1:0")
    lsock.settimeout(WAIT)
    try:
        d = transport.dial(address, timeout=WAIT)
        s, _ = lsock.accept()
        try:
            yield s, d
        finally:
            s.close()
            d.close()
    finally:
        lsock.close()


def _listener_side(sock: socket.socket, token: bytes, timeout: float = WAIT) -> _Background:
    def run() -> None:
        try:
            transport.handshake_listener(sock, token, timeout=timeout)
        except BaseException:
            sock.close()  # as the controller does: a refused peer is cut off
            raise

    return _Background(run)


@pytest.mark.parametrize("kind", ["socketpair", "tcp"])
def test_handshake_with_the_same_token_succeeds_and_connection_works(kind):
    with _stream_pair(kind) as (ls, ds):
        listener = _listener_side(ls, TOKEN)
        transport.handshake_dialer(ds, TOKEN, timeout=WAIT)
        listener.result()
        assert ls.gettimeout() is None and ds.gettimeout() is None  # blocking again
        ls.settimeout(WAIT)
        ds.settimeout(WAIT)
        lc, dc = transport.Connection(ls), transport.Connection(ds)
        dc.send(Hello(0, 1, "h"))
        assert lc.recv() == Hello(0, 1, "h")
        lc.send(_r({"t": torch.ones(3)}))
        assert torch.equal(dc.recv().value["t"], torch.ones(3))


def test_handshake_with_a_wrong_token_fails_on_both_sides():
    with _pair() as (ls, ds):
        listener = _listener_side(ls, TOKEN)
        with pytest.raises(transport.ProtocolError):
            transport.handshake_dialer(ds, OTHER_TOKEN, timeout=WAIT)
        err = listener.join()
    assert isinstance(err, transport.AuthError), repr(err)
    assert "token" in str(err)


def test_dialer_refuses_a_listener_that_cannot_prove_the_token():
    with _pair() as (ls, ds):

        def impostor() -> bytes:
            ls.sendall(b"MDv1" + os.urandom(32))
            answer = transport._recv_exact(ls, 4 + 32 + 32)
            ls.sendall(os.urandom(32))  # a made-up proof
            return answer

        fake = _Background(impostor)
        with pytest.raises(transport.AuthError):
            transport.handshake_dialer(ds, TOKEN, timeout=WAIT)
        assert fake.result()[:4] == b"MDv1"


def test_a_replayed_dialer_answer_is_refused():
    """The MAC covers the listener's fresh nonce: an answer recorded from one handshake does
    not open another."""
    with _pair() as (ls, ds):
        listener = _listener_side(ls, TOKEN)

        # Play the dialer by hand once, to capture a valid answer.
        hello = transport._recv_exact(ds, 36)
        ours = os.urandom(32)
        answer = b"MDv1" + ours + transport._mac(TOKEN, b"dialer", hello[4:], ours)
        ds.sendall(answer)
        transport._recv_exact(ds, 32)
        listener.result()
    with _pair() as (ls, ds):
        listener = _listener_side(ls, TOKEN)
        transport._recv_exact(ds, 36)
        ds.sendall(answer)  # the recorded answer, for a different nonce
        err = listener.join()
    assert isinstance(err, transport.AuthError), repr(err)


@pytest.mark.parametrize(
    "data, error",
    [
        (b"G" * 68, transport.AuthError),
        (b"GET / HTTP/1.1\r\nHost: example\r\nUser-Agent: x\r\nAccept: */*\r\n\r\n", None),
        (b"MDv1" + b"\x00" * 64, transport.AuthError),  # right magic, wrong MAC
        (_wire(Hello(0, 1, "h")) * 3, transport.AuthError),  # a frame without the handshake
        (b"MDv1 short", transport.ProtocolError),  # then the peer hangs up
    ],
    ids=["garbage", "http", "zero-mac", "frame-first", "short"],
)
def test_listener_refuses_a_peer_sending_garbage(data, error):
    with _pair() as (ls, ds):
        listener = _listener_side(ls, TOKEN)
        ds.sendall(data)
        ds.shutdown(socket.SHUT_WR)
        err = listener.join()
    assert isinstance(err, error or transport.ProtocolError), repr(err)


def test_dialer_refuses_a_listener_sending_garbage():
    with _pair() as (ls, ds):
        ls.sendall(b"SSH-2.0-OpenSSH_9.0\r\n" + b"x" * 40)
        with pytest.raises(transport.AuthError):
            transport.handshake_dialer(ds, TOKEN, timeout=WAIT)


def test_listener_gives_up_on_a_silent_peer_within_its_timeout():
    with _pair() as (ls, ds):
        start = time.monotonic()
        listener = _listener_side(ls, TOKEN, timeout=0.3)
        err = listener.join(timeout=5)
        elapsed = time.monotonic() - start
        assert isinstance(err, (OSError, transport.ProtocolError)), repr(err)
        assert 0.25 <= elapsed < 3, elapsed
        del ds


def test_dialer_gives_up_on_a_silent_listener_within_its_timeout():
    with _pair() as (ls, ds):
        start = time.monotonic()
        with pytest.raises((OSError, transport.ProtocolError)):
            transport.handshake_dialer(ds, TOKEN, timeout=0.3)
        assert time.monotonic() - start < 3
        del ls


# ---- a real controller Job --------------------------------------------------------------------


class FakeWorker:
    """A worker played by the test: dials, handshakes, says Hello, and answers on demand."""

    def __init__(self, address: str, token: bytes, rank: int):
        self.rank = rank
        sock = transport.dial(address, timeout=WAIT)
        transport.handshake_dialer(sock, token, timeout=WAIT)
        sock.settimeout(WAIT)
        self.sock = sock
        self.conn = transport.Connection(sock, peer=address)

    def hello(self) -> FakeWorker:
        self.conn.send(Hello(self.rank, os.getpid(), socket.gethostname()))
        return self

    def next_request(self) -> Any:
        while True:
            msg = self.conn.recv()
            if not isinstance(msg, Configure):
                return msg

    def close(self) -> None:
        self.conn.close()


class Jobs:
    """Creates controller Jobs and fake workers; stops and closes them all at teardown."""

    def __init__(self):
        self.jobs: list[controller.Job] = []
        self.fakes: list[FakeWorker] = []

    def job(self, world: int = 1, **kwargs: Any) -> controller.Job:
        job = controller.Job(("gpu",), (world,), **kwargs)
        self.jobs.append(job)
        return job

    def fake(self, job: controller.Job, rank: int, token: bytes | None = None) -> FakeWorker:
        fake = FakeWorker(job.address, token or job.token, rank)
        self.fakes.append(fake)
        return fake

    def close(self) -> None:
        for fake in self.fakes:
            fake.close()
        for job in self.jobs:
            job.stop(timeout=1.0)


@pytest.fixture
def jobs():
    j = Jobs()
    try:
        yield j
    finally:
        j.close()


@pytest.fixture
def warnings_log(caplog):
    caplog.set_level(logging.WARNING, logger="monarch_dsl")
    return caplog


def _joined(job: controller.Job, timeout: float = WAIT) -> None:
    job.wait_joined(timeout=timeout, progress=lambda a, b: None)


def _ping(job: controller.Job, fake: FakeWorker, value: Any) -> None:
    """A full call through the job: request -> the fake worker -> Reply -> the future."""
    fut = job.request(
        [fake.rank], lambda cid: CallEndpoint(cid, 7, "ping", (value,), {}), finish=list
    )
    msg = fake.next_request()
    assert isinstance(msg, CallEndpoint) and msg.args == (value,), msg
    fake.conn.send(Reply(msg.call_id, fake.rank, ("pong", value)))
    assert fut.get(timeout=WAIT) == [("pong", value)]


def _spawn_dict(job: controller.Job, rank: int = 0) -> None:
    """A full call through a real worker: it builds a ``dict()`` actor and acknowledges."""
    fut = job.request(
        [rank],
        lambda cid: SpawnActor(cid, 1, "d", dict, (), {}, job.dims, job.sizes, (rank,)),
        finish=list,
    )
    assert fut.get(timeout=30) == [None]


def test_unix_socket_directory_is_private(jobs):
    job = jobs.job()
    assert job.address.startswith("unix:")
    path = Path(job.address[5:])
    st = path.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert st.st_uid == os.getuid()
    assert st.st_mode & 0o077 == 0, oct(st.st_mode)
    dst = path.parent.stat()
    assert dst.st_uid == os.getuid()
    assert stat.S_IMODE(dst.st_mode) == 0o700, oct(dst.st_mode)
    job.stop()
    assert not path.parent.exists()  # cleaned up


def test_tcp_listens_on_loopback_by_default(jobs):
    hosts = md.remote_hosts(1)
    address = hosts.listen({"gpu": 1})
    jobs.jobs.append(hosts._job)
    m = re.fullmatch(r"tcp:127\.0\.0\.1:(\d+)", address)
    assert m, address
    assert int(m.group(1)) > 0
    assert hosts._job.listener.getsockname()[0] == "127.0.0.1"
    assert hosts.command()[-1] == address
    assert hosts.env() == {"MONARCH_DSL_TOKEN": hosts._job.token.hex()}

    job = jobs.job(listen="tcp:127.0.0.1:0")
    assert re.fullmatch(r"tcp:127\.0\.0\.1:[1-9]\d*", job.address), job.address


def _start_worker(
    address: str, token_hex: str, err_path: Path, rank: int = 0, **kw: Any
) -> subprocess.Popen:
    err = open(err_path, "w")  # noqa: SIM115 - the child owns the file from here
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "monarch_dsl", "worker", "--connect", address]
            + ["--rank", str(rank)],
            env=dict(os.environ, MONARCH_DSL_TOKEN=token_hex),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            **kw,
        )
    finally:
        err.close()


@contextlib.contextmanager
def _worker(address: str, token_hex: str, tmp_path: Path, rank: int = 0, **kw: Any):
    proc = _start_worker(address, token_hex, tmp_path / f"worker{rank}.err", rank, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)  # only the worker this test started, by pid
        proc.wait(timeout=10)


@pytest.mark.procs
@pytest.mark.parametrize("listen", [None, "tcp:127.0.0.1:0"], ids=["unix", "tcp"])
def test_job_refuses_peers_without_the_token_then_accepts_a_worker(
    jobs, warnings_log, tmp_path, listen
):
    job = jobs.job(listen=listen)

    # 1. A raw socket that sends garbage instead of the handshake.
    family, sockaddr = transport.parse_address(job.address)
    with socket.socket(family, socket.SOCK_STREAM) as raw:
        raw.settimeout(WAIT)
        raw.connect(sockaddr)
        raw.sendall(b"GET / HTTP/1.1\r\n" + b"X" * 100)
        assert raw.recv(4)[:4] in (b"MDv1", b"")
        _wait_warning(warnings_log, "refused a connection", job.address, "not a monarch_dsl peer")

    # 2. A real handshake with a wrong token: the job refuses, and the dialer learns it.
    with pytest.raises(transport.ProtocolError):
        FakeWorker(job.address, OTHER_TOKEN, 0)
    _wait_warning(warnings_log, "refused a connection", "does not hold this job's token")
    assert not job.hellos and not job.conns

    # 3. A real worker with the token still joins, and a call goes through it.
    with _worker(job.address, job.token.hex(), tmp_path) as proc:
        _joined(job, timeout=60)
        assert job.hellos[0].pid == proc.pid
        _spawn_dict(job)
        job.stop()
        assert proc.wait(timeout=10) == 0
    assert "Traceback" not in (tmp_path / "worker0.err").read_text()


@pytest.mark.parametrize(
    "garbage",
    ["bad-magic", "impossible-length", "truncated-then-eof"],
)
def test_garbage_after_the_handshake_kills_only_that_rank(jobs, warnings_log, garbage):
    job = jobs.job(world=2)
    other_job = jobs.job(listen="tcp:127.0.0.1:0")
    bad, good = jobs.fake(job, 0).hello(), jobs.fake(job, 1).hello()
    other = jobs.fake(other_job, 0).hello()
    _joined(job)
    _joined(other_job)
    _ping(job, bad, "before")

    if garbage == "bad-magic":
        bad.sock.sendall(b"GARBAGE GARBAGE GARBAGE GARBAGE")
    elif garbage == "impossible-length":
        bad.sock.sendall(HEADER.pack(b"MD", 0, 2**64 - 1))
    else:
        wire = _wire(_r({"t": torch.arange(100_000)}))
        bad.sock.sendall(wire[: len(wire) // 2])
        # Half a frame: the controller waits for the rest without blocking anyone else.
        _ping(job, good, "during")
        _ping(other_job, other, "during")
        assert 0 not in job.dead
        bad.sock.shutdown(socket.SHUT_RDWR)

    _wait_for(lambda: 0 in job.dead, 5, "rank 0 to be marked dead")
    _wait_warning(warnings_log, "rank 0", "lost its connection")
    assert job._thread.is_alive()  # the receiver thread survived
    with pytest.raises(SupervisionError, match="rank 0"):
        job.check_alive([0])
    with pytest.raises(SupervisionError):
        job.request([0], lambda cid: CallEndpoint(cid, 7, "ping", (), {}))
    # The other rank of the same job, and another job, keep working.
    _ping(job, good, "after")
    _ping(other_job, other, "after")
    assert 1 not in job.dead and not other_job.dead


def test_undecodable_frame_after_the_handshake_is_dropped_and_logged(jobs, warnings_log):
    job = jobs.job()
    fake = jobs.fake(job, 0).hello()
    _joined(job)
    fake.sock.sendall(_frame(b"definitely not a pickle"))
    _wait_warning(warnings_log, "dropped a message", "rank 0", "UndecodableMessage")
    assert not job.dead
    _ping(job, fake, "still here")


def test_garbage_glued_to_the_hello_is_refused_and_the_rank_can_join_again(jobs, warnings_log):
    job = jobs.job()
    first = jobs.fake(job, 0)
    first.sock.sendall(_wire(Hello(0, os.getpid(), "h")) + b"GARBAGE GARBAGE GARBAGE!")
    _wait_warning(warnings_log, "refused a connection", "bad frame header")
    assert not job.hellos
    again = jobs.fake(job, 0).hello()
    _joined(job)
    _ping(job, again, "ok")


def test_absurd_length_after_the_handshake_kills_only_that_rank(jobs, monkeypatch, warnings_log):
    _no_huge_allocations(monkeypatch)
    job = jobs.job(world=2)
    bad, good = jobs.fake(job, 0).hello(), jobs.fake(job, 1).hello()
    _joined(job)
    bad.sock.sendall(ABSURD_HEADERS[0])
    _wait_for(lambda: 0 in job.dead or not job._thread.is_alive(), 5, "rank 0 to be dead")
    assert job._thread.is_alive(), "the receiver thread died"
    _ping(job, good, "after")


# ---- a real worker against a fake controller --------------------------------------------------


@contextlib.contextmanager
def _fake_controller(tmp_path: Path, **popen_kw: Any):
    """Listen, start a real worker, accept and authenticate it; yields (conn, proc, stderr)."""
    lsock, address = transport.listen("tcp:127.0.0.1:0")
    lsock.settimeout(60)
    try:
        with _worker(address, TOKEN.hex(), tmp_path, **popen_kw) as proc:
            sock, _ = lsock.accept()
            try:
                transport.handshake_listener(sock, TOKEN, timeout=WAIT)
                sock.settimeout(30)
                conn = transport.Connection(sock)
                hello = conn.recv()
                assert isinstance(hello, Hello) and hello.rank == 0 and hello.pid == proc.pid
                yield conn, proc, tmp_path / "worker0.err"
            finally:
                sock.close()
    finally:
        lsock.close()


@pytest.mark.procs
def test_worker_survives_an_undecodable_frame_and_exits_cleanly_on_garbage(tmp_path):
    with _fake_controller(tmp_path) as (conn, proc, err_path):
        conn.sock.sendall(_frame(b"not a pickle at all"))
        conn.send(Configure(("gpu",), (1,)))
        # The worker is still serving: a call after the bad frame is answered.
        conn.send(SpawnActor(5, 1, "d", dict, (), {}, ("gpu",), (1,), (0,)))
        assert conn.recv() == Reply(5, 0, None)
        conn.sock.sendall(b"GARBAGE GARBAGE GARBAGE GARBAGE")
        code = proc.wait(timeout=30)
    err = err_path.read_text()
    assert code in (0, 1), (code, err)  # an orderly exit, not a signal
    assert "Traceback" not in err, err
    assert "dropped a message" in err and "UndecodableMessage" in err, err
    # Reported as a bad frame from the controller, not as a failure to join.
    assert re.search(r"worker 0\b.*bad frame header", err), err
    assert "cannot join" not in err, err


def _limit_memory() -> None:  # in the worker: a huge allocation fails fast, never OOMs the box
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))


@pytest.mark.procs
def test_worker_exits_cleanly_on_an_absurd_length_header(tmp_path):
    with _fake_controller(tmp_path, preexec_fn=_limit_memory) as (conn, proc, err_path):
        conn.sock.sendall(ABSURD_HEADERS[0])
        code = proc.wait(timeout=30)
    err = err_path.read_text()
    assert code == 1, (code, err)
    assert "Traceback" not in err, err
    assert "worker 0" in err and "bad frame header" in err, err


@pytest.mark.procs
def test_worker_with_a_wrong_token_fails_to_join(jobs, warnings_log, tmp_path):
    job = jobs.job(listen="tcp:127.0.0.1:0")
    with _worker(job.address, OTHER_TOKEN.hex(), tmp_path) as proc:
        code = proc.wait(timeout=60)
    err = (tmp_path / "worker0.err").read_text()
    assert code != 0
    assert "cannot join" in err and job.address in err and "wrong token" in err, err
    assert "Traceback" not in err, err
    _wait_warning(warnings_log, "refused a connection", "does not hold this job's token")
    assert not job.hellos


def test_a_dialer_with_a_wrong_token_is_told_why(jobs):
    job = jobs.job(listen="tcp:127.0.0.1:0")
    with pytest.raises(transport.ProtocolError, match="token"):
        FakeWorker(job.address, OTHER_TOKEN, 0)


@pytest.mark.procs
def test_worker_without_a_usable_token_says_so():
    procs = [  # both at once: each pays for importing torch
        subprocess.Popen(
            [sys.executable, "-m", "monarch_dsl", "worker", "--connect", "tcp:127.0.0.1:1"],
            env=dict(os.environ, MONARCH_DSL_TOKEN=token),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for token in ("", "not-hex")
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 2, err
            assert "MONARCH_DSL_TOKEN" in err and "Traceback" not in err, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, 9)
                proc.wait(timeout=10)


def test_big_part_grown_ahead_then_finished_through_the_shared_buffer():
    """A big part is received straight into its own buffer, grown ahead of its bytes; when the
    rest is small it comes through the shared buffer and must land right after the bytes
    already received (not after the growth)."""
    t = torch.arange(50_000, dtype=torch.float32)  # 200 KB: one out-of-band buffer
    wire = _wire(_r(t))
    head = len(wire) - t.numel() * 4  # header, lengths and pickle: everything but the tensor
    with _pair() as (a, b):
        reader = transport.FrameReader(b)
        got = []
        a.sendall(wire[:head])
        while reader.pending is None:
            got += reader.read()
        a.sendall(wire[head : head + 170_000])
        while reader.pending[1][1] < 170_000:
            got += reader.read()
        assert not got and len(reader.pending[1][0]) > reader.pending[1][1]  # grown ahead
        a.sendall(wire[head + 170_000 :])  # 30 KB: below the direct-receive threshold
        while not got:
            got += reader.read()
    assert torch.equal(got[0].value, t)


def test_code_sent_by_value_keeps_its_file_and_lines():
    """A class or function of the user's script travels by value with its file name and line
    numbers: remote tracebacks, breakpoint() tables and errors name the user's file:line."""
    from monarch_dsl.runtime import serialize

    src = (
        "def f(x):\n    def g():\n        return x + 1\n    return g\n\n"
        "class C:\n    def m(self):\n        return f(1)\n"
    )
    ns: dict = {"__name__": "__main__"}
    exec(compile(src, "/home/user/train.py", "exec"), ns)
    f2, c2 = serialize.loads(*serialize.dumps((ns["f"], ns["C"])))
    assert f2.__code__.co_filename == "/home/user/train.py"
    assert f2(41).__code__.co_filename == "/home/user/train.py"  # nested code too
    assert c2.m.__code__.co_filename == "/home/user/train.py"
    assert c2.m.__code__.co_firstlineno == 7 and f2(41)() == 42
