"""The worker runtime: chunks tensors, pushes and pulls them, reassembles.

All chunks of a worker wait in one priority queue, whatever their server;
sender threads take them in order, within a credit bound on the bytes being
pushed at once. Every worker thus pushes in the same order, so each server
gets a chunk from all workers at about the same time and can answer its
pulls early, instead of every server waiting for the worker that happened to
serve it last. A push that the server acknowledged gives its credit back and
is followed at once by an asynchronous pull, whose callback writes the sum
into the output array. Credit never waits on other workers, so workers that
queue chunks in different orders cannot deadlock each other.

A server on this host (a loopback address) gets payloads through shared
memory instead (`jaxps._src.shm`): the chunk is copied into a slot, push and
pull only name the slot, which is the server's until the pull returns, and
the server sums in it or writes the sum into it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from jaxps._src import errors, shm, topology
from jaxps._src import timeline as _timeline
from jaxps._src.client import ServerClient, channel_credentials
from jaxps._src.config import Config
from jaxps._src.plan import make_plan
from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

_FINGERPRINT_BYTES = 4096
_STOP = object()


def fingerprint(array: np.ndarray) -> int:
    """crc32 of an array's first and last 4 KiB and its length in bytes."""
    view = memoryview(array.reshape(-1).view(np.uint8))
    if len(view) > 2 * _FINGERPRINT_BYTES:
        head = _wire.checksum(view[:_FINGERPRINT_BYTES])
        return _wire.checksum(view[-_FINGERPRINT_BYTES:]) ^ head ^ len(view)
    return _wire.checksum(view)


class Handle:
    """The result of `Runtime.push_pull_async`; `wait()` returns the sums."""

    def __init__(
        self, names, outs, shapes, pending, release, timeout, timeline=None
    ):
        self.names = names
        self._timeline = timeline
        self._created = _timeline.now()
        self._outs = outs
        self._shapes = shapes
        self._pending = pending
        self._release = release
        self._timeout = timeout
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        if pending == 0:
            self._finish()

    def _finish(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
            if self._timeline is not None:
                self._timeline.span(
                    "in_flight",
                    "push_pull",
                    self._created,
                    _timeline.now(),
                    tensors=len(self.names),
                    first=self.names[0],
                )
        self._event.set()

    def chunk_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def fail(self, err: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
        self._finish()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Blocks until all chunks are back; raises the first error."""
        timeout = self._timeout if timeout is None else timeout
        if not self._event.wait(timeout):
            raise errors.RoundTimeoutError(
                f"push_pull of {self.names} did not finish within "
                f"{timeout:g} s ({self._pending} chunk(s) outstanding)."
            )
        if self._error is not None:
            raise self._error
        return [o.reshape(s) for o, s in zip(self._outs, self._shapes)]


class _Chunk:
    __slots__ = (
        "queued",
        "handle",
        "source",
        "dest",
        "header",
        "divisor",
        "nbytes",
        "lane",
    )

    def __init__(self, handle, source, dest, header, divisor, lane):
        self.queued = _timeline.now()
        self.handle = handle
        self.source = source
        self.dest = dest
        self.header = header
        self.divisor = divisor
        self.nbytes = source.nbytes
        self.lane = lane


class _Sender:
    """The queue, credit and sender threads of a worker, for all servers."""

    def __init__(self, credit: int, threads: int):
        self.credit = credit
        self.in_flight = 0
        self._blocked = 0  # sender threads waiting for a round
        self._cv = threading.Condition()
        self._take = threading.Lock()
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.threads = [
            threading.Thread(
                target=self._send_loop, daemon=True, name=f"jaxps-send-{i}"
            )
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def acquire(self, nbytes: int, timeout: float, label: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.in_flight > 0 and self.in_flight + nbytes > self.credit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise errors.RoundTimeoutError(
                        f"{label}: no credit to push within {timeout:g} s "
                        f"({self.in_flight} bytes pushed to the servers and "
                        "not acknowledged)."
                    )
                self._cv.wait(remaining)
            self.in_flight += nbytes

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.in_flight -= nbytes
            self._cv.notify_all()

    def may_block(self) -> bool:
        """Whether the calling sender thread may wait for a round (and
        counts it as waiting until `unblock`): only while another sender
        thread stays free to send the chunks other workers wait for."""
        with self._cv:
            if self._blocked + 1 < len(self.threads):
                self._blocked += 1
                return True
            return False

    def unblock(self) -> None:
        with self._cv:
            self._blocked -= 1

    def _send_loop(self) -> None:
        while True:
            with self._take:  # credit is taken in priority order
                chunk = self.queue.get()[-1]
                if chunk is _STOP:
                    return
                if chunk.handle.failed:
                    continue
                h = chunk.header
                try:
                    self.acquire(
                        chunk.nbytes,
                        chunk.lane.client.timeout,
                        f"push_pull of {h.name} round {h.round} to server "
                        f"{chunk.lane.client.address}",
                    )
                except errors.JaxpsError as err:
                    chunk.handle.fail(err)
                    continue
            chunk.lane.send(chunk, self)

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put((float("inf"), 0, 0, _STOP))
        for t in self.threads:
            t.join(timeout=5)


class _Lane:
    """Pushes and pulls the chunks of one server (one channel)."""

    def __init__(
        self,
        client: ServerClient,
        timeline=None,
        pool: shm.SlotPool | None = None,
    ):
        self.client = client
        self.pool = pool
        self.timeline = timeline
        self.row = f"server {client.address}"

    def _span(self, stage: str, start: float, chunk: _Chunk) -> float:
        end = _timeline.now()
        if self.timeline is not None:
            h = chunk.header
            self.timeline.span(
                stage,
                self.row,
                start,
                end,
                chunk=h.name,
                round=h.round,
                bytes=chunk.nbytes,
            )
        return end

    def send(self, chunk: _Chunk, sender: _Sender) -> None:
        """Pushes `chunk` (its credit is taken) and pulls its sum.

        A chunk in a shared-memory slot needs no credit (no bytes cross a
        network) and goes in one PushPull call; the sender thread waits for
        it if `sender` allows, the cheapest way, else it is a future.
        """
        pushed = self._span("queue", chunk.queued, chunk)
        slot = None if self.pool is None else self.pool.take(chunk.nbytes)
        if slot is None:
            self._push_then_pull(chunk, sender.release, pushed)
            return
        h, source = chunk.header, chunk.source
        np.copyto(slot.array(source.dtype, source.size), source)
        sender.release(chunk.nbytes)
        pulling = self._span("push", pushed, chunk)
        deadline = time.monotonic() + pull_deadline(self.client.timeout)
        checksum = fingerprint(source)
        if sender.may_block():
            try:
                self.client.push_pull(h, checksum, deadline, slot.ref)
            except errors.JaxpsError as err:
                # the slot is not given back: a late write may land in it
                chunk.handle.fail(err)
            else:
                self._pulled(chunk, None, pulling, slot)
            finally:
                sender.unblock()
            return
        try:
            future = self.client.push_pull_future(
                h, checksum, deadline, slot.ref
            )
        except errors.JaxpsError as err:
            chunk.handle.fail(err)
            return
        future.add_done_callback(
            lambda f: self._pulled(chunk, f, pulling, slot)
        )

    def _push_then_pull(self, chunk: _Chunk, release, pushed: float) -> None:
        """Pushes a chunk in a message, gives its credit back once the
        server has it, and starts its pull."""
        timeout = self.client.timeout
        h, source = chunk.header, chunk.source
        try:
            self.client.push(
                h, source, fingerprint(source), time.monotonic() + timeout
            )
            future = self.client.pull_future(
                h, time.monotonic() + pull_deadline(timeout)
            )
        except errors.JaxpsError as err:
            chunk.handle.fail(err)
            return
        finally:
            release(chunk.nbytes)
        pulling = self._span("push", pushed, chunk)
        future.add_done_callback(
            lambda f: self._pulled(chunk, f, pulling, None)
        )

    def _pulled(self, chunk: _Chunk, future, pulling: float, slot) -> None:
        """Writes a chunk's sum into its output: from the reply in `future`,
        or from `slot` (`future` None: the sum is there already)."""
        h, dest = chunk.header, chunk.dest
        ref = None if slot is None else slot.ref
        try:
            if future is not None:
                try:
                    payload = self.client.decode_pull(future.result(), h, ref)
                except grpc.RpcError as err:
                    payload = self._retry_pull(chunk, err, ref)
            if slot is not None:
                data = slot.array(dest.dtype, dest.size)
            else:
                data = np.frombuffer(payload, dtype=dest.dtype)
            if data.size != dest.size:
                raise errors.RequestRejectedError(
                    f"server {self.client.address} answered {h.name} round "
                    f"{h.round} with {data.size} elements, expected "
                    f"{dest.size}."
                )
            if chunk.divisor is None:
                dest[...] = data
            else:
                np.divide(data, chunk.divisor, out=dest)
        except BaseException as err:  # noqa: BLE001 - reported to the waiter
            # the slot is not given back: a late pull may still write to it
            chunk.handle.fail(err)
        else:
            if slot is not None:
                self.pool.give(slot)
            self._span("pull", pulling, chunk)
            chunk.handle.chunk_done()

    def _retry_pull(self, chunk: _Chunk, err: grpc.RpcError, ref):
        what = "pull" if ref is None else "push_pull"
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            raise self.client.translate(err, what, chunk.header) from None
        deadline = time.monotonic() + pull_deadline(self.client.timeout)
        if ref is None:
            return self.client.pull(chunk.header, deadline)
        # the server counts a repeated push once
        checksum = fingerprint(chunk.source)
        return self.client.push_pull(chunk.header, checksum, deadline, ref)

    def stop(self) -> None:
        if self.pool is not None:
            if self.pool.segment_ids:
                self.client.detach(self.pool.segment_ids)
            self.pool.close()
        self.client.close()


#: push_pull names that expect async servers (AsyncDistributedOptimizer's).
ASYNC_NAMES: set[str] = set()


def pull_deadline(timeout: float) -> float:
    """Client deadline of a pull: past the server's round timeout, so the
    server's message naming the missing ranks arrives first."""
    return 1.25 * timeout + 2.0


class Runtime:
    """Connects to the servers and runs push_pull for one worker.

    Args:
      config: the worker's settings.
      senders_per_server: threads pushing, per channel (at most 8 in all).
      channels_per_server: gRPC channels (TCP connections) to each server;
        a server's pieces take turns on them.
    """

    def __init__(
        self,
        config: Config,
        *,
        senders_per_server: int = 2,
        channels_per_server: int = 1,
    ):
        self.config = config
        self._channels = channels_per_server
        self._lock = threading.Lock()
        self._rounds: dict[str, int] = {}
        self._in_flight: set[str] = set()
        self._seq = itertools.count()
        self._plans: dict = {}
        self._lanes: list[_Lane] = []
        self._sender: _Sender | None = None
        addresses = config.servers + config.colocated_servers
        if config.colocated_servers:
            self.weights = topology.mixed_mode_weights(
                len(config.colocated_servers), len(config.servers)
            )
        else:
            self.weights = [1.0] * len(addresses)
        max_message = config.partition_bytes + _wire.MESSAGE_OVERHEAD
        credentials = None
        if config.tls_ca:
            credentials = channel_credentials(
                config.tls_ca, config.tls_cert, config.tls_key
            )
        clients = [
            ServerClient(
                s,
                max_message_bytes=max_message,
                timeout=config.timeout,
                token=config.token,
                credentials=credentials,
            )
            for s in addresses
            for _ in range(channels_per_server)
        ]
        try:
            for c in clients:
                c.hello(
                    job_id=config.job_id,
                    rank=config.worker_rank,
                    num_workers=config.num_workers,
                )
        except BaseException:
            for c in clients:
                c.close()
            raise
        modes = {c.async_mode for c in clients}
        if len(modes) > 1:
            for c in clients:
                c.close()
            raise errors.ConfigError(
                "some servers run with --async and some without: "
                + ", ".join(
                    f"{c.address} async={c.async_mode}" for c in clients
                )
            )
        #: whether the servers hold parameters (async mode)
        self.async_servers = modes == {True}
        credit = max(config.credit_bytes, config.partition_bytes)
        self.timeline = None
        if config.trace_dir:
            self.timeline = _timeline.Timeline(
                os.path.join(
                    config.trace_dir,
                    f"jaxps-rank{config.worker_rank}.trace.json",
                ),
                config.worker_rank,
            )
        self._lanes = [
            _Lane(c, self.timeline, _slot_pool(c, config)) for c in clients
        ]
        self._sender = _Sender(
            credit, min(8, senders_per_server * len(clients))
        )

    def check_mode(self, names: Sequence[str]) -> None:
        """Refuses sums from async servers, and parameters from sync ones.

        Async servers hold parameters instead of summing: a push_pull that
        expects a sum would silently get the parameters back.
        """
        for name in names:
            wants_async = any(name.startswith(a) for a in ASYNC_NAMES)
            if wants_async != self.async_servers:
                raise errors.JaxpsError(
                    f"push_pull of {name!r} "
                    + (
                        "needs synchronous servers; these run with --async "
                        "and hold parameters instead of summing (only "
                        "AsyncDistributedOptimizer talks to them; its init "
                        "already makes the first worker's parameters the "
                        "common start, so broadcast is not needed)."
                        if self.async_servers
                        else "belongs to AsyncDistributedOptimizer, which "
                        "needs servers started with --async."
                    )
                )

    @property
    def rank(self) -> int:
        return self.config.worker_rank

    @property
    def size(self) -> int:
        return self.config.num_workers

    def push_pull_async(
        self,
        names: Sequence[str],
        arrays: Sequence[np.ndarray],
        *,
        average: bool = True,
        priorities: Sequence[int] | None = None,
    ) -> Handle:
        """Starts summing `arrays` over all workers; returns a `Handle`.

        Args:
          names: one unique name per array, the same on every worker.
          arrays: numpy arrays of a supported dtype.
          average: divide the sums by the number of workers.
          priorities: higher goes out first (default: earlier names first).
        """
        if len(names) != len(arrays):
            raise ValueError(
                f"got {len(names)} names for {len(arrays)} arrays."
            )
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names must be unique, got {names}.")
        self.check_mode(names)
        flats = []
        for name, array in zip(names, arrays):
            array = np.asarray(array)
            _check_array(name, array, average)
            flats.append(np.ascontiguousarray(array).reshape(-1))
        shapes = [np.shape(a) for a in arrays]
        timeout = 2 * pull_deadline(self.config.timeout)
        if not self._lanes:  # a single worker without servers
            outs = [f.copy() for f in flats]
            return Handle(
                list(names),
                outs,
                shapes,
                0,
                lambda: None,
                timeout,
                self.timeline,
            )
        if priorities is None:
            priorities = [-i for i in range(len(names))]
        plan = self._plan(names, flats, tuple(priorities))
        outs: list = [None] * len(flats)
        pieces = []  # (piece, source, dest)
        for piece in plan:
            if piece.fused:
                dest = np.empty(piece.length, flats[piece.members[0][0]].dtype)
                parts, offset = [], 0
                for t, lo, hi in piece.members:
                    parts.append(flats[t][lo:hi])
                    outs[t] = dest[offset : offset + hi - lo]  # a view
                    offset += hi - lo
                pieces.append((piece, np.concatenate(parts), dest))
            else:
                ((t, lo, hi),) = piece.members
                if outs[t] is None:
                    outs[t] = np.empty_like(flats[t])
                pieces.append((piece, flats[t][lo:hi], outs[t][lo:hi]))
        rounds = self._begin(names, [p.wire_name for p in plan])
        divisor = self.size if average else None
        handle = Handle(
            list(names),
            outs,
            shapes,
            len(pieces),
            lambda: self._end(names),
            timeout,
            self.timeline,
        )
        seq = next(self._seq)
        for i, (piece, source, dest) in enumerate(pieces):
            header = pb.Header(
                version=_wire.PROTOCOL_VERSION,
                job_id=self.config.job_id,
                rank=self.rank,
                key=piece.key,
                round=rounds[piece.wire_name],
                dtype=_wire.dtype_code(source.dtype),
                length=piece.length,
                name=piece.label,
            )
            lane = self._lanes[
                piece.server * self._channels + i % self._channels
            ]
            chunk = _Chunk(handle, source, dest, header, divisor, lane)
            self._sender.queue.put((-piece.priority, seq, i, chunk))
        return handle

    def push_pull(self, name: str, array, *, average: bool = True):
        """Sums one array over all workers and returns the (mean) sum."""
        return self.push_pull_async([name], [array], average=average).wait()[0]

    def _plan(self, names, flats, priorities):
        sig = (
            tuple((n, f.size, f.dtype.str) for n, f in zip(names, flats)),
            priorities,
        )
        plan = self._plans.get(sig)
        if plan is None:
            plan = make_plan(
                list(names),
                [f.size for f in flats],
                [f.dtype.str for f in flats],
                [f.itemsize for f in flats],
                list(priorities),
                partition_bytes=self.config.partition_bytes,
                weights=self.weights,
            )
            self._plans[sig] = plan
        return plan

    def _begin(self, names, wire_names) -> dict[str, int]:
        """Marks `names` in flight; returns the round of each wire name."""
        with self._lock:
            busy = self._in_flight.intersection(names)
            if busy:
                raise errors.JaxpsError(
                    f"push_pull of {sorted(busy)} is already in flight; wait "
                    "for it before pushing the same name again."
                )
            self._in_flight.update(names)
            rounds = {}
            for wire in wire_names:
                if wire not in rounds:
                    rounds[wire] = self._rounds.get(wire, 0)
                    self._rounds[wire] = rounds[wire] + 1
            return rounds

    def _end(self, names) -> None:
        with self._lock:
            self._in_flight.difference_update(names)

    def close(self) -> None:
        """Stops the sender threads and closes the channels."""
        if self._sender is not None:
            self._sender.stop()
            self._sender = None
        for lane in self._lanes:
            lane.stop()
        self._lanes = []
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None


def _slot_pool(client: ServerClient, config: Config):
    """Shared-memory slots for a server on this host, if allowed."""
    if config.shm_bytes == 0 or not shm.is_local(client.address):
        return None
    pool = shm.SlotPool(client.attach, config.partition_bytes, config.shm_bytes)
    return pool if pool.enabled else None


def _check_array(name: str, array: np.ndarray, average: bool) -> None:
    try:
        _wire.dtype_code(array.dtype)
    except TypeError as err:
        raise TypeError(f"push_pull of {name!r}: {err}") from None
    if array.size == 0:
        raise ValueError(
            f"push_pull of {name!r}: the array is empty (shape "
            f"{array.shape}); nothing to sum."
        )
    if average and array.dtype.kind in "iu":
        raise TypeError(
            f"push_pull of {name!r}: average=True needs a floating dtype, "
            f"got {array.dtype}; pass average=False to sum integers."
        )
