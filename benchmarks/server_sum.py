"""Summation throughput of the server's Store next to numpy's in-place add.

Run from the repository root:

    python benchmarks/server_sum.py [--model-mb 64]

The Store is driven as the server drives it, without gRPC: every round, each
rank's ``begin_push`` of every key, the pushes run on the key's engine thread
(``--engine-threads``; 1 runs them on the caller's thread) and
``finish_push``; then every rank's ``pull``, which frees the round. A round
covers a model of ``--model-mb`` per rank cut into ``--chunk-mb`` keys, and
every rank pushes its own arrays, so the data does not stay in the cache
between rounds (as on a real server, whose payloads arrive fresh). Paths:

* shared memory: each rank lends its slot (``lent=True``), as a worker on
  the server's host does: the sum is made in place in one slot and copied
  into the others, where the pulls find it;
* gRPC: payloads are read-only request bytes; the sum goes into the key's
  accumulator and pulls take the sum array; "+ reply" also encodes the gRPC
  reply (one more copy of the sum per round).

The Store's throughput is the payload bytes that went into the sums per
second (``Store.bytes_summed`` / time, 10^9 bytes). The reference is
``np.add(a, b, out=a)`` on one thread over arrays of the same sizes and the
same total size: with N ranks a key needs N - 1 such adds per round, so
numpy's figure is N * chunk bytes per N - 1 adds. Each figure is the median
of ``--repeats`` timed blocks of ``--rounds`` rounds after one warm-up
block, all in one process and run. Values start in [1, 2) and double every
round in the shared-memory path (the sums stay in the slots), which float32
holds for far more rounds than are run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import numpy as np
from _common import MB, OtherLoad, format_table, load_average, log

from jaxps.servers import Store, _wire

CODE = _wire.dtype_code(np.float32)


def make_payloads(ranks: int, keys: int, chunk: int, writable: bool):
    """payloads[rank][key]: distinct float32 arrays in [1, 2)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(ranks):
        arrays = [
            1 + rng.random(chunk // 4, dtype=np.float32) for _ in range(keys)
        ]
        # a slot is a writable byte buffer, a request's payload read-only
        out.append(
            [
                memoryview(a).cast("B") if writable else a.tobytes()
                for a in arrays
            ]
        )
    return out


class Driver:
    """Runs full rounds of every key through a Store, as the server does."""

    def __init__(
        self,
        ranks: int,
        keys: int,
        chunk: int,
        *,
        lent: bool,
        reply: bool,
        engine_threads: int,
    ):
        self.ranks, self.keys, self.lent, self.reply = ranks, keys, lent, reply
        self.store = Store(ranks, engine_threads=engine_threads)
        self.payloads = make_payloads(ranks, keys, chunk, writable=lent)
        self.length = chunk // 4
        self.engines = (
            [
                concurrent.futures.ThreadPoolExecutor(1)
                for _ in range(engine_threads)
            ]
            if engine_threads > 1
            else []
        )
        self.round = 0

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self._push_all()
            self._pull_all()
            self.round += 1

    def _push_all(self) -> None:
        tickets = []
        for key in range(self.keys):
            for rank in range(self.ranks):
                payload = self.payloads[rank][key]
                ticket = self.store.begin_push(
                    key=key,
                    round=self.round,
                    rank=rank,
                    dtype_code=CODE,
                    length=self.length,
                    payload=payload,
                    checksum=0,
                    lent=self.lent,
                )
                if self.engines:
                    engine = self.engines[ticket.engine]
                    tickets.append((ticket, engine.submit(ticket.run)))
                else:
                    ticket.run()
                    self.store.finish_push(ticket)
        for ticket, future in tickets:
            future.result()
            self.store.finish_push(ticket)

    def _pull_all(self) -> None:
        for key in range(self.keys):
            for rank in range(self.ranks):
                into = self.payloads[rank][key] if self.lent else None
                _, got = self.store.pull(
                    key=key,
                    round=self.round,
                    rank=rank,
                    dtype_code=CODE,
                    length=self.length,
                    raw=not self.reply,
                    into=into,
                )
                assert got is not None, f"round {self.round} incomplete"

    def check(self) -> None:
        """Checks the sums of one round against numpy."""
        before = [
            [np.frombuffer(p, np.float32).copy() for p in rank]
            for rank in self.payloads
        ]
        self._push_all()
        for key in range(self.keys):
            expected = np.sum(
                [before[r][key] for r in range(self.ranks)],
                axis=0,
                dtype=np.float32,
            )
            for rank in range(self.ranks):
                into = self.payloads[rank][key] if self.lent else None
                _, got = self.store.pull(
                    key=key,
                    round=self.round,
                    rank=rank,
                    dtype_code=CODE,
                    length=self.length,
                    raw=True,
                    into=into,
                )
                got = np.frombuffer(got, np.float32)
                np.testing.assert_allclose(got, expected, rtol=1e-6)
        self.round += 1

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def timed(run, rounds: int, repeats: int) -> float:
    """Median seconds per block of `rounds`, after one warm-up block."""
    run(rounds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(rounds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_store(
    args, chunk: int, *, lent: bool, reply: bool, engine_threads: int
) -> float:
    """GB/s of payload bytes summed by a Store on one path."""
    keys = max(1, args.model_mb * MB // chunk)
    driver = Driver(
        args.workers,
        keys,
        chunk,
        lent=lent,
        reply=reply,
        engine_threads=engine_threads,
    )
    try:
        driver.check()
        seconds = timed(driver.run, args.rounds, args.repeats)
        assert driver.store.pending_rounds() == 0, "rounds were kept"
    finally:
        driver.close()
    return args.workers * keys * chunk * args.rounds / seconds / 1e9


def bench_numpy(args, chunk: int) -> float:
    """GB/s of ``np.add(a, b, out=a)`` over the same data, in Store units."""
    keys = max(1, args.model_mb * MB // chunk)
    a, b = (
        [np.frombuffer(p, np.float32) for p in arrays]
        for arrays in make_payloads(2, keys, chunk, writable=True)
    )

    def run(rounds):
        for _ in range(rounds):
            for key in range(keys):
                for _ in range(args.workers - 1):
                    np.add(a[key], b[key], out=a[key])

    seconds = timed(run, args.rounds, args.repeats)
    return args.workers * keys * chunk * args.rounds / seconds / 1e9


PATHS = {
    # name: (lent, reply)
    "shared memory": (True, False),
    "gRPC": (False, False),
    "gRPC + reply": (False, True),
}


def parse_args(argv=None):
    """Parses and checks the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-mb",
        type=int,
        default=64,
        help="bytes per rank and round, in MiB (default "
        "%(default)s: well beyond the cache)",
    )
    p.add_argument(
        "--chunk-mb",
        default="4",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="comma-separated chunk sizes in MiB "
        "(default %(default)s, the jaxps partition size)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="ranks that push every round (default %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds per timed block (default %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed blocks after 1 warm-up (default %(default)s)",
    )
    p.add_argument(
        "--engine-threads",
        default="1,2",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="comma-separated engine thread counts (default %(default)s)",
    )
    args = p.parse_args(argv)
    if args.workers < 2 or args.rounds < 1 or args.repeats < 1:
        p.error("need --workers >= 2, --rounds >= 1 and --repeats >= 1")
    if not args.chunk_mb or min(args.chunk_mb) < 1:
        p.error("--chunk-mb needs sizes >= 1")
    if not args.engine_threads or min(args.engine_threads) < 1:
        p.error("--engine-threads needs counts >= 1")
    # shared-memory values double every round: stay far from float32's max
    if (args.rounds * (args.repeats + 1) + 1) * np.log2(args.workers) > 100:
        p.error("too many rounds: the shared-memory sums would overflow")
    return args


def main(argv=None) -> int:
    """Measures each path and chunk size and prints the table."""
    args = parse_args(argv)
    log(
        f"load average before: {load_average()} (over ~0.5: something "
        "else is running and the figures will be low)"
    )
    other = OtherLoad()
    rows = []
    for size_mb in args.chunk_mb:
        chunk = size_mb * MB
        ref = bench_numpy(args, chunk)
        for name, (lent, reply) in PATHS.items():
            for threads in args.engine_threads:
                got = bench_store(
                    args, chunk, lent=lent, reply=reply, engine_threads=threads
                )
                rows.append(
                    [
                        name,
                        str(size_mb),
                        str(threads),
                        f"{got:.2f}",
                        f"{ref:.2f}",
                        f"{got / ref:.2f}",
                    ]
                )
    print(
        f"cores used by other processes meanwhile (0 = undisturbed): "
        f"{other.cores():.2f}"
    )
    print(f"{args.workers} ranks, {args.model_mb} MiB per rank and round")
    print(
        format_table(
            [
                "path",
                "chunk (MiB)",
                "engine threads",
                "Store GB/s",
                "np.add out= GB/s",
                "Store/numpy",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
