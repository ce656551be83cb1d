"""Summation throughput of the server's Store next to numpy's in-place add.

Run from the repository root:

    /work/venv/bin/python benchmarks/server_sum.py [--chunk-mb 4]

The Store is driven as the server drives it, without gRPC: for each round
every rank's ``begin_push`` + ``ticket.run()`` + ``finish_push``, then every
rank's ``pull``, which frees the round. Its throughput is the payload bytes
that went into the sums per second (``Store.bytes_summed`` / time, 10^9
bytes). "Store" pulls the sum array (``raw=True``, what a pull into shared
memory uses); "Store + reply" also encodes the gRPC reply once per round
(a copy of the sum), what a pull over gRPC uses. The reference is
``np.add(a, b, out=a)`` on arrays of the chunk's
size: with N ranks a round needs N - 1 such adds, so numpy's figure is the
same N * chunk bytes per N - 1 adds. Both run on one thread, in one process,
in the same run; each figure is the median of ``--repeats`` timed blocks of
``--rounds`` rounds after one warm-up block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from _common import MB, OtherLoad, format_table, load_average, log

from jaxps.servers import Store, _wire


def contributions(num_workers: int, nbytes: int) -> list[bytes]:
    """Every rank's payload: distinct float32 values, as the wire bytes."""
    rng = np.random.default_rng(0)
    n = nbytes // 4
    return [rng.standard_normal(n, dtype=np.float32).tobytes()
            for _ in range(num_workers)]


def store_rounds(store: Store, payloads: list[bytes], first: int,
                 rounds: int, raw: bool) -> bytes:
    """Runs `rounds` full rounds of key 1 through `store`; returns a sum."""
    code = _wire.dtype_code(np.float32)
    length = len(payloads[0]) // 4
    result = b""
    for rnd in range(first, first + rounds):
        for rank, payload in enumerate(payloads):
            ticket = store.begin_push(
                key=1, round=rnd, rank=rank, dtype_code=code, length=length,
                payload=payload, checksum=0)
            ticket.run()
            store.finish_push(ticket)
        for rank in range(len(payloads)):
            _, result = store.pull(key=1, round=rnd, rank=rank,
                                   dtype_code=code, length=length, raw=raw)
            assert result is not None, f"round {rnd} incomplete"
    return bytes(result)


def bench_store(num_workers: int, nbytes: int, rounds: int, repeats: int,
                engine_threads: int, raw: bool) -> float:
    """Median GB/s of payload bytes summed by a Store; checks one sum."""
    payloads = contributions(num_workers, nbytes)
    store = Store(num_workers, engine_threads=engine_threads)
    expected = np.sum([np.frombuffer(p, np.float32) for p in payloads],
                      axis=0, dtype=np.float32)
    result = store_rounds(store, payloads, 0, rounds, raw)  # warm-up
    got = np.frombuffer(result, np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    times = []
    for block in range(1, repeats + 1):
        start = time.perf_counter()
        store_rounds(store, payloads, block * rounds, rounds, raw)
        times.append(time.perf_counter() - start)
    assert store.pending_rounds() == 0, "the store kept finished rounds"
    return num_workers * nbytes * rounds / statistics.median(times) / 1e9


def bench_numpy(num_workers: int, nbytes: int, rounds: int,
                repeats: int) -> float:
    """Median GB/s of ``np.add(a, b, out=a)``, in the Store's units."""
    a, b = (np.frombuffer(p, np.float32).copy()
            for p in contributions(2, nbytes))
    adds = rounds * (num_workers - 1)
    times = []
    for block in range(repeats + 1):
        start = time.perf_counter()
        for _ in range(adds):
            np.add(a, b, out=a)
        if block > 0:  # block 0 is the warm-up
            times.append(time.perf_counter() - start)
    return num_workers * nbytes * rounds / statistics.median(times) / 1e9


def breakdown(nbytes: int, rounds: int, repeats: int) -> list[list[str]]:
    """Times the numpy steps a Store round is made of, for one 2-rank sum.

    Returns rows of (step, milliseconds per round, in-place add / step).
    """
    x, y = contributions(2, nbytes)
    a, b = np.frombuffer(x, np.float32), np.frombuffer(y, np.float32)
    acc = a.copy()
    inplace = b.copy()
    steps = {
        "np.add(a, b, out=a) (the reference)":
            lambda: np.add(inplace, b, out=inplace),
        "np.add(a, b, out=acc), acc reused":
            lambda: np.add(a, b, out=acc),
        "np.add(a, b) (new array)":
            lambda: np.add(a, b, dtype=np.float32),
        "acc.tobytes() (new bytes)": acc.tobytes,
        "np.add(a, b).tobytes() (what a round does)":
            lambda: np.add(a, b, dtype=np.float32).tobytes(),
    }
    seconds = {}
    for name, step in steps.items():
        times = []
        for block in range(repeats + 1):
            start = time.perf_counter()
            for _ in range(rounds):
                step()
            if block > 0:
                times.append((time.perf_counter() - start) / rounds)
        seconds[name] = statistics.median(times)
    ref = seconds["np.add(a, b, out=a) (the reference)"]
    return [[name, f"{sec * 1e3:.3f}", f"{ref / sec:.2f}"]
            for name, sec in seconds.items()]


def parse_args(argv=None):
    """Parses and checks the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-mb", default="4",
                   type=lambda s: [int(x) for x in s.split(",") if x],
                   help="comma-separated chunk sizes in MiB "
                   "(default %(default)s, the jaxps partition size)")
    p.add_argument("--workers", type=int, default=2,
                   help="ranks that push every round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=100,
                   help="rounds per timed block (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed blocks after 1 warm-up (default %(default)s)")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="Store engine_threads (default %(default)s)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the numpy steps of a round, to show "
                   "where the Store loses against the in-place add")
    args = p.parse_args(argv)
    if args.workers < 2 or args.rounds < 1 or args.repeats < 1:
        p.error("need --workers >= 2, --rounds >= 1 and --repeats >= 1")
    if not args.chunk_mb or min(args.chunk_mb) < 1:
        p.error("--chunk-mb needs sizes >= 1")
    return args


def main(argv=None) -> int:
    """Measures each chunk size and prints the table."""
    args = parse_args(argv)
    log(f"load average before: {load_average()} (over ~0.5: something "
        "else is running and the figures will be low)")
    other = OtherLoad()
    rows = []
    for size_mb in args.chunk_mb:
        nbytes = size_mb * MB
        store, reply = (
            bench_store(args.workers, nbytes, args.rounds, args.repeats,
                        args.engine_threads, raw)
            for raw in (True, False))
        ref = bench_numpy(args.workers, nbytes, args.rounds, args.repeats)
        rows.append([str(size_mb), f"{store:.2f}", f"{reply:.2f}",
                     f"{ref:.2f}", f"{store / ref:.2f}", f"{reply / ref:.2f}"])
    print(f"cores used by other processes meanwhile (0 = undisturbed): "
          f"{other.cores():.2f}")
    print(f"{args.workers} ranks")
    print(format_table(["chunk (MiB)", "Store GB/s", "Store + reply GB/s",
                        "np.add out= GB/s", "Store/numpy",
                        "(Store + reply)/numpy"], rows))
    if args.breakdown:
        for size_mb in args.chunk_mb:
            print(f"\nnumpy steps of one 2-rank round, {size_mb} MiB:")
            print(format_table(
                ["step", "ms", "reference/step"],
                breakdown(size_mb * MB, args.rounds, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
