"""Collective semantics of the JAX API with two real workers (issue 13).

`test_semantics_with_two_workers` starts a server and runs this file once
per rank (``python test_semantics.py NAME...``); each ``check_NAME`` asserts
against every rank's (deterministic) contribution and prints ``ok NAME``.
"""

import os
import sys

import pytest

CHECKS = ["empty", "shape_change", "accumulation"]


@pytest.mark.timeout(120)
def test_semantics_with_two_workers(start_servers, tmp_path):
    (server,) = start_servers(1, 2, "--round-timeout", "30")
    # imported here, not at the top: this file also runs as a script
    from .test_push_pull import run_job

    run_job(
        [server],
        2,
        CHECKS,
        tmp_path,
        timeout=100,
        script=os.path.abspath(__file__),
    )


# --- the worker side: run as a script, one process per rank ---------------


def _contribution(rank, shape, step=0, dtype="float32"):
    import numpy as np

    size = int(np.prod(shape))
    return (np.arange(size).reshape(shape) % 7 + 10 * rank + step).astype(dtype)


def _total(shape, step=0, dtype="float32"):
    import jaxps

    return sum(
        _contribution(r, shape, step, "float64") for r in range(jaxps.size())
    ).astype(dtype)


def check_empty():
    """Empty leaves come back empty, beside leaves that are summed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxps

    r = jaxps.rank()
    tree = {
        "a": jnp.zeros((0,)),
        "b": jnp.zeros((3, 0), jnp.int32),
        "c": jnp.asarray(_contribution(r, (5,))),
        "d": [jnp.zeros((2, 0, 4), jnp.float16)],
    }
    eager = lambda t: jaxps.push_pull(t, average=False, name="empty")  # noqa: E731
    jitted = jax.jit(lambda t: jaxps.push_pull(t, average=False, name="ej"))
    for f in (eager, jitted, jitted):
        out = f(tree)
        assert jax.tree.structure(out) == jax.tree.structure(tree)
        for got, leaf in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
            assert (got.shape, got.dtype) == (leaf.shape, leaf.dtype)
        np.testing.assert_array_equal(out["c"], _total((5,)))
    # grad through a push_pull with an empty leaf
    floats = {"a": tree["a"], "c": tree["c"]}

    def loss(t):
        return jnp.sum(jaxps.push_pull(t, average=False, name="eg")["c"])

    g = jax.jit(jax.grad(loss))(floats)
    np.testing.assert_array_equal(g["c"], jaxps.size())
    assert g["a"].shape == (0,)
    # inside pmap over the local devices, with axis_name
    x = np.stack([_contribution(r, (6,), step=d) for d in range(4)])
    out = jax.pmap(
        lambda v: jaxps.push_pull(
            {"e": jnp.zeros((0, 3)), "x": v},
            average=False,
            axis_name="i",
            name="epm",
        ),
        axis_name="i",
    )(x)
    assert out["e"].shape == (4, 0, 3)
    expected = sum(_total((6,), step=d) for d in range(4))
    np.testing.assert_array_equal(np.asarray(out["x"][0]), expected)
    got = jaxps.push_pull_numpy("np_empty", np.zeros((2, 0), np.float64))
    assert (got.shape, got.dtype) == ((2, 0), np.float64)


def check_shape_change():
    """A name's shape changes between rounds: exact sums each round."""
    import jax
    import numpy as np

    import jaxps

    r = jaxps.rank()
    # push_pull_numpy: a last, smaller batch, then the full size again
    for step, size in enumerate([1000, 1000, 300, 1000, 7]):
        got = jaxps.push_pull_numpy(
            "batch", _contribution(r, (size,), step), average=False
        )
        np.testing.assert_array_equal(got, _total((size,), step))
    for step, dtype in enumerate(["float32", "float64", "int32", "float32"]):
        got = jaxps.push_pull_numpy(
            "dtype", _contribution(r, (9,), step, dtype), average=False
        )
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, _total((9,), step, dtype))
    # jax: one compiled function, retraced for each new shape
    f = jax.jit(lambda t: jaxps.push_pull(t, average=False, name="shape"))
    for step, shape in enumerate([(4, 3), (2, 3), (4, 3), (5,)]):
        out = f({"x": _contribution(r, shape, step)})
        np.testing.assert_array_equal(out["x"], _total(shape, step))


def check_accumulation():
    """backward_passes_per_step=k averages the k passes (then the workers).

    The gradients are small integers and k, the number of workers and the
    learning rate are powers of two, so the expected updates are exact.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxps

    n, r, lr = jaxps.size(), jaxps.rank(), 0.5

    def grads(rank, step):
        return {
            "w": jnp.arange(3.0) + 4 * rank + step,
            "b": jnp.float32(rank - 2 * step),
        }

    def mean_of(passes, ranks):
        return jax.tree.map(
            lambda *g: sum(g) / len(g),
            *[grads(q, s) for q in ranks for s in passes],
        )

    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    cases = [
        # (tx, k, the updates on each k-th step from its k passes)
        *[
            (
                jaxps.DistributedOptimizer(
                    optax.sgd(lr), backward_passes_per_step=k, name=f"acc{k}"
                ),
                k,
                lambda passes: jax.tree.map(
                    lambda g: -lr * g, mean_of(passes, range(n))
                ),
            )
            for k in (2, 4)
        ],
        (  # average=False: the workers' sum of their local means
            optax.chain(
                jaxps.sync_gradients(
                    average=False, backward_passes_per_step=2, name="accsum"
                ),
                optax.sgd(lr),
            ),
            2,
            lambda passes: jax.tree.map(
                lambda g: -lr * n * g, mean_of(passes, range(n))
            ),
        ),
    ]
    for tx, k, want in cases:
        state = tx.init(params)
        update = jax.jit(tx.update)
        for step in range(2 * k):
            updates, state = update(grads(r, step), state, params)
            if (step + 1) % k:
                for leaf in jax.tree.leaves(updates):
                    np.testing.assert_array_equal(leaf, 0)
                continue
            expected = want(range(step + 1 - k, step + 1))
            jax.tree.map(np.testing.assert_array_equal, updates, expected)


def main(names):
    import jaxps

    jaxps.init()
    try:
        for name in names:
            globals()[f"check_{name}"]()
            print(f"ok {name}", flush=True)
    finally:
        jaxps.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
