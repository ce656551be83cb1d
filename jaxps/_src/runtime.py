"""The worker runtime: connects to the servers and runs push_pull.

`Runtime` says hello to every server (checking job, size and mode) and
picks a transport for each server client (`make_transport`). A push_pull
is planned (`plan`: chunks, fused pieces, servers), its arrays laid out
along the plan, and each piece queued as a chunk with the sender
(`sender`), which pushes the chunks of all servers in priority order
within a credit. The chunk's transport (`transport`) brings its sum back
into the output, and the push_pull's `Handle` hears when all are back.
Each call says what it expects of the servers (`MODES`: sums, or async
parameters); empty arrays send nothing; a name that comes with a new size
or dtype gets new keys (a generation, see `Runtime._begin`).

With more than one worker every call also carries a *call check*
(`plan.call_check`) to a server chosen from the call's name alone: a hash
of its names, shapes and dtypes, in the header of the call's first piece
to that server (with servers of equal weight the plan sends a call of one
piece there), else as a one-element push of its own. A rank that pushes
another tree under the same name fails the call on every rank at once
(`errors.MismatchError`), instead of each waiting for the timeout on keys
the others never push.
Async servers get no check.

`Runtime.join` is `jaxps.join`: the rank stops pushing, the servers
complete rounds without it and say over how many ranks each sum is, which
is what averaging divides by.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxps._src import errors, plan, retune, topology, tuning
from jaxps._src import timeline as _timeline
from jaxps._src.config import AUTO, CREDIT_PARTITIONS, Config
from jaxps._src.sender import Sender
from jaxps._src.transport import shm
from jaxps._src.transport.base import (
    Chunk,
    Transport,
    fingerprint,
    pull_deadline,
)
from jaxps._src.transport.client import (
    ServerClient,
    channel_credentials,
    tls_context,
)
from jaxps._src.transport.data import DataConnection, DataTransport
from jaxps._src.transport.failover import RecoveringTransport
from jaxps._src.transport.grpc import GrpcTransport
from jaxps._src.transport.shm import ShmTransport
from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

log = logging.getLogger("jaxps")

__all__ = [
    "MODES",
    "Handle",
    "Runtime",
    "fingerprint",
    "make_transport",
    "pull_deadline",
]


#: Chunk errors no mismatch of the ranks' calls causes: a server gone or
#: restarted. They end a call at once, without waiting for its call check
#: (whose other ranks may never come: the same server failed them first).
_LOST = (errors.ServerUnavailableError, errors.ServerRestartedError)


class Handle:
    """The result of `Runtime.push_pull_async`; `wait()` returns the sums
    (the flat `outs`, each in its shape of `shapes`, or as they are where
    `shapes` is None)."""

    def __init__(
        self,
        names,
        outs,
        shapes,
        pending,
        release,
        timeout,
        timeline=None,
        checked=False,
    ):
        self.names = names
        # while the call check is out, a chunk's error waits for it: a
        # mismatch makes pieces fail too (e.g. another length), and the
        # check's error is the one that names it (`check_ended`)
        self._checking = checked
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
        """One chunk's sum is in its output (once per chunk)."""
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def fail(self, err: BaseException) -> None:
        """One chunk failed with `err`; `wait` raises the first error (or
        the call check's, see `check_ended`)."""
        with self._lock:
            if self._error is None:
                self._error = err
            if self._checking and not isinstance(self._error, _LOST):
                return  # the check ends within its own deadline
        self._finish()

    def check_ended(self, err: BaseException | None) -> None:
        """The call check came back (`err` None) or failed with `err`,
        which then wins over any chunk's error."""
        with self._lock:
            self._checking = False
            if err is not None and not isinstance(self._error, _LOST):
                self._error = err
            self._pending -= 1
            end = self._error is not None or self._pending == 0
        if end:
            self._finish()

    @property
    def failed(self) -> bool:
        """Whether a chunk failed (the rest need not be sent)."""
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The first error of a chunk, or None."""
        return self._error

    def done(self) -> bool:
        return self._event.is_set()

    def settle(self, timeout: float) -> bool:
        """Waits up to `timeout` s until the push_pull ended (its sums are
        back or it failed); returns whether it did. Raises nothing."""
        return self._event.wait(timeout)

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
        if self._shapes is None:  # flat already
            return list(self._outs)
        return [o.reshape(s) for o, s in zip(self._outs, self._shapes)]


#: The payload of a call check (its sum counts the contributing ranks).
_CHECK_PAYLOAD = np.ones(1, np.int32)
_CHECK_PAYLOAD.flags.writeable = False

#: What a push_pull expects of the servers: ``"sync"`` servers sum the
#: workers' arrays; ``"async"`` servers (``jaxps-server --async``) hold
#: parameters, add each push into them and answer with the latest.
MODES = ("sync", "async")
#: Most call signatures kept (`_Call`s; all dropped past it).
MAX_CACHED_CALLS = 4096


class _Laid(NamedTuple):
    """A call's plan at one partition.

    Attributes:
      pieces: the plan (`plan.make_plan`) of its non-empty arrays.
      counted: the wire names whose rounds a call counts, each once (its
        pieces', then its call check's).
      carrier: the index of the piece that carries the call check (see
        `Runtime._carrier`), or -1.
    """

    pieces: list[plan.Piece]
    counted: tuple[str, ...]
    carrier: int


@dataclasses.dataclass(slots=True, eq=False)
class _Call:
    """What every push_pull of one signature shares, made at its first.

    A signature is what `Runtime._push_pull_async` keys on: the names,
    shapes, dtypes and priorities of the arrays, the call's name and
    check, and `average`. Its arrays' dtypes are checked once, its call
    check made once, its wire names found once (`Runtime._begin`) and its
    plan made once per partition, so that a call repeated in every step
    does per array only what its arrays need: a flat view of each, and a
    view of the sums for each.

    Attributes:
      names: the names, as given.
      shapes: per array, its shape (the sums come back in it); None
        where every array is flat.
      live: the indices of the non-empty arrays.
      empty: the indices of the empty ones.
      priorities: per live array, its priority.
      check: the call check, or None (one worker, async servers).
      nbytes: bytes of the live arrays.
      wire_names: per live array, its wire name (None until its first
        call's `Runtime._begin`).
      laid: per (partition, re-tuned), its `_Laid`.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] | None
    live: tuple[int, ...]
    empty: tuple[int, ...]
    priorities: tuple[int, ...]
    check: plan.CallCheck | None
    nbytes: int
    wire_names: tuple[str, ...] | None = None
    laid: dict[tuple[int, bool], _Laid] = dataclasses.field(
        default_factory=dict
    )


class _CheckOf:
    """The `ChunkHandle` of a call check's chunk: tells its handle."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self, handle: Handle):
        self.handle = handle

    def chunk_done(self) -> None:
        self.handle.check_ended(None)

    def fail(self, err: BaseException) -> None:
        self.handle.check_ended(err)

    @property
    def failed(self) -> bool:
        return False  # always sent: the handle waits for it

    @property
    def error(self) -> BaseException | None:
        return self.handle.error


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
        # name -> its (size, dtype) signatures in order of first use; the
        # index of a signature is its generation (see `_begin`)
        self._signatures: dict[str, list[tuple[int, str]]] = {}
        self._in_flight: set[str] = set()
        self._live: set[Handle] = set()  # push_pulls not ended yet
        # `join` has begun (and not ended): push_pull is refused
        self._joined = False
        self._join_epoch = 0  # joins completed
        self._seq = itertools.count()
        self._calls: dict[tuple, _Call] = {}  # per call signature
        self._outputs = plan.Outputs()
        self._transports: list[Transport] = []
        self._sender: Sender | None = None
        addresses = config.servers + config.colocated_servers
        # Per host NIC: P processes on one host are one server of t_opt.
        self.weights = topology.host_weights(
            config.servers, config.colocated_servers
        )
        self.hosts = topology.host_index(
            config.servers, config.colocated_servers
        )
        max_message = config.largest_partition + _wire.MESSAGE_OVERHEAD
        credentials = channel_credentials(config)
        # One id for this init: the servers put this worker's channels in
        # one job incarnation, and a later init of the rank in a new one.
        init_id = secrets.token_hex(8)

        def connect(
            address: str, session: str = "", wait: float | None = None
        ) -> ServerClient:
            """A client of `address` after its hello; `session`: the job
            incarnation to come back to (after a server restart); `wait`:
            seconds to wait for the server (default: the timeout)."""
            client = ServerClient(
                address,
                max_message_bytes=max_message,
                timeout=config.timeout,
                token=config.token,
                credentials=credentials,
            )
            client.session = session
            try:
                client.hello(
                    job_id=config.job_id,
                    rank=config.worker_rank,
                    num_workers=config.num_workers,
                    init_id=init_id,
                    generation=config.generation,
                    wait=wait,
                )
            except BaseException:
                client.close()
                raise
            return client

        clients: list[ServerClient] = []
        try:
            for s in addresses:
                for _ in range(channels_per_server):
                    clients.append(connect(s))
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
        #: the partition planned with (`partition_bytes="auto"`: the
        #: largest until the ranks have chosen, see `_tune`; then the last
        #: they chose, while a call plans with its epoch's, see `retune`)
        self.partition_bytes = config.largest_partition
        #: what the ranks chose with "auto" (a `tuning.Tuned`), else None
        self.tuned: tuning.Tuned | None = None
        self._tuned = threading.Event()
        self._tune_error: BaseException | None = None
        #: with "auto" and `Config.retune_calls`: measures again while the
        #: job runs (`retune`), from the end of the measurement at init
        self._retune: retune.Retuner | None = None
        credit = max(
            config.credit_bytes or CREDIT_PARTITIONS * self.partition_bytes,
            self.partition_bytes,
        )
        self.timeline = None
        if config.trace_dir:
            self.timeline = _timeline.Timeline(
                os.path.join(
                    config.trace_dir,
                    f"jaxps-rank{config.worker_rank}.trace.json",
                ),
                config.worker_rank,
            )
        try:
            self._transports = _open_transports(clients, config, self.timeline)
        except BaseException:  # its clients are closed; so is the timeline
            if self.timeline is not None:
                self.timeline.close()
            raise
        if config.recovery_window > 0 and not self.async_servers:
            # Async servers hold the parameters: a restart loses them.
            self._transports = [
                RecoveringTransport(
                    t,
                    functools.partial(self._reconnect, connect, t),
                    config.recovery_window,
                )
                for t in self._transports
            ]
        self._sender = Sender(credit, min(8, senders_per_server * len(clients)))
        if (
            config.partition_bytes == AUTO
            and self.size > 1
            and not self.async_servers
            and (tuning.ON_ONE_HOST or not all(map(shm.is_local, addresses)))
        ):
            threading.Thread(
                target=self._tune, name="jaxps-tune", daemon=True
            ).start()
        else:
            self._tuned.set()

    def _tune(self) -> None:
        """Measures the links with the other ranks and sets the partition
        (`tuning`); the first push_pull waits for it."""
        try:
            tuned = self._measure("tune")
        except BaseException as err:  # noqa: BLE001 - the first call raises it
            self._tune_error = err
            self._tuned.set()
            return
        if self.config.retune_calls:
            self._retune = retune.Retuner(
                tuned.partition_bytes,
                self.config.retune_calls,
                self.rank,
                self.size,
                self._agree,
                lambda: self._measure("retune").partition_bytes,
                tuning.CALLS * pull_deadline(self.config.timeout),
            )
        self._tuned.set()

    def _agree(self, name: str, array: np.ndarray) -> Handle:
        """A push_pull of `array` summed over the ranks (`retune`)."""
        return self._push_pull_async(
            [name], [array], average=False, partition=tuning.MAX_PARTITION
        )

    def _measure(self, what: str) -> tuning.Tuned:
        """`tuning.measure` with every rank; applies, logs and traces its
        choice (`what`: "tune" at init, "retune" later)."""
        began = _timeline.now()

        def push_pull(name, array, partition):
            handle = self._push_pull_async(
                [name], [array], average=False, partition=partition
            )
            return handle.wait()[0]

        tuned = tuning.measure(
            push_pull,
            len(self._transports) // self._channels,
            self.rank,
            self.size,
        )
        self.partition_bytes = tuned.partition_bytes
        credit = self.config.credit_bytes or (
            CREDIT_PARTITIONS * tuned.partition_bytes
        )
        self._sender.set_credit(max(credit, tuned.partition_bytes))
        self.tuned = tuned
        log.info(
            "jaxps: partition_bytes=auto %s %d bytes, credit %d bytes "
            "(%.3g MB/s per rank; tried %s; in %.2f s)",
            "chose" if what == "tune" else "measured again and chose",
            tuned.partition_bytes,
            self._sender.credit,
            tuned.rate / 1e6,
            ", ".join(f"{p} B {t * 1e3:.1f} ms" for p, t in tuned.candidates),
            tuned.seconds,
        )
        if self.timeline is not None:
            self.timeline.span(
                what,
                "runtime",
                began,
                _timeline.now(),
                partition_bytes=tuned.partition_bytes,
                credit_bytes=self._sender.credit,
                rate=tuned.rate,
                candidates=[list(c) for c in tuned.candidates],
            )
        return tuned

    def _wait_tuned(self) -> None:
        """Waits for `_tune` (each of its push_pulls has a deadline);
        raises its error."""
        bound = tuning.CALLS
        if not self._tuned.wait(bound * pull_deadline(self.config.timeout)):
            raise errors.RoundTimeoutError(
                "partition_bytes='auto': measuring the links with the other "
                "ranks did not end in time."
            )
        err = self._tune_error
        if err is not None:
            text = (
                "partition_bytes='auto': measuring the links with the other "
                f"ranks after init failed: {err}"
            )
            try:
                raised = type(err)(text)
            except Exception:  # noqa: BLE001 - an error without a message
                raised = errors.JaxpsError(text)
            raise raised from err

    def _reconnect(self, connect, transport, wait: float) -> Transport:
        """A new transport to `transport`'s server, in the same session,
        waiting up to `wait` seconds for the server."""
        client = connect(transport.address, transport.client.session, wait)
        return make_transport(client, self.config, self.timeline)

    def check_mode(self, names: Sequence[str], mode: str = "sync") -> None:
        """Refuses sums from async servers, and parameters from sync ones.

        Async servers hold parameters instead of summing: a push_pull that
        expects a sum would silently get the parameters back.

        Args:
          names: the names of the push_pull, for the message.
          mode: what the push_pull expects, one of `MODES`.
        """
        if mode not in MODES:
            raise ValueError(
                f"push_pull mode must be one of {MODES}. Got mode={mode!r}."
            )
        if (mode == "async") == self.async_servers:
            return
        name = names[0] if names else ""
        if self.async_servers:
            raise errors.JaxpsError(
                f"push_pull of {name!r} needs synchronous servers; these run "
                "with --async and hold parameters instead of summing (only "
                "AsyncDistributedOptimizer talks to them; its init already "
                "makes the first worker's parameters the common start, so "
                "broadcast is not needed)."
            )
        raise errors.JaxpsError(
            f"push_pull of {name!r} has mode='async' (AsyncDistributedOptimizer"
            "'s), which needs servers started with --async; "
            + (
                "these servers sum."
                if self._transports
                else "this worker has no servers."
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
        mode: str = "sync",
        call: str | None = None,
        donate: bool = False,
        check: plan.CallCheck | None = None,
    ) -> Handle:
        """Starts summing `arrays` over all workers; returns a `Handle`.

        Empty arrays come back empty (their shape and dtype) and send
        nothing. A name may come with another size or dtype than in its
        last push_pull: the new signature gets keys of its own (see
        `_begin`). With several workers (and sync servers) a call check
        goes along (see the module docstring); the handle fails with
        `errors.MismatchError` at once if another rank pushes another tree
        (names, shapes, dtypes) under the same call.

        Args:
          names: one unique name per array, the same on every worker.
          arrays: numpy arrays of a supported dtype.
          average: divide the sums by the number of ranks they are over
            (the workers, minus those that joined and pushed nothing).
          priorities: higher goes out first (default: earlier names first).
          mode: ``"sync"`` to sum, ``"async"`` for servers started with
            ``--async`` (see `MODES`); checked against the servers.
          call: the name of the call, the same on every rank whatever its
            tree; default `plan.call_name(names)` (the ops layer's leaf
            names give the user's name and the device's shard).
          donate: the caller never writes to `arrays` again, so the
            runtime may keep them (for a re-push after a server restart)
            instead of a copy.
          check: the call check, where the caller made it (the ops layer
            pushes several leaves fused into one array, and checks the
            leaves); default: of `names` and `arrays`, with `call`.
        """
        if not self._tuned.is_set() or self._tune_error is not None:
            self._wait_tuned()
        return self._push_pull_async(
            names,
            arrays,
            average=average,
            priorities=priorities,
            mode=mode,
            call=call,
            donate=donate,
            check=check,
            partition=None,
        )

    def _push_pull_async(
        self,
        names: Sequence[str],
        arrays: Sequence[np.ndarray],
        *,
        partition: int | None,
        average: bool = True,
        priorities: Sequence[int] | None = None,
        mode: str = "sync",
        call: str | None = None,
        donate: bool = False,
        check: plan.CallCheck | None = None,
    ) -> Handle:
        """`push_pull_async`, planned with `partition` bytes (and not
        waiting for `_tune`); None: the partition chosen (`_partition`)."""
        if len(names) != len(arrays):
            raise ValueError(
                f"got {len(names)} names for {len(arrays)} arrays."
            )
        names = tuple(names)
        self.check_mode(names, mode)
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
        flats = [a.ravel() for a in arrays]  # views (copies if strided)
        key = (
            names,
            tuple([a.shape for a in arrays]),
            tuple([f.dtype for f in flats]),
            None if priorities is None else tuple(priorities),
            call,
            check,
            average,
        )
        entry = self._calls.get(key)
        if entry is None:
            entry = self._new_call(key, flats)
        timeout = 2 * pull_deadline(self.config.timeout)
        if not self._transports or not entry.live:  # one worker, or nothing
            return Handle(
                list(names),
                [f.copy() for f in flats],
                entry.shapes,
                0,
                lambda: None,
                timeout,
                self.timeline,
            )
        check = entry.check
        live_flats = [flats[i] for i in entry.live] if entry.empty else flats
        timed, retuned = None, False
        if partition is None:
            partition, timed = self._partition(check, entry.nbytes)
            retuner = self._retune
            retuned = retuner is not None and partition != retuner.base
        self._begin(entry, live_flats)
        try:
            laid = entry.laid.get((partition, retuned))
            if laid is None:
                laid = self._lay(entry, partition, retuned, live_flats)
            laid_out, outs = plan.buffers(
                laid.pieces, live_flats, self._outputs
            )
            rounds = self._next_rounds(laid.counted)
        except BaseException:
            self._end(names)
            raise
        if entry.empty:  # the empty ones come back as they are
            live_outs, outs = outs, [f[:0].copy() for f in flats]
            for i, out in zip(entry.live, live_outs):
                outs[i] = out
        divisor = self.size if average else None
        pieces, carrier = laid.pieces, laid.carrier
        handle = Handle(
            list(names),
            outs,
            entry.shapes,
            len(pieces) + (check is not None and carrier < 0),
            lambda: self._end(names, handle, timed),
            timeout,
            self.timeline,
            checked=check is not None,
        )
        with self._lock:
            self._live.add(handle)
        seq = next(self._seq)
        if check is not None and carrier < 0:  # first: found at once
            self._send_check(handle, check, rounds[check.wire_name], seq)
        for i, (piece, (source, dest)) in enumerate(zip(pieces, laid_out)):
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
            transport = self._transports[
                piece.server * self._channels + i % self._channels
            ]
            owner = handle
            if i == carrier:  # carries the check (the error that wins)
                header.signature = check.signature
                header.description = check.description
                header.check_key = check.key
                header.check_round = rounds[check.wire_name]
                header.check_call = check.call
                owner = _CheckOf(handle)
            chunk = Chunk(
                owner,
                source,
                dest,
                header,
                divisor,
                transport,
                # a fused piece's Gather is of the caller's arrays too
                private=donate,
            )
            self._sender.put((-piece.priority, seq, i), chunk)
        return handle

    def _new_call(self, key: tuple, flats: list[np.ndarray]) -> _Call:
        """The `_Call` of signature `key` (see `_push_pull_async`), made
        and kept: its arrays checked, its call check made."""
        names, shapes, dtypes, priorities, call, check, average = key
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names must be unique, got {names}.")
        for name, flat in zip(names, flats):
            _check_array(name, flat, average)
        live = tuple(i for i, f in enumerate(flats) if f.size)
        if priorities is None:
            priorities = [-i for i in range(len(names))]
        elif len(priorities) != len(names):
            raise ValueError(
                f"got {len(priorities)} priorities for {len(names)} arrays."
            )
        if self.size == 1 or self.async_servers or not self._transports:
            check = None
        elif check is None:
            check = plan.call_check(names, shapes, dtypes, call)
        entry = _Call(
            names,
            None if all(len(s) == 1 for s in shapes) else shapes,
            live,
            tuple(i for i, f in enumerate(flats) if not f.size),
            tuple(priorities[i] for i in live),
            check,
            sum(flats[i].nbytes for i in live),
        )
        if len(self._calls) >= MAX_CACHED_CALLS:
            self._calls.clear()
        self._calls[key] = entry
        return entry

    def _lay(self, entry: _Call, partition: int, retuned: bool, flats) -> _Laid:
        """The `_Laid` of `entry` at `partition` (kept in it); `flats`: the
        live arrays of one of its calls."""
        wire_names = entry.wire_names
        if retuned:  # chunks of another length: keys of their own (`retune`)
            wire_names = [f"{w}@{partition}B" for w in wire_names]
        check = entry.check
        pieces = self._plan(
            wire_names,
            flats,
            entry.priorities,
            partition,
            # a call of one piece goes where its check does: it carries it
            None if check is None else check.salt,
        )
        counted = [p.wire_name for p in pieces]
        if check is not None:
            counted.append(check.wire_name)
        laid = _Laid(
            pieces,
            tuple(dict.fromkeys(counted)),
            -1 if check is None else self._carrier(pieces, check),
        )
        entry.laid[(partition, retuned)] = laid
        return laid

    def _carrier(self, pieces: list[plan.Piece], check: plan.CallCheck) -> int:
        """The index of the piece that carries the call check: the first
        to go out of those on the check's server (in its own turn: a piece
        of a later call does not jump the queue); -1 if none goes there
        (then the check is a one-element push of its own)."""
        server = check.server(len(self._transports) // self._channels)
        best, found = (math.inf, 0), -1
        for i, piece in enumerate(pieces):
            if piece.server == server and (-piece.priority, i) < best:
                best, found = (-piece.priority, i), i
        return found

    def _send_check(
        self, handle: Handle, check: plan.CallCheck, number: int, seq: int
    ) -> None:
        """Queues the call check of a push_pull (ahead of its pieces)."""
        header = pb.Header(
            version=_wire.PROTOCOL_VERSION,
            job_id=self.config.job_id,
            rank=self.rank,
            key=check.key,
            round=number,
            dtype=_wire.dtype_code(_CHECK_PAYLOAD.dtype),
            length=_CHECK_PAYLOAD.size,
            name=check.call,
            signature=check.signature,
            description=check.description,
        )
        server = check.server(len(self._transports) // self._channels)
        chunk = Chunk(
            _CheckOf(handle),
            _CHECK_PAYLOAD,
            np.empty_like(_CHECK_PAYLOAD),
            header,
            None,
            self._transports[server * self._channels],
        )
        self._sender.put((-math.inf, seq, -1), chunk)

    def join(self, timeout: float | None = None) -> int:
        """`jaxps.join`: this rank pushes nothing more until every rank has
        joined; returns the rank that joined last (see `jaxps.join`)."""
        timeout = self.config.timeout if timeout is None else float(timeout)
        if not timeout >= 0:
            raise ValueError(f"join timeout must be >= 0, got {timeout}.")
        if not self._transports:
            return self.rank  # one worker: it is the last to join
        if self.async_servers:
            raise errors.JaxpsError(
                "jaxps.join needs synchronous servers: with --async no "
                "round waits for another rank, so there is nothing to join."
            )
        deadline = time.monotonic() + timeout
        with self._lock:
            self._joined = True
            live = list(self._live)
        # Its pushes must reach the servers before the join does.
        for handle in live:
            if not handle.settle(max(0.0, deadline - time.monotonic())):
                raise errors.RoundTimeoutError(
                    f"jaxps.join of rank {self.rank}: the push_pull of "
                    f"{handle.names} did not end within {timeout:g} s; "
                    "this rank stays joined."
                )
        clients = [t.client for t in self._transports[:: self._channels]]
        remaining = max(0.0, deadline - time.monotonic())
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            calls = [
                pool.submit(c.join, self._join_epoch, remaining)
                for c in clients
            ]
            lasts = [f.result() for f in calls]  # each call has a deadline
        with self._lock:
            self._rounds = {}  # the servers start every key again, too
            self._join_epoch += 1
            self._joined = False
        if self._retune is not None:  # from the partition chosen at init
            self._retune.reset()
        for transport in self._transports:
            if isinstance(transport, RecoveringTransport):
                transport.forget_rounds()
        return lasts[0]

    def push_pull(
        self, name: str, array, *, average: bool = True, mode: str = "sync"
    ):
        """Sums one array over all workers and returns the (mean) sum."""
        return self.push_pull_async(
            [name], [array], average=average, mode=mode
        ).wait()[0]

    def _plan(self, names, flats, priorities, partition, salt=None):
        """`plan.make_plan` of arrays `flats` named `names`."""
        return plan.make_plan(
            list(names),
            [f.size for f in flats],
            [f.dtype.str for f in flats],
            [f.itemsize for f in flats],
            list(priorities),
            partition_bytes=partition,
            weights=self.weights,
            hosts=self.hosts,
            salt=salt,
        )

    def _begin(self, entry: _Call, live_flats) -> None:
        """Marks the names of `entry` in flight; at its first call, finds
        the wire names of its live arrays `live_flats`.

        The plan derives a tensor's keys from its wire name. A name keeps
        its wire name while its (size, dtype) stays the same; each new
        (size, dtype) of a name is a new generation g >= 1 with wire name
        ``f"{name}#{size}{dtype}"`` (generation 0, the name's first, is the
        name itself), so it gets keys of its own whose rounds start at 0,
        and a signature seen before goes back to its keys and their rounds.
        Every worker makes the same calls in the same order, so all agree
        on the generations; a later generation's wire name does not depend
        on the order, so a rank that pushed it alone while the others had
        joined (`join`) still agrees with them. A generation never changes
        once found, so a `_Call` keeps its wire names.
        """
        names = entry.names
        with self._lock:
            if self._joined:
                raise errors.JaxpsError(
                    f"push_pull of {list(names)[:3]} on rank {self.rank}, "
                    "which has joined (jaxps.join): a joined rank pushes "
                    "nothing until every rank has joined and its join has "
                    "returned (call jaxps.join again after a join that "
                    "timed out)."
                )
            if not self._in_flight.isdisjoint(names):
                busy = self._in_flight.intersection(names)
                raise errors.JaxpsError(
                    f"push_pull of {sorted(busy)} is already in flight; wait "
                    "for it before pushing the same name again."
                )
            self._in_flight.update(names)
            if entry.wire_names is not None:
                return
            wire_names = []
            for i, flat in zip(entry.live, live_flats):
                name = names[i]
                seen = self._signatures.setdefault(name, [])
                signature = (flat.size, flat.dtype.str)
                if signature not in seen:
                    seen.append(signature)
                gen = seen.index(signature)
                wire_names.append(
                    f"{name}#{flat.size}{flat.dtype.str}" if gen else name
                )
            entry.wire_names = tuple(wire_names)

    def _next_rounds(self, wire_names) -> dict[str, int]:
        """The round of each wire name (each counts once per push_pull)."""
        with self._lock:
            rounds = {}
            for wire in wire_names:
                if wire not in rounds:
                    rounds[wire] = self._rounds.get(wire, 0)
                    self._rounds[wire] = rounds[wire] + 1
            return rounds

    def _end(self, names, handle: Handle | None = None, timed=None) -> None:
        with self._lock:
            self._in_flight.difference_update(names)
            self._live.discard(handle)
        if timed is not None and handle is not None and handle.error is None:
            nbytes, began = timed
            self._retune.ended(nbytes / (time.perf_counter() - began))

    def _partition(self, check, nbytes: int) -> tuple[int, tuple | None]:
        """The partition of a user's call of `nbytes`, and what times it
        for `retune` ((bytes, start) where it is timed, else None)."""
        if self._retune is None or check is None:
            return self.partition_bytes, None
        with self._lock:
            number = self._rounds.get(check.wire_name, 0)
        partition = self._retune.partition(number)
        if nbytes < retune.MIN_CHUNKS * partition:
            return partition, None
        return partition, (nbytes, time.perf_counter())

    def close(self) -> None:
        """Stops the sender threads and closes the channels."""
        if self._sender is not None:
            with self._lock:
                waited_for = bool(self._live)
            # with every push_pull ended, a sender thread still busy waits
            # for a round nobody wants (e.g. the pieces of a mismatched
            # call): closing the channels ends its wait
            self._sender.stop(5.0 if waited_for else 0.5)
            self._sender = None
        for transport in self._transports:
            transport.close()
        self._transports = []
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None


def _open_transports(
    clients: list[ServerClient], config: Config, timeline
) -> list[Transport]:
    """`make_transport` of every client, all at once: the data channels
    of several servers are opened (or found unreachable) in parallel."""
    if len(clients) <= 1:
        return [make_transport(c, config, timeline) for c in clients]
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = [
            pool.submit(make_transport, c, config, timeline) for c in clients
        ]
    made, failed = [], None
    for client, future in zip(clients, futures):
        try:
            made.append(future.result())
        except BaseException as err:  # noqa: BLE001 - raised below
            client.close()
            failed = failed or err
    if failed is not None:
        for transport in made:
            transport.close()
        raise failed
    return made


def make_transport(
    client: ServerClient, config: Config, timeline=None
) -> Transport:
    """The transport for one server client (after its hello).

    - ``"auto"`` and ``"shm"``: shared memory (`ShmTransport`) for a server
      on a loopback address, unless ``config.shm_bytes`` is 0; its chunks
      still go in gRPC messages past ``shm_bytes`` or where the server
      cannot map the segments (found at the first Attach). With ``"auto"``
      its chunks under `shm.SMALL_BYTES` (and call checks) go on the data
      channel, where a call costs less than a shared-memory PushPull.
    - ``"auto"`` (other servers) and ``"tcp"`` (every server): the data
      channel (`DataTransport`) where the server offers one.
    - Else, and for ``"grpc"``: payloads in the gRPC messages
      (`GrpcTransport`).
    """
    transport = config.transport
    local = shm.is_local(client.address)
    if transport in ("auto", "shm") and config.shm_bytes > 0 and local:
        pool = shm.SlotPool(
            client.attach, config.largest_partition, config.shm_bytes
        )
        if pool.enabled:
            small = None
            if transport == "auto" and client.data_port:
                small = _data_transport(client, config, timeline)
            return ShmTransport(client, pool, timeline, small=small)
    if transport == "tcp" or (transport == "auto" and not local):
        if client.data_port:
            return _data_transport(client, config, timeline)
        log.info(
            "jaxps: server %s offers no data channel; payloads go in gRPC "
            "messages",
            client.address,
        )
    return GrpcTransport(client, timeline)


def _data_transport(
    client: ServerClient, config: Config, timeline
) -> DataTransport:
    """A `DataTransport` on `client`'s server's data channel."""
    tls = tls_context(config)

    def open_data() -> DataConnection:
        if not client.data_nonce:  # used: a new hello, a new one
            client.hello_again()
        nonce, client.data_nonce = client.data_nonce, b""
        return DataConnection(
            client.address,
            client.data_port,
            nonce,
            rank=config.worker_rank,
            job_id=config.job_id,
            token=config.token,
            incarnation=client.incarnation,
            timeout=config.timeout,
            tls=tls,
        )

    return DataTransport(client, open_data, timeline)


def _check_array(name: str, array: np.ndarray, average: bool) -> None:
    try:
        _wire.dtype_code(array.dtype)
    except TypeError as err:
        raise TypeError(f"push_pull of {name!r}: {err}") from None
    if average and array.dtype.kind in "iu":
        raise TypeError(
            f"push_pull of {name!r}: average=True needs a floating dtype, "
            f"got {array.dtype}; pass average=False to sum integers."
        )
