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
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
from collections.abc import Sequence

import numpy as np

from jaxps._src import errors, plan, shm, topology
from jaxps._src import timeline as _timeline
from jaxps._src.client import ServerClient, channel_credentials
from jaxps._src.config import Config
from jaxps._src.datachannel import DataConnection
from jaxps._src.sender import Sender
from jaxps._src.transport import Chunk, Transport, fingerprint, pull_deadline
from jaxps._src.transport_grpc import GrpcTransport
from jaxps._src.transport_shm import ShmTransport
from jaxps._src.transport_tcp import TcpTransport
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
        """One chunk's sum is in its output (once per chunk)."""
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def fail(self, err: BaseException) -> None:
        """One chunk failed with `err`; `wait` raises the first error."""
        with self._lock:
            if self._error is None:
                self._error = err
        self._finish()

    @property
    def failed(self) -> bool:
        """Whether a chunk failed (the rest need not be sent)."""
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


#: What a push_pull expects of the servers: ``"sync"`` servers sum the
#: workers' arrays; ``"async"`` servers (``jaxps-server --async``) hold
#: parameters, add each push into them and answer with the latest.
MODES = ("sync", "async")


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
        self._seq = itertools.count()
        self._plans: dict = {}
        self._transports: list[Transport] = []
        self._sender: Sender | None = None
        addresses = config.servers + config.colocated_servers
        # Per host NIC: P processes on one host are one server of t_opt.
        self.weights = topology.host_weights(
            config.servers, config.colocated_servers
        )
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
        # One id for this init: the servers put this worker's channels in
        # one job incarnation, and a later init of the rank in a new one.
        init_id = secrets.token_hex(8)
        try:
            for c in clients:
                c.hello(
                    job_id=config.job_id,
                    rank=config.worker_rank,
                    num_workers=config.num_workers,
                    init_id=init_id,
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
        self._transports = [
            make_transport(c, config, self.timeline) for c in clients
        ]
        self._sender = Sender(credit, min(8, senders_per_server * len(clients)))

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
    ) -> Handle:
        """Starts summing `arrays` over all workers; returns a `Handle`.

        Empty arrays come back empty (their shape and dtype) and send
        nothing. A name may come with another size or dtype than in its
        last push_pull: the new signature gets keys of its own (see
        `_begin`).

        Args:
          names: one unique name per array, the same on every worker.
          arrays: numpy arrays of a supported dtype.
          average: divide the sums by the number of workers.
          priorities: higher goes out first (default: earlier names first).
          mode: ``"sync"`` to sum, ``"async"`` for servers started with
            ``--async`` (see `MODES`); checked against the servers.
        """
        if len(names) != len(arrays):
            raise ValueError(
                f"got {len(names)} names for {len(arrays)} arrays."
            )
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names must be unique, got {names}.")
        self.check_mode(names, mode)
        flats = []
        for name, array in zip(names, arrays):
            array = np.asarray(array)
            _check_array(name, array, average)
            flats.append(np.ascontiguousarray(array).reshape(-1))
        shapes = [np.shape(a) for a in arrays]
        timeout = 2 * pull_deadline(self.config.timeout)
        live = [i for i, f in enumerate(flats) if f.size]
        if not self._transports or not live:  # one worker, or nothing to send
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
        live_flats = [flats[i] for i in live]
        wire_names = self._begin(names, [names[i] for i in live], live_flats)
        try:
            pieces = self._plan(
                wire_names, live_flats, tuple(priorities[i] for i in live)
            )
            laid_out, live_outs = plan.buffers(pieces, live_flats)
            rounds = self._next_rounds([p.wire_name for p in pieces])
        except BaseException:
            self._end(names)
            raise
        outs = [f[:0].copy() for f in flats]  # the empty ones stay empty
        for i, out in zip(live, live_outs):
            outs[i] = out
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
            chunk = Chunk(handle, source, dest, header, divisor, transport)
            self._sender.put((-piece.priority, seq, i), chunk)
        return handle

    def push_pull(
        self, name: str, array, *, average: bool = True, mode: str = "sync"
    ):
        """Sums one array over all workers and returns the (mean) sum."""
        return self.push_pull_async(
            [name], [array], average=average, mode=mode
        ).wait()[0]

    def _plan(self, names, flats, priorities):
        sig = (
            tuple((n, f.size, f.dtype.str) for n, f in zip(names, flats)),
            priorities,
        )
        pieces = self._plans.get(sig)
        if pieces is None:
            pieces = plan.make_plan(
                list(names),
                [f.size for f in flats],
                [f.dtype.str for f in flats],
                [f.itemsize for f in flats],
                list(priorities),
                partition_bytes=self.config.partition_bytes,
                weights=self.weights,
            )
            self._plans[sig] = pieces
        return pieces

    def _begin(self, names, live_names, live_flats) -> list[str]:
        """Marks `names` in flight; returns the wire names of the live ones.

        The plan derives a tensor's keys from its wire name. A name keeps
        its wire name while its (size, dtype) stays the same; each new
        (size, dtype) of a name is a new generation g with wire name
        ``f"{name}#{g}"`` (generation 0 is the name itself), so it gets
        keys of its own whose rounds start at 0, and a signature seen
        before goes back to its keys and their rounds. Every worker makes
        the same calls in the same order, so all agree on the generations.
        """
        with self._lock:
            busy = self._in_flight.intersection(names)
            if busy:
                raise errors.JaxpsError(
                    f"push_pull of {sorted(busy)} is already in flight; wait "
                    "for it before pushing the same name again."
                )
            self._in_flight.update(names)
            wire_names = []
            for name, flat in zip(live_names, live_flats):
                seen = self._signatures.setdefault(name, [])
                signature = (flat.size, flat.dtype.str)
                if signature not in seen:
                    seen.append(signature)
                gen = seen.index(signature)
                wire_names.append(f"{name}#{gen}" if gen else name)
            return wire_names

    def _next_rounds(self, wire_names) -> dict[str, int]:
        """The round of each wire name (each counts once per push_pull)."""
        with self._lock:
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
        for transport in self._transports:
            transport.close()
        self._transports = []
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None


def make_transport(
    client: ServerClient, config: Config, timeline=None
) -> Transport:
    """The transport for one server client (after its hello).

    - ``"auto"`` and ``"shm"``: shared memory (`ShmTransport`) for a server
      on a loopback address, unless ``config.shm_bytes`` is 0; its chunks
      still go in gRPC messages past ``shm_bytes`` or where the server
      cannot map the segments (found at the first Attach).
    - ``"auto"`` (other servers) and ``"tcp"`` (every server): the data
      channel (`TcpTransport`) where the server offers one.
    - Else, and for ``"grpc"``: payloads in the gRPC messages
      (`GrpcTransport`).
    """
    transport = config.transport
    local = shm.is_local(client.address)
    if transport in ("auto", "shm") and config.shm_bytes > 0 and local:
        pool = shm.SlotPool(
            client.attach, config.partition_bytes, config.shm_bytes
        )
        if pool.enabled:
            return ShmTransport(client, pool, timeline)
    if transport == "tcp" or (transport == "auto" and not local):
        if client.data_port:
            connection = DataConnection(
                client.address,
                client.data_port,
                client.data_nonce,
                rank=config.worker_rank,
                job_id=config.job_id,
                token=config.token,
                incarnation=client.incarnation,
                timeout=config.timeout,
            )
            return TcpTransport(client, connection, timeline)
        log.info(
            "jaxps: server %s offers no data channel; payloads go in gRPC "
            "messages",
            client.address,
        )
    return GrpcTransport(client, timeline)


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
