"""The one configuration object of a jaxps worker.

Every field is resolved in this order: the explicit argument, then the
``JAXPS_*`` environment variable, then the default. The rank and the number
of workers also fall back to the scheduler that started the worker
(`jaxps._src.launch.cluster`: SLURM, MPI, a Kubernetes Indexed Job, then
`jax.distributed`; ``jax.process_index()`` and
``jax.process_count()``) when it is initialized.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxps._src import errors
from jaxps._src.launch import cluster

#: The largest partition `partition_bytes="auto"` chooses, and the one a
#: worker starts with until it has chosen.
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024
#: The `Config.partition_bytes` that lets the workers choose (`tuning`).
AUTO = "auto"

#: Field name -> environment variable.
ENV = {
    "servers": "JAXPS_SERVERS",
    "colocated_servers": "JAXPS_COLOCATED_SERVERS",
    "num_workers": "JAXPS_NUM_WORKERS",
    "worker_rank": "JAXPS_WORKER_RANK",
    "job_id": "JAXPS_JOB_ID",
    "partition_bytes": "JAXPS_PARTITION_BYTES",
    "timeout": "JAXPS_TIMEOUT",
    "token": "JAXPS_TOKEN",
    "tls_ca": "JAXPS_TLS_CA",
    "trace_dir": "JAXPS_TRACE_DIR",
    "shm_bytes": "JAXPS_SHM_BYTES",
    "transport": "JAXPS_TRANSPORT",
    "recovery_window": "JAXPS_RECOVERY_WINDOW",
    "credit_bytes": "JAXPS_CREDIT_BYTES",
    "retune_calls": "JAXPS_RETUNE_CALLS",
}

#: Default credit, in partitions: enough to keep the worker's link busy (a
#: chunk's credit comes back when the server has it), few enough that the
#: workers push the same chunks at about the same time, so each chunk's sum
#: completes early and its pull overlaps the next pushes.
CREDIT_PARTITIONS = 4

#: Values of `Config.transport`.
TRANSPORTS = ("auto", "shm", "tcp", "grpc")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Settings of a jaxps worker.

    Attributes:
      servers: ``host:port`` of every CPU summation server. Empty with one
        worker (and no colocated servers) means no communication at all.
      colocated_servers: ``host:port`` of servers running on the worker hosts
        ("mixed mode"). With n of them and k CPU servers, each CPU server takes
        2(n-1)/(n^2+kn-2k) of the traffic and each colocated one
        (n-k)/(n^2+kn-2k), the optimum of the BytePS paper.
      num_workers: number of worker processes in the job.
      worker_rank: this worker's rank in ``[0, num_workers)``.
      job_id: a name shared by the job's workers and servers.
      partition_bytes: tensors are cut into chunks of at most this many
        bytes. ``"auto"`` (the default): about 2 ms of the link rate that
        the workers measure together at init (within 16 KiB and 4 MiB; the
        same on every rank), see `jaxps._src.tuning`; measured again
        while the job runs where the rate moves (`retune_calls`).
      timeout: seconds any wait may take (connect, a round, a pull) before it
        fails naming what it waited for.
      credit_bytes: bytes being pushed at once, to all servers together;
        chunks take credit in priority order. ``None``: 4 partitions
        (`CREDIT_PARTITIONS` x `partition_bytes`; with ``"auto"``, of the
        partition chosen).
      token: shared secret sent with every call (servers run with --token).
      tls_ca: PEM file of the CA that signed the servers' certificates;
        setting it makes the worker connect over TLS.
      tls_cert: PEM client certificate, for servers that require one.
      tls_key: PEM private key of `tls_cert`.
      trace_dir: write a Chrome/Perfetto trace of every chunk's stages to
        ``<trace_dir>/jaxps-rank<r>.trace.json`` at shutdown.
      shm_bytes: most shared memory, per server, that carries payloads to
        and from a server reached on a loopback address (the same host)
        instead of gRPC messages; 0 sends every payload through gRPC.
      transport: how payloads travel. ``"auto"``: shared memory to a server
        on this host (within `shm_bytes`), the data channel (plain TCP,
        negotiated over gRPC) to a server on another host that offers one,
        else gRPC messages. ``"tcp"``: the data channel to every server
        that offers one; ``"grpc"``: gRPC messages only; ``"shm"``: like
        ``"auto"`` but gRPC messages instead of the data channel.
      recovery_window: seconds within which a server that restarted or
        stopped answering must be back; the worker then connects again,
        pushes again what the server lost and goes on without losing a
        step (synchronous mode). 0 turns failover off.
      retune_calls: with ``partition_bytes="auto"``, every this many
        calls of a name the ranks compare the rate their calls achieved
        with the rate after the last measurement, and measure again where
        it moved more than 2x (see `jaxps._src.retune`). 0: measure once,
        at init.
      generation: the elastic membership generation of this init, set by
        `jaxps.elastic.run` (0: not elastic). The servers then take the job
        incarnation's size from `num_workers`, not from ``--num-workers``.
    """

    servers: tuple[str, ...] = ()
    colocated_servers: tuple[str, ...] = ()
    num_workers: int = 1
    worker_rank: int = 0
    job_id: str = "jaxps"
    partition_bytes: int | str = AUTO
    timeout: float = 60.0
    credit_bytes: int | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    trace_dir: str | None = None
    shm_bytes: int = 64 * DEFAULT_PARTITION_BYTES
    transport: str = "auto"
    recovery_window: float = 10.0
    retune_calls: int = 32
    generation: int = 0

    def __post_init__(self):
        _check_int("num_workers", self.num_workers, low=1)
        _check_int("worker_rank", self.worker_rank, low=0)
        if self.worker_rank >= self.num_workers:
            raise errors.ConfigError(
                f"worker_rank must be in [0, num_workers={self.num_workers}). "
                f"Got worker_rank={self.worker_rank}."
            )
        _check_int("generation", self.generation, low=0)
        if self.partition_bytes != AUTO:
            try:
                _check_int("partition_bytes", self.partition_bytes, low=8)
            except errors.ConfigError as err:
                raise errors.ConfigError(f'{err} (or "auto")') from None
            if self.credit_bytes is None:
                credit = CREDIT_PARTITIONS * self.partition_bytes
                object.__setattr__(self, "credit_bytes", credit)
        if self.credit_bytes is not None:
            _check_int("credit_bytes", self.credit_bytes, low=1)
        _check_int("shm_bytes", self.shm_bytes, low=0)
        _check_int("retune_calls", self.retune_calls, low=0)
        if self.retune_calls == 1:
            raise errors.ConfigError(
                "retune_calls must be 0 (measure once) or >= 2 (the rates go "
                "out halfway through the calls). Got retune_calls=1."
            )
        if self.transport not in TRANSPORTS:
            raise errors.ConfigError(
                f"transport must be one of {', '.join(TRANSPORTS)}. Got "
                f"transport={self.transport!r}."
            )
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise errors.ConfigError(
                f"timeout must be a positive number of seconds. Got "
                f"timeout={self.timeout!r} of type {type(self.timeout)}."
            )
        if (
            isinstance(self.recovery_window, bool)
            or not isinstance(self.recovery_window, (int, float))
            or self.recovery_window < 0
        ):
            raise errors.ConfigError(
                "recovery_window must be a number of seconds >= 0. Got "
                f"recovery_window={self.recovery_window!r}."
            )
        if not isinstance(self.job_id, str) or not self.job_id:
            raise errors.ConfigError(
                f"job_id must be a non-empty string. Got job_id="
                f"{self.job_id!r}."
            )
        if self.token is not None and (
            not isinstance(self.token, str) or not self.token
        ):
            raise errors.ConfigError(
                "token must be a non-empty string (or None for no "
                f"authentication). Got token={self.token!r}."
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise errors.ConfigError(
                "tls_cert and tls_key go together; got only "
                f"{'tls_cert' if self.tls_cert else 'tls_key'}."
            )
        if self.tls_cert and not self.tls_ca:
            raise errors.ConfigError("tls_cert needs tls_ca (TLS to servers).")
        every = self.servers + self.colocated_servers
        for server in every:
            _check_address(server)
        if len(set(every)) != len(every):
            raise errors.ConfigError(
                f"servers lists an address twice: {list(every)}."
            )
        if not every and self.num_workers > 1:
            raise errors.ConfigError(
                f"num_workers={self.num_workers} needs summation servers: "
                "pass servers=['host:port', ...] or set JAXPS_SERVERS (or "
                "start the job with jaxps-launch)."
            )

    @property
    def largest_partition(self) -> int:
        """The most bytes a chunk may have: `partition_bytes`, or with
        ``"auto"`` the largest it may choose."""
        if self.partition_bytes == AUTO:
            return DEFAULT_PARTITION_BYTES
        return self.partition_bytes

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> Config:
        """Builds a Config from `overrides`, then `env` (default os.environ).

        Arguments that are ``None`` fall through to the environment.
        """
        env = os.environ if env is None else env
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise errors.ConfigError(
                f"unknown jaxps setting(s) {sorted(unknown)}; known: "
                f"{sorted(f.name for f in dataclasses.fields(cls))}."
            )
        values: dict[str, Any] = {}
        detected: dict[str, str] = {}  # field -> the scheduler's variables
        for field in dataclasses.fields(cls):
            value = overrides.get(field.name)
            var = ENV.get(field.name)
            if value is None and var is not None and var in env:
                value = _parse(field.name, env[var])
            if value is None and field.name in ("worker_rank", "num_workers"):
                found = cluster.detect(env)
                if found is not None:
                    rank = field.name == "worker_rank"
                    value = found.rank if rank else found.size
                    if value is not None:
                        detected[field.name] = found.source
            if value is not None:
                if field.name in ("servers", "colocated_servers"):
                    value = _servers(value)
                values[field.name] = value
        try:
            return cls(**values)
        except errors.ConfigError as err:
            if not detected:
                raise
            sources = [f"{f} from {v}" for f, v in detected.items()]
            if "num_workers" not in values:
                sources.append("num_workers not set: set JAXPS_NUM_WORKERS")
            raise errors.ConfigError(
                f"{err} ({'; '.join(sources)}; JAXPS_WORKER_RANK and "
                "JAXPS_NUM_WORKERS override the scheduler's)"
            ) from None


def _servers(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    return tuple(s.strip() for s in value if s.strip())


def _parse(name: str, text: str) -> Any:
    var = ENV[name]
    if name in (
        "servers",
        "colocated_servers",
        "job_id",
        "token",
        "tls_ca",
        "trace_dir",
        "transport",
    ):
        return text
    if name == "partition_bytes" and text.strip() == AUTO:
        return AUTO
    try:
        if name in ("timeout", "recovery_window"):
            return float(text)
        return int(text)
    except ValueError:
        also = " or auto" if name == "partition_bytes" else ""
        raise errors.ConfigError(
            f"{var} must be a number{also}. Got {var}={text!r}."
        ) from None


def _check_int(name: str, value: Any, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise errors.ConfigError(
            f"{name} must be an int >= {low}. Got {name}={value!r} of type "
            f"{type(value).__name__}."
        )


def _check_address(server: str) -> None:
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ConfigError(
            f"server address must be host:port with a port in [1, 65535]. "
            f"Got {server!r}."
        )
