"""What an elastic commit costs: steps with `State.commit` under
`jaxps.elastic.run` against the same steps without it, in the same run.

Two worker processes and two servers on 127.0.0.1. Each worker trains a
jitted optax model with `jaxps.DistributedOptimizer`, in blocks of
``--steps`` steps that alternate between plain steps and elastic steps (a
commit per step: rank 0's probe of the first server and a one-element
push_pull), ``--repeats`` times each. Prints the median step time of each
and their ratio::

    python benchmarks/elastic.py [--params 1000000] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from jaxps._src.launch import process

WORKER = textwrap.dedent(
    """
    import statistics, sys, time
    import numpy as np, jax, jax.numpy as jnp, optax
    import jaxps

    params_n, steps, repeats = map(int, sys.argv[1:4])
    opt = jaxps.DistributedOptimizer(optax.sgd(1e-3))
    params = {"w": jnp.zeros(params_n)}
    x = jnp.ones(params_n)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = jaxps.elastic.State(params=params, opt_state=opt.init(params),
                                step=0)
    times = {"plain": [], "elastic": []}

    @jaxps.elastic.run
    def train(state):
        for _ in range(repeats):
            for kind in ("plain", "elastic"):
                for _ in range(steps):
                    began = time.perf_counter()
                    state.params, state.opt_state = step(
                        state.params, state.opt_state)
                    jax.block_until_ready(state.params)
                    if kind == "elastic":
                        state.commit()
                    times[kind].append(time.perf_counter() - began)

    train(state)
    if jaxps.rank() == 0:
        plain = statistics.median(times["plain"][5:])
        elastic = statistics.median(times["elastic"][5:])
        print(f"RESULT {plain * 1e3:.2f} {elastic * 1e3:.2f}", flush=True)
    """
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    servers = [
        process.Child("jaxps-server", process.server_argv(2, port=0))
        for _ in range(2)
    ]
    try:
        addresses = [
            process.server_address(s, time.monotonic() + 60) for s in servers
        ]
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "worker.py")
            with open(script, "w") as f:
                f.write(WORKER)
            env = dict(
                os.environ,
                JAXPS_SERVERS=",".join(addresses),
                JAXPS_NUM_WORKERS="2",
            )
            argv = [sys.executable, script, str(args.params)]
            argv += [str(args.steps), str(args.repeats)]
            workers = [
                subprocess.Popen(
                    argv,
                    env=dict(env, JAXPS_WORKER_RANK=str(r)),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(2)
            ]
            outs = [w.communicate(timeout=900)[0] for w in workers]
        if any(w.returncode for w in workers):
            raise SystemExit(f"a worker failed:\n{''.join(outs)}")
        result = next(
            line for line in outs[0].splitlines() if line.startswith("RESULT")
        )
        plain, elastic = map(float, result.split()[1:])
        print("| params | plain step (ms) | elastic step (ms) | ratio |")
        print("|---:|---:|---:|---:|")
        print(
            f"| {args.params:,} | {plain:.2f} | {elastic:.2f} | "
            f"{elastic / plain:.2f} |"
        )
    finally:
        for s in servers:
            s.stop(10)


if __name__ == "__main__":
    main()
