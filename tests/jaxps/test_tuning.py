"""partition_bytes="auto": the ranks measure together at init and plan with
one partition; real servers, workers in threads."""

import concurrent.futures
import json
import math
import time

import numpy as np
import pytest

from jaxps._src import errors, tuning
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime


def runtimes(servers, n=2, **kw):
    """`n` workers of one job, initialized at once; the caller closes."""

    def start(rank):
        return Runtime(
            Config(
                servers=tuple(s.address for s in servers),
                num_workers=n,
                worker_rank=rank,
                **kw,
            )
        )

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(start, range(n)))


def exact_sums(rts, size=300_000):
    x = np.arange(size, dtype=np.float32) % 997
    handles = [
        rt.push_pull_async(["g"], [x * (r + 1)], average=False)
        for r, rt in enumerate(rts)
    ]
    total = sum(range(1, len(rts) + 1))
    for handle in handles:
        np.testing.assert_array_equal(handle.wait(30)[0], total * x)


def test_candidates_and_choice():
    # 2, 4 and 8 ms of the rate, in bounds, a multiple of the grain
    assert tuning.candidates(12.5e6) == [24576, 49152, 98304]
    assert tuning.candidates(1e3) == [tuning.MIN_PARTITION]
    assert tuning.candidates(1e12) == [tuning.MAX_PARTITION]
    assert tuning.candidates(math.inf) == [tuning.MAX_PARTITION]
    # the fastest, or a larger one within `TIE` of it
    tie = 1 + tuning.TIE
    assert tuning.choose({16384: 1.0, 32768: tie + 0.1, 65536: 2.0}) == 16384
    assert tuning.choose({16384: 1.0, 32768: tie - 0.01, 65536: 2.0}) == 32768
    assert tuning.choose({16384: 1.1, 32768: 1.0, 65536: tie}) == 65536


class _Link:
    """A link of `rate` bytes/s as one rank's push_pulls see it, on a clock
    of its own: each call costs a fixed time, its bytes, the fill and drain
    of one partition, and CPU per chunk; the small rate probe is slowed by
    `load` seconds (other processes), as the fooled measurement was."""

    def __init__(self, rate, load=0.0):
        self.rate, self.load, self.now = rate, load, 0.0

    def perf_counter(self):
        return self.now

    def push_pull(self, name, array, partition):
        nbytes = array.nbytes
        chunks = -(-nbytes // partition)
        self.now += 0.002 + (nbytes + partition) / self.rate + chunks * 2e-4
        if name == f"{tuning.PROBE_NAME}{tuning.RATE_PROBES[0]}":
            self.now += self.load
        return array  # one rank: the sum is its own


@pytest.mark.parametrize("load", [0.0, 0.03, 0.05])
def test_a_fooled_rate_probe_is_caught_by_the_candidates_probe(
    monkeypatch, load
):
    link = _Link(40e6, load)
    monkeypatch.setattr(tuning, "time", link)  # its clock
    tuned = tuning.measure(link.push_pull, num_servers=2, rank=0, size=1)
    tried = [p for p, _ in tuned.candidates]
    fooled = tuning.candidates(tuned.rate)
    if load == 0.05:  # the small probe no faster: no rate, but a floor
        assert tuned.rate == math.inf, tuned
        # the larger probe moved 1 MiB in 42 ms (its 2 chunks' partition
        # filled and drained): 25 MB/s, timed once
        large = 0.002 + 1.5 * (1 << 20) / 40e6 + 2 * 2e-4
        assert tried == tuning.candidates((1 << 20) / large), tried
        assert tuned.partition_bytes < tuning.MAX_PARTITION, tuned
    elif not load:  # about right: 2, 4 and 8 ms of it, timed once
        assert 20e6 < tuned.rate < 45e6, tuned.rate
        assert tried == fooled
    else:  # far above the link: the candidates of what the probe moved
        assert tuned.rate > 2.5 * 40e6, tuned.rate
        assert set(fooled) < set(tried), tried
        assert min(tried) < min(fooled) / 2, tried
        # below the largest of the fooled ones, which the tie rule took
        # among those alone
        assert tuned.partition_bytes < max(fooled), tuned
    assert tuned.partition_bytes == tuning.choose(dict(tuned.candidates))


@pytest.mark.timeout(60)
def test_ranks_agree_on_one_partition(start_servers, monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "ON_ONE_HOST", True)  # measure on loopback
    servers = start_servers(2, 2)
    rts = runtimes(servers, trace_dir=str(tmp_path))
    try:
        exact_sums(rts)  # waits for the measurement; planned with its result
        chosen = {rt.partition_bytes for rt in rts}
        assert len(chosen) == 1, chosen
        (partition,) = chosen
        assert tuning.MIN_PARTITION <= partition <= tuning.MAX_PARTITION
        assert partition % tuning.GRAIN == 0
        for rt in rts:
            assert rt.tuned.partition_bytes == partition
            assert rt.tuned.rate > 0
            tried = [p for p, _ in rt.tuned.candidates]
            assert partition in tried or tried == [], rt.tuned
            # the credit follows: 4 partitions
            assert rt._sender.credit == 4 * partition
        # both ranks got the same times back, so they tried the same
        assert rts[0].tuned.candidates == rts[1].tuned.candidates
    finally:
        for rt in rts:
            rt.close()
    events = json.loads((tmp_path / "jaxps-rank0.trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    (tune,) = [e for e in events if e.get("name") == "tune"]
    assert tune["args"]["partition_bytes"] == partition, tune


@pytest.mark.timeout(60)
def test_an_explicit_partition_or_one_host_measures_nothing(start_servers):
    servers = start_servers(1, 2)
    for kw, partition in (
        ({"partition_bytes": 65536}, 65536),
        ({}, tuning.MAX_PARTITION),  # loopback servers: the largest
    ):
        rts = runtimes(servers, **kw)
        try:
            exact_sums(rts)
            for rt in rts:
                assert rt.tuned is None and rt.partition_bytes == partition
        finally:
            for rt in rts:
                rt.close()


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named_at_the_first_call(
    start_servers, monkeypatch
):
    monkeypatch.setattr(tuning, "ON_ONE_HOST", True)
    servers = start_servers(1, 2, "--round-timeout", "2")
    (rt,) = [
        Runtime(
            Config(
                servers=(servers[0].address,),
                num_workers=2,
                worker_rank=0,
                timeout=2.0,
            )
        )
    ]
    try:
        began = time.monotonic()
        with pytest.raises(errors.RoundTimeoutError) as raised:
            rt.push_pull("g", np.ones(4, np.float32))
        took = time.monotonic() - began
        text = str(raised.value)
        assert "partition_bytes='auto'" in text, text
        assert "rank(s) [1]" in text, text
        assert took < 10, took
    finally:
        rt.close()
