"""partition_bytes="auto" while a job runs: the ranks time their calls, agree
on the rates and measure again where the rate moved (`retune`); real
servers, workers in threads."""

import concurrent.futures
import json
import time

import numpy as np
import pytest

from jaxps._src import errors, retune, tuning
from jaxps._src.config import Config

from .test_tuning import runtimes


def rates(*per_rank):
    """The agreed rates: ``[present, rate]`` per rank (None: joined)."""
    return np.array(
        [(0.0, 0.0) if r is None else (1.0, r) for r in per_rank], np.float64
    )


def test_the_rate_must_move_past_the_change_from_the_first_window():
    retuner = retune.Retuner(
        65536, 4, 0, 2, agree=None, measure=None, deadline=1.0
    )
    assert not retuner._moved(rates(0.0, 0.0))  # nothing timed: no reference
    assert not retuner._moved(rates(10e6, 40e6))  # the reference: 40 MB/s
    assert not retuner._moved(rates(10e6, 79e6))  # the largest rank counts
    assert not retuner._moved(rates(21e6, 5e6))
    assert retuner._moved(rates(19e6, 5e6))  # over 2x down
    assert retuner._moved(rates(5e6, 81e6))  # over 2x up
    assert not retuner._moved(rates(None, 200e6))  # a rank has joined
    with pytest.raises(ValueError, match="2 calls or more"):
        retune.Retuner(65536, 1, 0, 2, None, None, 1.0)


def test_retune_calls_is_checked():
    with pytest.raises(errors.ConfigError, match="retune_calls=1"):
        Config(retune_calls=1)
    with pytest.raises(errors.ConfigError, match="retune_calls"):
        Config(retune_calls=-2)
    assert Config.from_env({"JAXPS_RETUNE_CALLS": "0"}).retune_calls == 0
    assert Config().retune_calls == 32


#: What the fake measurement's n-th call chooses, on every rank.
CHOSEN = (65536, 32768)


@pytest.mark.timeout(120)
def test_a_moved_rate_measures_again_and_every_rank_switches_together(
    start_servers, monkeypatch, tmp_path
):
    """From call 6 the link is 10x faster: the rates the calls report are
    their real ones (bytes over seconds, push to last sum) times 10, as
    loopback moves no more than 1.5x between call sizes. The ranks agree
    on the rates, measure again at the same epoch and all plan the next
    calls with what it chose. The measurement is the real one; its result
    is replaced by `CHOSEN` (the same on every rank) so that the partition
    does change."""
    monkeypatch.setattr(tuning, "ON_ONE_HOST", True)  # measure on loopback
    real = tuning.measure
    count: dict[int, int] = {}

    def measure(push_pull, num_servers, rank, size):
        tuned = real(push_pull, num_servers, rank, size)
        n = count[rank] = count.get(rank, -1) + 1
        return tuned._replace(partition_bytes=CHOSEN[min(n, 1)])

    monkeypatch.setattr(tuning, "measure", measure)
    faster = {0: 1.0, 1: 1.0}  # per rank
    ended = retune.Retuner.ended
    monkeypatch.setattr(
        retune.Retuner,
        "ended",
        lambda self, rate: ended(self, rate * faster[self._rank]),
    )
    servers = start_servers(2, 2)
    n = 2
    rts = runtimes(servers, n, retune_calls=4, trace_dir=str(tmp_path))
    small, large = 64 << 10, 256 << 10  # elements: 256 KiB, 1 MiB

    def train(rank):  # each rank in a thread of its own, as in processes
        for call in range(14):
            size = small if call < 6 else large
            faster[rank] = 1.0 if call < 6 else 10.0
            x = np.arange(size, dtype=np.float32) % 997 + call
            got = rts[rank].push_pull("g", x * (rank + 1), average=False)
            np.testing.assert_array_equal(got, 3 * x)

    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(train, range(n)))
        # epochs of 4 calls: the reference from calls 0-1, the same rate
        # in calls 2-5, calls 6-9 moved it: measured again once,
        # and calls 12 and 13 planned with its choice on both ranks
        for rt in rts:
            assert rt._retune.measured == 1, rt.rank
            assert rt._retune.base == CHOSEN[0]
            assert rt._retune.latest == CHOSEN[1]
            assert rt.partition_bytes == CHOSEN[1]
            assert rt._sender.credit == 4 * CHOSEN[1]
            switched = [w for w in rt._rounds if w.endswith("@32768B")]
            # generation 1 of "g" (1 MiB), at the new partition: 2 calls
            assert switched == ["g#262144<f4@32768B"], rt._rounds
            assert rt._rounds[switched[0]] == 2
    finally:
        for rt in rts:
            rt.close()
    events = json.loads((tmp_path / "jaxps-rank1.trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    (again,) = [e for e in events if e.get("name") == "retune"]
    assert again["args"]["partition_bytes"] == CHOSEN[1], again


@pytest.mark.timeout(60)
def test_retune_calls_zero_measures_once(start_servers, monkeypatch):
    monkeypatch.setattr(tuning, "ON_ONE_HOST", True)
    servers = start_servers(1, 2)
    rts = runtimes(servers, retune_calls=0)
    try:
        x = np.ones(1 << 16, np.float32)
        handles = [rt.push_pull_async(["g"], [x]) for rt in rts]
        for handle in handles:
            np.testing.assert_array_equal(handle.wait(30)[0], x)
        for rt in rts:
            assert rt.tuned is not None and rt._retune is None
    finally:
        for rt in rts:
            rt.close()


@pytest.mark.timeout(60)
def test_a_rank_lost_while_measuring_again_is_named(start_servers, monkeypatch):
    """Rank 1 makes 4 calls and leaves; rank 0's fifth call starts the
    measurement (any rate counts as moved), whose first push_pull waits
    for rank 1: the call fails within the deadline, naming rank 1, and so
    does the next one instead of waiting again."""
    monkeypatch.setattr(tuning, "ON_ONE_HOST", True)
    monkeypatch.setattr(retune, "CHANGE", 0.0)
    monkeypatch.setattr(retune, "MIN_CHUNKS", 0)  # every call is timed
    servers = start_servers(1, 2, "--round-timeout", "2")
    rts = runtimes(servers, retune_calls=2, timeout=2.0)
    x = np.ones(1 << 16, np.float32)

    def train(rank, calls):
        for _ in range(calls):
            rts[rank].push_pull("g", x)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(train, (0, 1), (4, 4)))
        rts[1].close()
        began = time.monotonic()
        with pytest.raises(errors.RoundTimeoutError) as raised:
            rts[0].push_pull("g", x)
        assert time.monotonic() - began < 15
        text = str(raised.value)  # a push_pull of the measurement's
        assert "rank(s) [1]" in text, text
        assert "measuring the links again" in text and "epoch 2" in text, text
        with pytest.raises(errors.JaxpsError, match="failed earlier"):
            rts[0].push_pull("g", x)
    finally:
        for rt in rts:
            rt.close()
