"""``partition_bytes="auto"``: the chunk size, measured by the ranks together
right after init.

A chunk should take a couple of milliseconds of link time: long enough that
its CPU cost (a message, a wake-up on each side) stays small against its
bytes, short enough that its pull overlaps the next pushes. On the emulated
cluster (benchmarks/README.md) 2 ms partitions were at or near the best at
100 Mbit/s, 400 Mbit/s and 1 Gbit/s; 4 MiB ones were 1.5x slower at 100
Mbit/s, and below about 1 ms the CPU per chunk dominated (2x slower). That
cliff moves with the CPU a worker has to spare, so the ranks try:

1. **The rate.** Each rank push_pulls a small and a larger array
   (`RATE_PROBES`), a few times. The difference of the best times is what
   the extra bytes of a rank cost, the fixed costs of a call cancelled
   out: the rate of the rank's share of the busiest link (its own in mixed
   mode, the servers' in a plain PS).
2. **The partition.** Each of `CANDIDATE_SECONDS` of that rate is a
   candidate partition; each cuts the same probe (at least `PROBE_CHUNKS`
   chunks of the smallest candidate), a few times. The fastest wins, a
   larger one where it is within `TIE` of it: a partition too small costs
   far more than one too large, and a short probe hardly shows the CPU
   that many small chunks of many workers cost (at 8 workers and 8
   servers on 2 cores, 100 Mbit/s links, the probe put 36 KiB 5-9% ahead
   of 72 KiB, and the 25 MB push_pull then took 3.3-3.7 s against 2.35;
   in a later run 32 KiB 28% ahead of 68 KiB, and the push_pull took
   4.63 s with 32 KiB against 2.72 s with 64 KiB in the run before).
3. **The check.** The probe of the candidates moved its bytes at some
   rate too, a floor of the link's (its fixed costs count against it).
   Where the rate of step 1 is more than `RATE_SLACK` times that floor,
   step 1 was fooled (load that slowed its small call more than its large
   one: at 400 Mbit/s it once measured 137 MB/s, 2.7 times the link, and
   every candidate was too large), so the candidates of the floor join
   them, all are timed again on one probe, and the choice is among those.

A call ends for every rank once the last rank's push is in, so the rank that
came last times its transfer alone: after each step every rank's times go
around in one more push_pull, and all take the shortest of any rank and any
repetition. Every rank computes the result from the same sum, so all plan
with the same partition, as they must: the servers' keys derive from the
plan.

Where the larger rate probe was no slower than the small one, the rate is
unknown (inf in `Tuned.rate`; load slowed the small one, as seen once at 1
Gbit/s): the candidates are those of the larger probe's own rate, a floor
of the link's, and they are timed as in step 2.

Where every server is on this host (loopback addresses), the partition is
`MAX_PARTITION` without measuring: no link is there to overlap, and each
chunk costs the CPU that also moves the bytes (on 2 cores, 256 KiB
partitions halve the loopback rate of 4 MiB ones).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxps._src import config as config_module

#: Candidate partitions, in seconds of the measured rate.
CANDIDATE_SECONDS = (0.002, 0.004, 0.008)
#: A larger candidate wins over the fastest within this fraction of it
#: (benchmarks/README.md, "the call check in a piece's header" and
#: "(night): cluster.py with jaxps' own defaults"): too small a partition
#: cost up to 1.7x, too large one at most 1.07x.
TIE = 0.3
#: The probe of the candidates: at least this many chunks of the smallest.
PROBE_CHUNKS = 32
#: Bounds of the partition chosen (4 MiB: the fixed default).
MIN_PARTITION = 16 << 10
MAX_PARTITION = config_module.DEFAULT_PARTITION_BYTES
#: Bounds of the probe of the candidates, bytes per rank.
PROBE_BYTES = (1 << 20, 8 << 20)
#: Partitions are a multiple of this.
GRAIN = 4096
#: Bytes per rank of the two probes of the rate.
RATE_PROBES = (64 << 10, 1 << 20)
#: How often each probe is timed (after one warm-up).
REPEATS = 2
#: Most the rate of the rate probes may be over the rate the candidates'
#: probe achieved (measured, ratios of 1.0-1.3 where the rate was right,
#: 4.4 and 4.9 where it was not).
RATE_SLACK = 2.0
#: Push_pulls of a measurement (the bound of the wait for it).
CALLS = (len(RATE_PROBES) + 3 * len(CANDIDATE_SECONDS)) * (REPEATS + 1) + 3
#: Measure with servers on loopback addresses too (tests).
ON_ONE_HOST = False
#: Names of the probes (no user's name starts with a NUL).
PROBE_NAME = "\0tune:probe"
AGREE_NAME = "\0tune:agree"


class Tuned(NamedTuple):
    """What the ranks chose.

    Attributes:
      partition_bytes: the partition every rank uses.
      rate: the rate measured, bytes of a rank per second (inf: the larger
        probe was no slower than the small one; the candidates are then of
        the larger probe's own rate).
      candidates: the partitions tried, and the best time of each.
      seconds: how long measuring took on this rank.
    """

    partition_bytes: int
    rate: float
    candidates: tuple[tuple[int, float], ...]
    seconds: float


def _bounded(nbytes: float) -> int:
    """`nbytes` within the partition bounds, a multiple of `GRAIN`."""
    if not nbytes > 0:
        return MIN_PARTITION
    nbytes = int(min(nbytes, MAX_PARTITION)) // GRAIN * GRAIN
    return max(MIN_PARTITION, nbytes)


def candidates(rate: float) -> list[int]:
    """The partitions tried at `rate` bytes/s (distinct, in bounds)."""
    if not math.isfinite(rate):
        return [MAX_PARTITION]
    return sorted({_bounded(rate * s) for s in CANDIDATE_SECONDS})


def choose(times: dict[int, float]) -> int:
    """The partition of the fastest time, or a larger one within `TIE`."""
    best = min(times.values())
    return max(p for p, t in times.items() if t <= best * (1 + TIE))


def _probe_bytes(tried: list[int]) -> int:
    """Bytes per rank of the probe that candidates `tried` cut."""
    probe = min(max(PROBE_CHUNKS * tried[0], PROBE_BYTES[0]), PROBE_BYTES[1])
    return probe // GRAIN * GRAIN


def probe_candidates(best_times, tried: list[int]) -> dict[int, float]:
    """The best time of the probe of `tried` cut by each of them."""
    probe = _probe_bytes(tried)
    times = best_times([(f"{PROBE_NAME}{probe}/{p}", probe, p) for p in tried])
    return {p: float(t) for p, t in zip(tried, times)}


def measure(
    push_pull: Callable[..., np.ndarray],
    num_servers: int,
    rank: int,
    size: int,
) -> Tuned:
    """Measures the links with every other rank; returns the partition.

    Args:
      push_pull: ``push_pull(name, array, partition_bytes)`` returns the
        sum of `array` over the ranks, planned with that partition; it
        raises where a rank does not come.
      num_servers: the servers of the job.
      rank: this rank.
      size: the number of ranks.
    """
    began = time.perf_counter()

    def best_times(probes):
        """The shortest time of each (name, bytes, partition) probe over
        the ranks and the repetitions, agreed by all ranks."""
        mine = np.zeros((len(probes), REPEATS, size), np.float64)
        for p, (name, nbytes, partition) in enumerate(probes):
            array = np.zeros(nbytes // 4, np.float32)
            for r in range(-1, REPEATS):  # one warm-up
                start = time.perf_counter()
                push_pull(name, array, partition)
                if r >= 0:
                    mine[p, r, rank] = time.perf_counter() - start
        # the same bits on every rank (one server's sum)
        every = push_pull(AGREE_NAME, mine.ravel(), MAX_PARTITION)
        return every.reshape(mine.shape).min(axis=(1, 2))

    # 1. the rate: each probe cut into one chunk per server
    small, large = best_times(
        [
            (f"{PROBE_NAME}{n}", n, -(-n // num_servers // 4) * 4)
            for n in RATE_PROBES
        ]
    )
    extra = float(large - small)
    rate = (RATE_PROBES[1] - RATE_PROBES[0]) / extra if extra > 0 else math.inf
    # 2. the partition: one probe, cut by each candidate; where the larger
    # probe was no faster than the small one (load slowed the small one)
    # the rate is unknown: the candidates of what the larger one moved
    known = math.isfinite(rate)
    tried = candidates(rate if known else RATE_PROBES[1] / float(large))
    if len(tried) == 1:
        return Tuned(tried[0], rate, (), time.perf_counter() - began)
    measured = probe_candidates(best_times, tried)
    # 3. the check: the bytes per second the candidates' probe moved
    floor = _probe_bytes(tried) / min(measured.values())
    if known and rate > RATE_SLACK * floor:  # all again, on one probe
        tried = sorted(set(tried) | set(candidates(floor)))
        measured = probe_candidates(best_times, tried)
    return Tuned(
        choose(measured),
        rate,
        tuple(measured.items()),
        time.perf_counter() - began,
    )
