"""Deterministic mode: bitwise identical sums whatever the arrival order."""

import concurrent.futures
import random
import time

import numpy as np
import pytest

from jaxps._src.config import Config
from jaxps._src.runtime import Runtime


def contribution(rank):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(5000) * 10.0 ** (3 * rank)).astype(np.float32)


@pytest.mark.timeout(120)
def test_sums_are_bitwise_reproducible_under_shuffled_arrival(start_servers):
    n = 4
    (server,) = start_servers(1, n, "--deterministic")
    runtimes = [
        Runtime(Config(servers=(server.address,), num_workers=n, worker_rank=r))
        for r in range(n)
    ]
    results = set()
    try:
        for trial in range(4):
            delays = [0.0, 0.05, 0.1, 0.15]
            random.Random(trial).shuffle(delays)  # a new arrival order

            def work(rank, delays=delays):
                time.sleep(delays[rank])
                return runtimes[rank].push_pull(
                    "x", contribution(rank), average=False
                )

            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                outs = list(pool.map(work, range(n)))
            assert len({o.tobytes() for o in outs}) == 1
            results.add(outs[0].tobytes())
    finally:
        for rt in runtimes:
            rt.close()
    assert len(results) == 1
    ordered = contribution(0).copy()
    for r in range(1, n):
        ordered += contribution(r)
    assert results == {ordered.tobytes()}  # rank order, in float32
