"""jaxps on a real Ray instance (this machine's, on loopback): `jaxps.ray.run`,
a failing and a dying worker, a server actor Ray restarts, and
``jaxps-launch --ray``."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import jaxps.ray  # noqa: E402
from jaxps import errors  # noqa: E402
from jaxps._src.launch import ray as launch_ray  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster():
    """One Ray instance for the module: its GCS address."""
    ray.init(
        address="local",  # a new instance, whatever else runs here
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _sums(steps, fail_rank=None, exit_rank=None):
    import jaxps

    jaxps.init()
    rank = jaxps.rank()
    got = []
    for step in range(steps):
        if rank == fail_rank and step == 1:
            raise ValueError(f"rank {rank} gives up at step {step}")
        if rank == exit_rank and step == 1:
            os._exit(3)
        x = np.full(50_000, (rank + 1) * (step + 1), np.float32)
        got.append(float(jaxps.push_pull_numpy("w", x, average=False)[0]))
    return rank, jaxps.size(), got


def test_run_returns_each_rank_in_order(cluster):
    del cluster
    results = jaxps.ray.run(_sums, 3, num_workers=3, num_servers=2)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    for _, _, got in results:
        assert got == [6.0 * (s + 1) for s in range(3)]


def test_a_failing_or_dying_worker_is_named(cluster):
    del cluster
    with pytest.raises(errors.JaxpsError) as raised:
        jaxps.ray.run(
            _sums,
            5,
            fail_rank=1,
            num_workers=2,
            num_servers=1,
            round_timeout=10,
        )
    text = str(raised.value)
    assert "worker rank 1 failed" in text and "gives up at step 1" in text
    with pytest.raises(errors.JaxpsError, match="worker rank 0 died"):
        jaxps.ray.run(
            _sums,
            5,
            exit_rank=0,
            num_workers=2,
            num_servers=1,
            round_timeout=10,
        )
    # the actors of those jobs are gone: a next job gets the CPUs
    assert jaxps.ray.run(_sums, 1, num_workers=2, num_servers=1)[0][0] == 0


def test_servers_the_cluster_cannot_place_are_named(cluster, monkeypatch):
    del cluster
    monkeypatch.setattr(launch_ray, "SERVER_START_TIMEOUT", 3.0)
    with pytest.raises(errors.ServerUnavailableError) as raised:
        jaxps.ray.run(
            _sums,
            1,
            num_workers=2,
            num_servers=1,
            server_resources={"cpu_node": 1},  # no node has it
        )
    assert "{'cpu_node': 1}" in str(raised.value), raised.value


def _slow_sums(steps):
    import jaxps

    jaxps.init()
    got = []
    for step in range(steps):
        x = np.full(50_000, jaxps.rank() + step, np.float32)
        got.append(float(jaxps.push_pull_numpy("w", x, average=False)[0]))
        time.sleep(0.1)
    return got


def test_a_server_actor_ray_restarts_costs_no_step(cluster):
    del cluster
    settings = launch_ray.RaySettings(
        num_workers=2, num_servers=2, restart_servers=1, round_timeout=20
    )
    job = launch_ray._Job(settings, None)
    try:
        addresses = job.start_servers()
        pid = ray.get(job.servers[1].__ray_call__.remote(lambda a: os.getpid()))
        job.start_workers(addresses)
        refs = [w.run.remote(_slow_sums, (40,), {}) for w in job.workers]
        threading.Timer(1.5, os.kill, (pid, signal.SIGKILL)).start()
        results = job.results(refs, 120)
        # Ray restarted the actor on its port: the same address
        assert ray.get(job.servers[1].port.remote()) == int(
            addresses[1].rsplit(":", 1)[1]
        )
        assert (
            ray.get(job.servers[1].__ray_call__.remote(lambda a: os.getpid()))
            != pid
        )
    finally:
        job.close()
    for got in results:
        assert got == [1.0 + 2 * step for step in range(40)]


def test_a_dead_server_actor_is_named(cluster):
    del cluster
    settings = launch_ray.RaySettings(
        num_workers=2,
        num_servers=2,
        round_timeout=10,
        env={"JAXPS_RECOVERY_WINDOW": "1"},
    )
    job = launch_ray._Job(settings, None)
    try:
        job.start_workers(job.start_servers())
        pid = ray.get(job.servers[0].__ray_call__.remote(lambda a: os.getpid()))
        refs = [w.run.remote(_slow_sums, (400,), {}) for w in job.workers]
        threading.Timer(1.5, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(errors.JaxpsError) as raised:
            job.results(refs, 120)
    finally:
        job.close()
    text = str(raised.value)
    assert "server actor(s) [0] died" in text, text
    assert "worker rank" in text, text


WORKER = textwrap.dedent(
    """
    import sys, numpy as np, jaxps
    jaxps.init()
    s = jaxps.push_pull_numpy("w", np.ones(4, np.float32), average=False)
    print("SUM", int(s[0]), "RANK", jaxps.rank(), flush=True)
    sys.exit(int(sys.argv[1]) if jaxps.rank() == 1 else 0)
    """
)


def test_jaxps_launch_ray(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPS_")}

    def launch(code):
        return subprocess.run(
            [sys.executable, "-m", "jaxps._src.launch", "--ray"]
            + ["--address", cluster, "--workers", "2", "--servers", "1"]
            + ["--", sys.executable, str(script), str(code)],
            capture_output=True,
            text=True,
            env=env,
            timeout=150,
        )

    ok = launch(0)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for rank in range(2):
        assert f"[worker {rank}] SUM 2 RANK {rank}" in ok.stdout, ok.stdout
    failed = launch(7)
    assert failed.returncode == 7, failed.stdout + failed.stderr
    assert "worker 1 exited with code 7" in failed.stderr, failed.stderr
