"""Priority scheduling vs FIFO: when does the first layer's gradient arrive?

A backward pass produces the last layer's gradient first and the first
layer's last, but the next forward pass needs the first layer first. This
queues L layers' gradients in backward order behind a small credit, once
with FIFO order and once with priorities (first layer highest), and prints
when each layer's sum is back.

    python benchmarks/priority.py [--layers 24] [--layer-kb 512]
        [--trace-dir DIR]

With --trace-dir it also writes DIR/fifo/ and DIR/priority/ traces (open them
at ui.perfetto.dev, or render them with scripts/plot_timeline.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

from jaxps._src.config import Config
from jaxps._src.launch import process
from jaxps._src.runtime import Runtime


def arrivals(
    address: str,
    layers: int,
    layer_bytes: int,
    prioritized: bool,
    trace_dir: str | None = None,
):
    """Seconds after the first enqueue at which each layer's sum is back."""
    mode = "priority" if prioritized else "fifo"
    cfg = Config(
        servers=(address,),
        partition_bytes=64 * 1024,
        credit_bytes=64 * 1024,
        trace_dir=os.path.join(trace_dir, mode) if trace_dir else None,
    )
    rt = Runtime(cfg, senders_per_server=1, channels_per_server=1)
    done = [0.0] * layers
    try:
        grads = [np.ones(layer_bytes // 4, np.float32) for _ in range(layers)]
        rt.push_pull_async([f"{mode}/warm"], [grads[0]]).wait()
        start = time.monotonic()
        handles = []
        for layer in reversed(range(layers)):  # backward order
            priority = -layer if prioritized else 0
            handles.append(
                (
                    layer,
                    rt.push_pull_async(
                        [f"{mode}/layer{layer}"],
                        [grads[layer]],
                        priorities=[priority],
                    ),
                )
            )

        def wait(layer, handle):
            handle.wait()
            done[layer] = time.monotonic() - start

        threads = [threading.Thread(target=wait, args=h) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        rt.close()
    return done


def _show_stderr(stream: str, text: str) -> None:
    """Passes the server's stderr on (its stdout is only the ready line)."""
    if stream == "stderr":
        print(text, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--layer-kb", type=int, default=512)
    p.add_argument("--trace-dir", default=None)
    args = p.parse_args(argv)
    server = process.Child(
        "jaxps-server",
        process.server_argv(1),
        on_line=_show_stderr,
    )
    try:
        address = process.server_address(server, time.monotonic() + 60)
        nbytes = args.layer_kb * 1024
        fifo = arrivals(address, args.layers, nbytes, False, args.trace_dir)
        prio = arrivals(address, args.layers, nbytes, True, args.trace_dir)
    finally:
        server.stop()
    print(f"{'layer':>5} {'FIFO s':>8} {'priority s':>10}")
    for layer in range(args.layers):
        print(f"{layer:>5} {fifo[layer]:>8.3f} {prio[layer]:>10.3f}")
    print(
        f"first layer back after {fifo[0]:.3f} s with FIFO, "
        f"{prio[0]:.3f} s with priorities ({fifo[0] / prio[0]:.1f}x sooner)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
