"""Ray: a jaxps job on a Ray cluster (`run`, and ``jaxps-launch --ray``).

The servers are CPU-only actors (`cpus_per_server` CPUs each, and any custom
resources that pin them to CPU machines, `server_resources`), each running
a summation server in its own process. The workers are actors too, one
process per rank, placed in a placement group of one bundle per worker
(`cpus_per_worker` CPUs, `gpus_per_worker` GPUs). Each worker gets the
job's ``JAXPS_*`` settings (servers, size, its rank, a job id and a token
of its own) in its environment, then runs the function (`run`) or the
command line (`run_command`, its lines prefixed ``[worker r]``).

A worker that fails or dies ends the job with an error naming its rank
(and the servers whose actors died); everything is stopped. With
`restart_servers` R, Ray restarts a server actor that died up to R times,
on the port it had; the workers fail over to it (``recovery_window``) and
go on without losing a step. The port is kept in a file of the node, so a
server that comes back on another node is not found again. Each server
binds its node's address in the Ray cluster.

Ray is an optional extra: ``pip install "jaxps[ray]"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxps._src import errors

#: Seconds a server actor may take to start its server.
SERVER_START_TIMEOUT = 120.0
#: Seconds the check of a server actor may take after a worker failed.
PING_TIMEOUT = 5.0


def _ray():
    try:
        import ray
    except ImportError:
        raise errors.ConfigError(
            "jaxps on Ray needs Ray: pip install 'jaxps[ray]'."
        ) from None
    return ray


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """Where and how the actors of a job are placed.

    Attributes:
      num_workers: worker actors (ranks).
      num_servers: server actors.
      gpus_per_worker: GPUs of each worker actor.
      cpus_per_worker: CPUs of each worker actor.
      cpus_per_server: CPUs of each server actor.
      server_resources: custom Ray resources each server actor needs, e.g.
        ``{"cpu_node": 0.01}`` on the CPU machines' ``ray start
        --resources``, to keep servers off the GPU machines.
      placement: the workers' placement group strategy (``"PACK"``,
        ``"SPREAD"``, ``"STRICT_SPREAD"``, ...).
      restart_servers: how often Ray may restart each server actor.
      round_timeout: the servers' ``--round-timeout``, and the workers'
        ``JAXPS_TIMEOUT`` unless `env` sets it.
      env: more environment variables of every worker.
      server_options: more `jaxps.servers.ServerOptions` of every server
        (``async_mode``, ``deterministic``, ``engine_threads``, ...).
      job_id: the job id (default: a random ``jaxps-<hex>``).
      server_host: the address each server binds and the workers reach it
        at (default: its node's address in the Ray cluster; "127.0.0.1"
        where every node is this machine, as in tests).
    """

    num_workers: int
    num_servers: int
    gpus_per_worker: float = 0
    cpus_per_worker: float = 1
    cpus_per_server: float = 1
    server_resources: dict[str, float] | None = None
    placement: str = "PACK"
    restart_servers: int = 0
    round_timeout: float = 60.0
    env: dict[str, str] | None = None
    server_options: dict[str, Any] | None = None
    job_id: str | None = None
    server_host: str | None = None

    def __post_init__(self):
        if self.num_workers < 1:
            raise errors.ConfigError(
                f"num_workers must be >= 1, got {self.num_workers}."
            )
        if self.num_servers < (1 if self.num_workers > 1 else 0):
            raise errors.ConfigError(
                f"{self.num_workers} workers need num_servers >= 1, got "
                f"{self.num_servers}."
            )
        if self.restart_servers < 0:
            raise errors.ConfigError(
                f"restart_servers must be >= 0, got {self.restart_servers}."
            )


class _ServerActor:
    """A summation server in the actor's process (its death is the
    server's)."""

    def __init__(self, index: int, opts: dict, job_id: str):
        import ray

        from jaxps.servers import ServerOptions, create_server

        self.index = index
        # on this node: where a restart of the actor finds its port
        self._port_file = port_file = os.path.join(
            tempfile.gettempdir(), f"{job_id}-server{index}.port"
        )
        port = 0
        if os.path.exists(port_file):  # a restart: the port it had
            with open(port_file) as f:
                port = int(f.read())
        # the node's address in the Ray cluster: the one others reach
        host = opts.pop("host", None) or ray.util.get_node_ip_address()
        options = ServerOptions(host=host, port=port, **opts)
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()

        def serve():
            asyncio.set_event_loop(self._loop)

            async def start():
                server = create_server(options)
                await server.start()
                return server

            try:
                started.set_result(self._loop.run_until_complete(start()))
            except BaseException as err:  # noqa: BLE001 - to __init__
                started.set_exception(err)
                return
            self._loop.run_forever()

        threading.Thread(target=serve, name="jaxps-server", daemon=True).start()
        self._server = started.result(SERVER_START_TIMEOUT)
        with open(port_file, "w") as f:
            f.write(str(self._server.port))

    def __repr__(self) -> str:  # Ray's prefix of the actor's output
        return f"server {self.index}"

    def address(self) -> str:
        return self._server.address

    def port(self) -> int:
        return self._server.port

    def ping(self) -> bool:
        return True

    def forget_port(self) -> None:
        """Removes the port file (the job is over)."""
        try:
            os.unlink(self._port_file)
        except OSError:
            pass


class _WorkerActor:
    """One rank: runs a function or a command with the job's settings."""

    def __init__(self, rank: int, env: dict[str, str]):
        self.rank = rank
        os.environ.update(env)

    def __repr__(self) -> str:  # Ray's prefix of the actor's output
        return f"worker {self.rank}"

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            from jaxps._src import state

            if state.is_initialized():
                state.shutdown()

    def run_command(self, command: Sequence[str]):
        """Runs `command`; yields each line of its output, then its exit
        code (an int). Called as a streaming generator: the launcher
        prints the lines as they come."""
        proc = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        # (not `yield from`: Ray's streaming calls .send on the delegate)
        for line in proc.stdout:  # noqa: UP028
            yield line
        yield proc.wait()


class _Job:
    """The actors of one job; `close` removes them all."""

    def __init__(self, settings: RaySettings, address: str | None):
        self.ray = ray = _ray()
        self.settings = s = settings
        self.started_ray = not ray.is_initialized()
        local = self.started_ray and address is None
        if self.started_ray:
            if local:  # a Ray of this machine only
                needed = (
                    s.num_workers * s.cpus_per_worker
                    + s.num_servers * s.cpus_per_server
                )
                ray.init(
                    address="local",  # a new instance, whatever runs
                    num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                )
            else:
                ray.init(address=address)
        self.job_id = s.job_id or f"jaxps-{secrets.token_hex(6)}"
        self.token = secrets.token_hex(16)
        self.servers: list = []
        self.workers: list = []
        self.group = None

    def start_servers(self) -> list[str]:
        """Starts the server actors; returns their addresses."""
        ray, s = self.ray, self.settings
        opts = dict(
            host=s.server_host,
            num_workers=s.num_workers,
            round_timeout=s.round_timeout,
            token=self.token,
            **(s.server_options or {}),
        )
        actor = ray.remote(_ServerActor).options(
            num_cpus=s.cpus_per_server,
            resources=dict(s.server_resources or {}),
            max_restarts=s.restart_servers,
        )
        self.servers = [
            actor.remote(i, opts, self.job_id) for i in range(s.num_servers)
        ]
        try:
            return ray.get(
                [a.address.remote() for a in self.servers],
                timeout=SERVER_START_TIMEOUT,
            )
        except ray.exceptions.GetTimeoutError:
            raise errors.ServerUnavailableError(
                f"jaxps on Ray: {s.num_servers} server actor(s) of "
                f"{s.cpus_per_server:g} CPU(s) and resources "
                f"{s.server_resources or {}} did not start within "
                f"{SERVER_START_TIMEOUT:g} s: does the cluster have them?"
            ) from None

    def start_workers(self, addresses: list[str]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (
            PlacementGroupSchedulingStrategy,
        )

        ray, s = self.ray, self.settings
        bundle = {"CPU": s.cpus_per_worker}
        if s.gpus_per_worker:
            bundle["GPU"] = s.gpus_per_worker
        self.group = placement_group([bundle] * s.num_workers, s.placement)
        try:
            ray.get(self.group.ready(), timeout=SERVER_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise errors.JaxpsError(
                f"jaxps on Ray: the placement group of {s.num_workers} "
                f"worker(s) of {bundle} ({s.placement}) was not placed "
                f"within {SERVER_START_TIMEOUT:g} s: does the cluster have "
                "them, besides the servers'?"
            ) from None
        env = {
            "JAXPS_SERVERS": ",".join(addresses),
            "JAXPS_NUM_WORKERS": str(s.num_workers),
            "JAXPS_JOB_ID": self.job_id,
            "JAXPS_TOKEN": self.token,
            "JAXPS_TIMEOUT": repr(s.round_timeout),
            **(s.env or {}),
        }
        actor = ray.remote(_WorkerActor)
        self.workers = [
            actor.options(
                num_cpus=s.cpus_per_worker,
                num_gpus=s.gpus_per_worker,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group,
                    placement_group_bundle_index=rank,
                ),
            ).remote(rank, dict(env, JAXPS_WORKER_RANK=str(rank)))
            for rank in range(s.num_workers)
        ]

    def results(self, refs: list, timeout: float | None) -> list:
        """Each rank's result; the first failure ends the job, named."""
        ray = self.ray
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                ranks = sorted(pending.values())
                raise errors.RoundTimeoutError(
                    f"jaxps on Ray: worker rank(s) {ranks} did not end "
                    f"within {timeout:g} s."
                )
            done, _ = ray.wait(
                list(pending),
                num_returns=1,
                timeout=None if left is None else min(left, 1.0),
            )
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - named below
                    raise self._failed(rank, err) from err
        return results

    def _failed(self, rank: int, err: BaseException) -> errors.JaxpsError:
        ray = self.ray
        died = isinstance(err, ray.exceptions.RayActorError)
        cause = err
        if isinstance(err, ray.exceptions.RayTaskError):
            cause = err.as_instanceof_cause()
        what = "died" if died else "failed"
        dead = self.dead_servers()
        text = f"jaxps on Ray: worker rank {rank} {what}: {cause}"
        if dead:
            text += f" (server actor(s) {dead} died)"
        return errors.JaxpsError(text)

    def dead_servers(self) -> list[int]:
        ray, dead = self.ray, []
        for i, actor in enumerate(self.servers):
            try:
                ray.get(actor.ping.remote(), timeout=PING_TIMEOUT)
            except Exception:  # noqa: BLE001 - any failure: not serving
                dead.append(i)
        return dead

    def close(self) -> None:
        ray = self.ray
        for actor in self.servers:
            try:
                ray.get(actor.forget_port.remote(), timeout=PING_TIMEOUT)
            except Exception:  # noqa: BLE001 - a dead actor's file stays
                pass
        for actor in self.workers + self.servers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - already removed
                pass
        if self.started_ray:
            ray.shutdown()


def run(
    fn: Callable,
    *args,
    num_workers: int,
    num_servers: int,
    gpus_per_worker: float = 0,
    cpus_per_worker: float = 1,
    cpus_per_server: float = 1,
    server_resources: dict[str, float] | None = None,
    placement: str = "PACK",
    restart_servers: int = 0,
    round_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    address: str | None = None,
    timeout: float | None = None,
    **kwargs,
) -> list:
    """Runs ``fn(*args, **kwargs)`` as each rank of a jaxps job on Ray.

    `fn` calls `jaxps.init()` (its settings come from the environment)
    and trains; its return value is the rank's result. Without `address`,
    it joins the Ray of this process if there is one, else starts one on
    this machine (on loopback) and stops it after.

    Args:
      fn: the training function (picklable, as Ray needs).
      *args: its positional arguments.
      num_workers: the number of ranks, one actor each.
      num_servers: the number of server actors.
      gpus_per_worker: GPUs of each worker.
      cpus_per_worker: CPUs of each worker.
      cpus_per_server: CPUs of each server.
      server_resources: custom resources of each server actor (to pin the
        servers to CPU machines).
      placement: the workers' placement group strategy.
      restart_servers: how often Ray may restart a server actor that died
        (the workers fail over to it).
      round_timeout: the servers' round timeout and the workers'
        ``JAXPS_TIMEOUT`` (unless `env` sets it).
      env: more environment variables of the workers.
      address: the Ray cluster to join (``ray.init(address=...)``).
      timeout: seconds the workers may run (None: as long as they take;
        every wait inside jaxps has its own deadline).
      **kwargs: keyword arguments of `fn`.

    Returns:
      Each rank's return value, in rank order.

    Raises:
      errors.JaxpsError: a worker failed or died, naming its rank (and any
        server actor that died).
    """
    settings = RaySettings(
        num_workers=num_workers,
        num_servers=num_servers,
        gpus_per_worker=gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
        cpus_per_server=cpus_per_server,
        server_resources=server_resources,
        placement=placement,
        restart_servers=restart_servers,
        round_timeout=round_timeout,
        env=env,
    )
    job = _Job(settings, address)
    try:
        job.start_workers(job.start_servers())
        refs = [w.run.remote(fn, args, kwargs) for w in job.workers]
        return job.results(refs, timeout)
    finally:
        job.close()


def run_command(
    command: Sequence[str], settings: RaySettings, address: str | None
) -> int:
    """``jaxps-launch --ray``: runs `command` as each rank; returns 0, or
    the exit code of the first rank that failed (1 if an actor died)."""
    job = _Job(settings, address)
    try:
        job.start_workers(job.start_servers())
        ray = job.ray
        streams = {
            w.run_command.options(num_returns="streaming").remote(
                list(command)
            ): rank
            for rank, w in enumerate(job.workers)
        }
        while streams:
            ready, _ = ray.wait(list(streams), num_returns=1)
            for stream in ready:
                rank = streams[stream]
                try:
                    item = ray.get(next(stream))
                except StopIteration:
                    del streams[stream]
                    continue
                except Exception as err:  # noqa: BLE001 - named below
                    print(
                        f"jaxps-launch: {job._failed(rank, err)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                if isinstance(item, str):
                    print(f"[worker {rank}] {item}", end="", flush=True)
                elif item:  # the command failed: stop the job
                    print(
                        f"jaxps-launch: worker {rank} exited with code {item}",
                        file=sys.stderr,
                        flush=True,
                    )
                    # as the local launcher: 128 + signum if killed
                    return item if 0 < item < 256 else 128 - item
        return 0
    finally:
        job.close()
