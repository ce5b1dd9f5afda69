"""Pick the controller <-> worker control-plane transport by measurement.

``monarch_dsl`` has one controller process that drives worker processes over a control plane.
This script compares candidate transports for that plane against a single echo worker that is
started as a separate process (``multiprocessing`` "spawn" context) and always shut down at
the end, also on error or Ctrl-C (joined, then terminated/killed by PID if it does not exit).

Transports
----------
(a) Unix domain socket (``AF_UNIX``/``SOCK_STREAM``), framed by an 8-byte ``struct`` header
    ``(pickle_len, oob_len)``; the client does blocking I/O in the calling thread.  Receivers
    ``recv_into`` a preallocated 1 MiB buffer and parse as many complete frames per ``recv`` as
    there are (the echo worker answers a whole batch with one ``sendall``).
(b) The same socket and framing, but replies are read by a background receiver thread that
    unpickles them and completes a lightweight future (a ``threading.Lock`` acquired at creation
    and released on completion) which the calling thread waits on.  This is the shape of the
    real controller, so (b) - (a) is the cost of the thread handoff (two wakeups plus the GIL).
(c) pyzmq DEALER (client) / ROUTER (worker) over ``ipc://``, blocking in the calling thread.
(d) The same over ``tcp://127.0.0.1``.
(e) Plain TCP loopback socket with ``TCP_NODELAY``, same framing and client code as (a).

Messages are pickled with protocol 5.  A 16 MiB payload travels as a ``pickle.PickleBuffer``
out of band: sockets send ``[header, pickle, payload]`` with one ``sendmsg`` (no concatenation
copy) and ``recv_into`` a fresh ``bytearray``; zmq sends the parts as a zero-copy multipart
message and unpickles from ``Frame.buffer``.  The echo worker echoes frames as-is (it does not
unpickle); the client pickles every request and unpickles every reply, in every transport.

Measurements (per transport)
----------------------------
1. Round trip of a small request (a pickled tuple of ~100 bytes): median latency in us of
   ``LAT_RUNS`` runs of ``LAT_N`` sequential round trips; the table shows the median of the
   per-run medians (spread of the run medians is printed below the table).
2. Pipelined throughput: send ``PIPE_N`` small requests without waiting, then read all replies;
   msgs/s, median of ``PIPE_RUNS`` runs.  A single-threaded client cannot just ``sendall``
   10,000 requests: once the kernel buffers are full, both sides block in ``send`` (deadlock).
   So (a)/(e) send with ``MSG_DONTWAIT`` and drain replies whenever a send would block - which
   is what a real single-threaded pipelining client has to do.  zmq queues without limit here
   (HWM set to 0) because a ROUTER silently drops messages at its high-water mark.
3. Round trip of a 16 MiB payload: ms, median of ``BIG_RUNS`` runs (the echo is verified once,
   byte for byte, outside the timed runs).

All five echo workers run side by side and every measurement is taken round-robin over the
transports (order rotated each round), so that phases of host noise hit all transports alike;
the ratios against (a) are more trustworthy than the absolute numbers.  The garbage collector
is disabled inside timed loops (as ``timeit`` does).  On a small, noisy machine, run the
script more than once and compare.  Total run time is about 10 s.  Usage, from the repository
root::

    python benchmarks/transport_choice.py [--transports a,b,c,d,e]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import platform
import select
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq

LAT_RUNS, LAT_N = 5, 2_000
PIPE_RUNS, PIPE_N = 3, 10_000
BIG_RUNS, BIG_SIZE = 5, 16 << 20
WARMUP = 300

# Frame header: (length of the pickle, length of the single out-of-band buffer or 0).
HDR = struct.Struct("<II")
PROTO = 5


def small_request(i: int) -> tuple[Any, ...]:
    """A ~100-byte control message (pickles to ~97-100 bytes)."""
    return ("call", i, "worker.step", (1, 2.5, "x" * 20), {"rank": 0, "tag": "t"})


def dumps(msg: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    oob: list[pickle.PickleBuffer] = []
    return pickle.dumps(msg, protocol=PROTO, buffer_callback=oob.append), oob


# --------------------------------------------------------------------------------------------
# Framing over stream sockets
# --------------------------------------------------------------------------------------------


def sendmsg_all(sock: socket.socket, parts: Sequence[Any]) -> None:
    """``sendmsg`` scatter/gather of all parts, resuming after partial sends."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def send_frame(sock: socket.socket, meta: bytes, oob: pickle.PickleBuffer | None = None) -> None:
    if oob is None:
        sock.sendall(HDR.pack(len(meta), 0) + meta)  # one syscall; the copy is ~100 bytes
    else:
        raw = oob.raw()
        sendmsg_all(sock, [HDR.pack(len(meta), raw.nbytes), meta, raw])


class FrameReader:
    """Buffered frame parser: ``recv_into`` a preallocated buffer, many frames per ``recv``.

    ``next_frame`` returns ``(pickle_view, oob_or_None)``.  The pickle view points into the
    receive buffer and is valid until the next call that has to read from the socket; the
    out-of-band buffer is a fresh ``bytearray`` that the caller owns.
    """

    def __init__(self, sock: socket.socket, size: int = 1 << 20) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def fill(self, need: int = 1, flags: int = 0) -> None:
        """Read at least once from the socket (raises ``BlockingIOError`` with MSG_DONTWAIT)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._start < need or self._end == len(self._buf):
            pending = self._buf[self._start : self._end]  # copy (rare: buffer wrapped)
            if len(self._buf) < need:
                self._buf = bytearray(max(need, 2 * len(self._buf)))
                self._view = memoryview(self._buf)
            self._view[: len(pending)] = pending
            self._start, self._end = 0, len(pending)
        n = self.sock.recv_into(self._view[self._end :], 0, flags)
        if n == 0:
            raise EOFError("peer closed the connection")
        self._end += n

    def next_frame(self, wait: bool = True) -> tuple[memoryview, bytearray | None] | None:
        """The next frame; if ``wait`` is false, None unless a header+pickle is buffered."""
        while True:
            avail = self._end - self._start
            need = HDR.size
            if avail >= need:
                mlen, blen = HDR.unpack_from(self._buf, self._start)
                need += mlen
                if avail >= need:
                    mstart = self._start + HDR.size
                    self._start = mstart + mlen
                    meta = self._view[mstart : self._start]
                    return meta, (self._read_oob(blen) if blen else None)
            if not wait:
                return None
            self.fill(need)

    def _read_oob(self, size: int) -> bytearray:
        out = bytearray(size)
        have = min(self._end - self._start, size)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        view, pos = memoryview(out), have
        while pos < size:  # straight from the kernel into the destination buffer
            n = self.sock.recv_into(view[pos:])
            if n == 0:
                raise EOFError("peer closed the connection")
            pos += n
        return out


# --------------------------------------------------------------------------------------------
# Echo worker (runs in the spawned process)
# --------------------------------------------------------------------------------------------


def _watch_parent(conn: Any) -> None:
    """Exit as soon as the parent closes its pipe end (or dies): no orphaned workers."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os._exit(0)


def _serve_socket(kind: str, address: str, conn: Any) -> None:
    family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
    lsock = socket.socket(family, socket.SOCK_STREAM)
    lsock.bind(address if family == socket.AF_UNIX else ("127.0.0.1", 0))
    lsock.listen(1)
    conn.send(lsock.getsockname())
    sock, _ = lsock.accept()
    lsock.close()
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = FrameReader(sock)
    try:
        while True:
            frame = reader.next_frame()
            batch: list[Any] = []
            while frame is not None:  # echo every complete frame we already have buffered
                meta, oob = frame
                if oob is None:
                    batch += (HDR.pack(len(meta), 0), meta)
                else:
                    if batch:
                        sock.sendall(b"".join(batch))
                        batch.clear()
                    sendmsg_all(sock, [HDR.pack(len(meta), len(oob)), meta, oob])
                frame = reader.next_frame(wait=False)
            if batch:
                sock.sendall(b"".join(batch))
    except (EOFError, ConnectionError):
        pass
    finally:
        sock.close()


def _serve_zmq(address: str, conn: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        while True:
            frames = sock.recv_multipart(copy=False)  # [identity, pickle, *oob]
            sock.send_multipart(frames, copy=False)  # zero-copy echo
    finally:
        sock.close(0)
        ctx.term()


def _server_main(kind: str, address: str, conn: Any) -> None:
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    try:
        if kind == "zmq":
            _serve_zmq(address, conn)
        else:
            _serve_socket(kind, address, conn)
    except BaseException as exc:  # report start-up failures to the parent, then die
        with contextlib.suppress(Exception):
            conn.send(exc)
        raise


@contextlib.contextmanager
def echo_worker(kind: str, address: str) -> Iterator[Any]:
    """Start the echo worker process; always join it (terminate/kill by PID if needed)."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_server_main, args=(kind, address, child_conn), name=f"echo-{kind}", daemon=True
    )
    proc.start()
    child_conn.close()
    try:
        if not parent_conn.poll(60):
            raise TimeoutError(f"echo worker {kind} did not start")
        bound = parent_conn.recv()
        if isinstance(bound, BaseException):
            raise RuntimeError(f"echo worker {kind} failed to start") from bound
        yield bound
    finally:
        parent_conn.close()  # the worker's watchdog exits on EOF
        proc.join(5)
        if proc.is_alive():
            os.kill(proc.pid, 15)  # SIGTERM
            proc.join(2)
        if proc.is_alive():
            os.kill(proc.pid, 9)  # SIGKILL
            proc.join()


# --------------------------------------------------------------------------------------------
# Clients: each provides call_small, pipelined and call_big
# --------------------------------------------------------------------------------------------


class BlockingSocketClient:
    """(a)/(e): framed messages, blocking I/O in the calling thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLOUT)

    def _recv_msg(self) -> Any:
        frame = self.reader.next_frame()
        assert frame is not None
        meta, oob = frame
        return pickle.loads(meta, buffers=() if oob is None else (oob,))

    def call_small(self, i: int) -> Any:
        send_frame(self.sock, pickle.dumps(small_request(i), protocol=PROTO))
        reply = self._recv_msg()
        if reply[1] != i:
            raise AssertionError("reply out of order")
        return reply

    def call_big(self, payload: bytearray) -> Any:
        meta, oob = dumps(("blob", 0, pickle.PickleBuffer(payload)))
        send_frame(self.sock, meta, oob[0])
        return self._recv_msg()[2]

    def _drain_nowait(self) -> int:
        """Consume every reply that can be read without blocking; returns how many."""
        got = 0
        with contextlib.suppress(BlockingIOError):
            self.reader.fill(flags=socket.MSG_DONTWAIT)
        while (frame := self.reader.next_frame(wait=False)) is not None:
            pickle.loads(frame[0])
            got += 1
        return got

    def pipelined(self, n: int) -> None:
        sock, received = self.sock, 0
        for i in range(n):
            meta = pickle.dumps(small_request(i), protocol=PROTO)
            data: Any = HDR.pack(len(meta), 0) + meta
            while True:
                try:
                    sent = sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent == len(data):
                    break
                data = memoryview(data)[sent:]
                # Kernel buffers full: drain replies (the echo worker is blocked on us), or
                # wait until we can either read or write.
                got = self._drain_nowait()
                received += got
                if not got:
                    self._poll.poll()
        while received < n:
            self._recv_msg()
            received += 1

    def close(self) -> None:
        self.sock.close()


class LockFuture:
    """Minimal future: a lock held from creation until the result is set."""

    __slots__ = ("_error", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._value = value
        self._lock.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._lock.release()

    def result(self, timeout: float = 60.0) -> Any:
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError("no reply")
        self._lock.release()
        if self._error is not None:
            raise self._error
        return self._value


class ThreadedSocketClient:
    """(b): the calling thread sends; a receiver thread unpickles replies, completes futures."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock)
        self.pending: dict[int, LockFuture] = {}
        self.next_id = 0
        self.thread = threading.Thread(target=self._recv_loop, name="ctrl-recv", daemon=True)
        self.thread.start()

    def _recv_loop(self) -> None:
        reader, pending = self.reader, self.pending
        try:
            while True:
                meta, oob = reader.next_frame()  # type: ignore[misc]
                msg = pickle.loads(meta, buffers=() if oob is None else (oob,))
                pending.pop(msg[1]).set_result(msg)
        except BaseException as exc:  # EOF at close, or a real error: fail all waiters
            for fut in list(pending.values()):
                fut.set_exception(ConnectionError(f"receiver stopped: {exc!r}"))
            pending.clear()

    def _submit(self, msg_for_id: Callable[[int], Any]) -> LockFuture:
        rid = self.next_id
        self.next_id += 1
        fut = self.pending[rid] = LockFuture()  # register before sending
        meta, oob = dumps(msg_for_id(rid))
        send_frame(self.sock, meta, oob[0] if oob else None)
        return fut

    def call_small(self, i: int) -> Any:
        return self._submit(small_request).result()

    def call_big(self, payload: bytearray) -> Any:
        return self._submit(lambda rid: ("blob", rid, pickle.PickleBuffer(payload))).result()[2]

    def pipelined(self, n: int) -> None:
        futs = [self._submit(small_request) for _ in range(n)]
        for fut in futs:
            fut.result()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(5)
        self.sock.close()


class ZmqClient:
    """(c)/(d): DEALER, blocking in the calling thread (zmq has its own I/O thread)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        for opt, val in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
            self.sock.setsockopt(opt, val)
        self.sock.connect(endpoint)

    def call_small(self, i: int) -> Any:
        self.sock.send(pickle.dumps(small_request(i), protocol=PROTO))
        reply = pickle.loads(self.sock.recv())
        if reply[1] != i:
            raise AssertionError("reply out of order")
        return reply

    def call_big(self, payload: bytearray) -> Any:
        meta, oob = dumps(("blob", 0, pickle.PickleBuffer(payload)))
        self.sock.send_multipart([meta, oob[0].raw()], copy=False)
        frames = self.sock.recv_multipart(copy=False)
        return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])[2]

    def pipelined(self, n: int) -> None:
        send, recv = self.sock.send, self.sock.recv
        for i in range(n):
            send(pickle.dumps(small_request(i), protocol=PROTO))
        for _ in range(n):
            pickle.loads(recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def warm_up_and_verify(client: Any, payload: bytearray) -> None:
    """Exercise every path once and check the echo, outside the timed loops."""
    for i in range(WARMUP):
        client.call_small(i)
    client.pipelined(1_000)
    echoed = client.call_big(payload)
    if len(echoed) != len(payload) or memoryview(echoed) != memoryview(payload):
        raise AssertionError("16 MiB payload was not echoed intact")


def latency_run(client: Any) -> float:
    """Median round trip (us) of LAT_N sequential small requests."""
    clock, samples = time.perf_counter_ns, [0] * LAT_N
    with no_gc():
        for i in range(LAT_N):
            t0 = clock()
            client.call_small(i)
            samples[i] = clock() - t0
    return statistics.median(samples) / 1e3


def pipelined_run(client: Any) -> float:
    """Messages per second for PIPE_N requests sent without waiting, then all replies read."""
    with no_gc():
        t0 = time.perf_counter_ns()
        client.pipelined(PIPE_N)
        return PIPE_N / ((time.perf_counter_ns() - t0) / 1e9)


def big_run(client: Any, payload: bytearray) -> float:
    """Milliseconds for one 16 MiB round trip."""
    with no_gc():
        t0 = time.perf_counter_ns()
        client.call_big(payload)
        return (time.perf_counter_ns() - t0) / 1e6


def measure_all(clients: dict[str, Any], payload: bytearray) -> dict[str, dict[str, Any]]:
    """Run each measurement round-robin over the transports (rotating the order each round).

    Interleaving matters on a small shared machine: the noise comes in phases lasting seconds,
    and measuring transports one after another would attribute a noisy phase to whichever
    transport happened to run in it.  With interleaving, the ratios stay comparable.
    """
    keys = list(clients)
    runs: dict[str, dict[str, list[float]]] = {k: {"lat": [], "rate": [], "big": []} for k in keys}

    def rounds(n: int, field: str, fn: Callable[[Any], float]) -> None:
        for r in range(n):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                runs[key][field].append(fn(clients[key]))

    rounds(LAT_RUNS, "lat", latency_run)
    rounds(PIPE_RUNS, "rate", pipelined_run)
    rounds(BIG_RUNS, "big", lambda c: big_run(c, payload))
    return {
        key: {field: statistics.median(vals) for field, vals in r.items()}
        | {f"{field}_runs": vals for field, vals in r.items()}
        for key, r in runs.items()
    }


def _connect_socket(kind: str, bound: Any) -> socket.socket:
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.connect(bound)
    return sock


TRANSPORTS: dict[str, tuple[str, str]] = {
    "a": ("(a) unix socket, blocking", "unix"),
    "b": ("(b) unix socket, recv thread+future", "unix"),
    "c": ("(c) zmq DEALER/ROUTER ipc://", "zmq-ipc"),
    "d": ("(d) zmq DEALER/ROUTER tcp://", "zmq-tcp"),
    "e": ("(e) TCP loopback, NODELAY, blocking", "tcp"),
}


def open_client(stack: contextlib.ExitStack, key: str, tmpdir: str) -> Any:
    """Start the echo worker for ``key`` and connect a client; both are closed by ``stack``."""
    kind = TRANSPORTS[key][1]
    client: Any
    if kind.startswith("zmq"):
        address = f"ipc://{tmpdir}/{key}.ipc" if kind == "zmq-ipc" else "tcp://127.0.0.1:*"
        client = ZmqClient(stack.enter_context(echo_worker("zmq", address)))
    else:
        bound = stack.enter_context(echo_worker(kind, os.path.join(tmpdir, f"{key}.sock")))
        sock = _connect_socket(kind, bound)
        client = ThreadedSocketClient(sock) if key == "b" else BlockingSocketClient(sock)
    stack.callback(client.close)  # runs before the worker is joined
    return client


def print_table(results: dict[str, dict[str, Any]]) -> None:
    base = results.get("a")

    def ratio(key: str, field: str) -> str:
        return f"{results[key][field] / base[field]:.2f}" if base else "-"

    head = (
        f"{'transport':<38}{'RT med us':>10}{'x(a)':>7}{'pipelined msg/s':>17}{'x(a)':>7}"
        f"{'16MiB RT ms':>13}{'x(a)':>7}"
    )
    print(head)
    print("-" * len(head))
    for key, r in results.items():
        print(
            f"{TRANSPORTS[key][0]:<38}{r['lat']:>10.1f}{ratio(key, 'lat'):>7}"
            f"{r['rate']:>17,.0f}{ratio(key, 'rate'):>7}"
            f"{r['big']:>13.2f}{ratio(key, 'big'):>7}"
        )
    print("x(a): value / value of (a); lower is better for RT and 16MiB, higher for msg/s.")
    print("\nspread (min..max over runs):")
    for key, r in results.items():
        print(
            f"  {TRANSPORTS[key][0]:<38} RT run medians {min(r['lat_runs']):6.1f}.."
            f"{max(r['lat_runs']):6.1f} us | msg/s {min(r['rate_runs']):9,.0f}.."
            f"{max(r['rate_runs']):9,.0f} | 16MiB {min(r['big_runs']):6.2f}.."
            f"{max(r['big_runs']):6.2f} ms"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--transports", default="abcde", help="subset of a,b,c,d,e to run (default: all)"
    )
    args = parser.parse_args(argv)
    keys = [k for k in TRANSPORTS if k in args.transports.replace(",", "")]

    print(
        f"python {platform.python_version()} | pyzmq {zmq.__version__} / libzmq "
        f"{zmq.zmq_version()} | {platform.system()} {platform.release()} | "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"small msg {len(pickle.dumps(small_request(1000), protocol=PROTO))} B pickled | "
        f"RT: median of {LAT_RUNS} run medians x {LAT_N} | pipelined: {PIPE_N} msgs, median "
        f"of {PIPE_RUNS} | 16 MiB: median of {BIG_RUNS}\n"
    )
    payload = bytearray(range(256)) * (BIG_SIZE // 256)
    tmpdir = tempfile.mkdtemp(prefix="mdsl-transport-")
    t_start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:  # closes clients, then joins every worker
            clients = {key: open_client(stack, key, tmpdir) for key in keys}
            for client in clients.values():
                warm_up_and_verify(client, payload)
            print(f"{len(clients)} echo workers up and verified; measuring (interleaved) ...")
            results = measure_all(clients, payload)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    print()
    print_table(results)
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
