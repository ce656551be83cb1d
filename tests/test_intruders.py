"""Stray inits and second jobs under the default job id, on real servers
without a token: never summed with a running job, named when they collide."""

import concurrent.futures
import time

import numpy as np
import pytest

from jaxps import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime


def worker(server, rank, timeout=10.0):
    """A worker of the default job id ("jaxps") on `server`."""
    return Runtime(
        Config(
            servers=(server.address,),
            num_workers=2,
            worker_rank=rank,
            timeout=timeout,
        )
    )


def together(fn, runtimes):
    """``fn(rank, runtime)`` on every runtime at once; results or errors."""
    with concurrent.futures.ThreadPoolExecutor(len(runtimes)) as pool:
        futures = [pool.submit(fn, r, rt) for r, rt in enumerate(runtimes)]
        out = []
        for future in futures:
            try:
                out.append(future.result())
            except errors.JaxpsError as err:
                out.append(err)
        return out


def summed(name, runtimes, ranks=(0, 1)):
    x = np.arange(1000, dtype=np.float32)
    return together(
        lambda i, rt: rt.push_pull(name, x * (ranks[i] + 1), average=False),
        runtimes,
    )


def close(*runtimes):
    for rt in runtimes:
        rt.close()


@pytest.mark.timeout(90)
def test_a_stray_init_between_the_ranks_is_named_never_summed(start_servers):
    (server,) = start_servers(1, 2, "--claim-window", "2")
    rank0 = worker(server, 0)
    stray = worker(server, 1)  # before the real rank 1
    real1 = worker(server, 1)
    try:
        start = time.monotonic()
        outs = summed("w", [rank0, stray, real1], ranks=(0, 1, 1))
        took = time.monotonic() - start
        for out in outs:  # rank 0 got no sum with the stray in it
            assert isinstance(out, errors.JaxpsError), out
            assert "two processes claim rank 1" in str(out), str(out)
            assert str(out).count("127.0.0.1") >= 2  # both hosts
        assert took < 8  # the window (2 s), not the timeout (10 s)
    finally:
        close(rank0, stray, real1)
    # the real job inits again and sums exactly
    again = [worker(server, r) for r in range(2)]
    try:
        for out in summed("w", again):
            np.testing.assert_array_equal(out, 3 * np.arange(1000))
    finally:
        close(*again)


@pytest.mark.timeout(90)
def test_an_intruder_mid_job_leaves_the_job_unharmed(start_servers):
    (server,) = start_servers(1, 2, "--claim-window", "1")
    job = [worker(server, r) for r in range(2)]
    try:
        for name in ("a", "b"):
            for out in summed(name, job):
                np.testing.assert_array_equal(out, 3 * np.arange(1000))
        time.sleep(1.5)  # past the claim window of the job's hellos
        intruder = worker(server, 1, timeout=3.0)
        try:
            for name in ("c", "d", "e"):  # the job goes on, exact
                for out in summed(name, job):
                    np.testing.assert_array_equal(out, 3 * np.arange(1000))
            with pytest.raises(errors.JaxpsError, match=r"rank\(s\) \[0\]"):
                intruder.push_pull("c", np.full(1000, 1000.0, np.float32))
        finally:
            intruder.close()
        time.sleep(3.0)  # the job pauses (an evaluation) and goes on
        for out in summed("f", job):
            np.testing.assert_array_equal(out, 3 * np.arange(1000))
    finally:
        close(*job)


@pytest.mark.timeout(90)
def test_two_jobs_with_the_default_job_id_both_exact(start_servers):
    """Two users run a 2-worker job each against the same long-running
    servers, both with the default job id; the second starts while the
    first's ranks are within the claim window (its sums are held until the
    second's membership completes), then both train at once. (Ranks of two
    jobs that init interleaved cannot be told apart: give each job its own
    JAXPS_JOB_ID, as jaxps-launch does.)"""
    servers = start_servers(2, 2)
    addresses = tuple(s.address for s in servers)

    def start():
        return [
            Runtime(Config(servers=addresses, num_workers=2, worker_rank=r))
            for r in range(2)
        ]

    def train(runtimes, scale):
        x = np.arange(100_000, dtype=np.float32) * scale
        for step in range(5):
            outs = together(
                lambda r, rt, name=f"g{step}": rt.push_pull(
                    name, x * (r + 1), average=False
                ),
                runtimes,
            )
            for out in outs:
                np.testing.assert_array_equal(out, 3 * x)
        return scale

    first = start()
    second = start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(train, first, 1.0),
                pool.submit(train, second, 1e3),
            ]
            assert [r.result() for r in runs] == [1.0, 1e3]
    finally:
        close(*first, *second)
