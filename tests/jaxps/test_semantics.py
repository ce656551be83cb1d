"""Collective semantics of the runtime against real servers (issue 13).

The mode (sync/async) travels with each call, a name may change its size or
dtype between rounds, and empty arrays come back empty without traffic.
Workers are threads with their own `Runtime`, or this process through
`jaxps.init` where the JAX API is under test.
"""

import time

import numpy as np
import pytest

from jaxps import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime

from .test_runtime import run_workers

SMALL = 4096  # partition bytes: several chunks, and fused small tensors


def contribution(rank, step, size, dtype):
    return (np.arange(size) % 13 + 100 * rank + step).astype(dtype)


def expected(n, step, size, dtype):
    return sum(
        contribution(r, step, size, np.float64) for r in range(n)
    ).astype(dtype)


# (size, dtype) of each tensor per step: "batch" shrinks for a last, smaller
# batch and grows back; "dt" changes dtype at the same size; "big" spans
# several chunks and changes size; "small" stays (fused with the others).
STEPS = [
    {"batch": (1000, np.float32), "dt": (10, np.float32), "big": (5000, "f4")},
    {"batch": (1000, np.float32), "dt": (10, np.float64), "big": (5000, "f4")},
    {"batch": (300, np.float32), "dt": (10, np.int32), "big": (2500, "f4")},
    {"batch": (1000, np.float32), "dt": (10, np.float32), "big": (5000, "f4")},
    {"batch": (7, np.float32), "dt": (10, np.float64), "big": (9000, "f4")},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [None, "grpc"], ids=["auto", "grpc"])
def test_name_changes_size_and_dtype_between_rounds(start_servers, transport):
    n = 2
    servers = start_servers(2, n)

    def fn(rt):
        history = []
        for step, tensors in enumerate(STEPS):
            names = [*tensors, "small"]
            arrays = [
                contribution(rt.rank, step, size, dtype)
                for size, dtype in tensors.values()
            ]
            arrays.append(contribution(rt.rank, step, 3, np.float32))
            outs = rt.push_pull_async(names, arrays, average=False).wait()
            # one name alone, too: its own round counters
            alone = rt.push_pull(
                "alone", contribution(rt.rank, step, 50 + step, np.float64)
            )
            history.append((outs, alone))
        return history, dict(rt._signatures)

    results = run_workers(
        n, servers, fn, partition_bytes=SMALL, transport=transport
    )
    for history, _ in results:
        for step, ((outs, alone), tensors) in enumerate(zip(history, STEPS)):
            specs = [*tensors.values(), (3, np.float32)]
            for out, (size, dtype) in zip(outs, specs):
                assert out.dtype == np.dtype(dtype) and out.shape == (size,)
                np.testing.assert_array_equal(
                    out, expected(n, step, size, dtype), err_msg=str(step)
                )
            want = expected(n, step, 50 + step, np.float64) / n
            np.testing.assert_array_equal(alone, want)
    # every rank numbered the generations alike; back to a signature seen
    # before is back to its generation (and its keys), not a new one
    signatures = [s for _, s in results]
    assert signatures[0] == signatures[1]
    assert signatures[0]["batch"] == [(1000, "<f4"), (300, "<f4"), (7, "<f4")]
    assert len(signatures[0]["dt"]) == 3
    assert len(signatures[0]["small"]) == 1


@pytest.mark.timeout(60)
def test_empty_arrays_come_back_empty_without_traffic(start_servers):
    n = 2
    servers = start_servers(1, n)
    shapes = [(0,), (3, 0), (4,), (0, 2, 5)]
    dtypes = [np.float32, np.int32, np.float64, np.float16]

    # alone, rank 0 of a 2-worker job: anything sent would wait for rank 1
    cfg = Config(
        servers=(servers[0].address,), num_workers=n, worker_rank=0, timeout=5
    )
    rt = Runtime(cfg)
    try:
        arrays = [np.ones(s, d) for s, d in zip(shapes, dtypes) if 0 in s]
        handle = rt.push_pull_async(
            [f"e{i}" for i in range(len(arrays))], arrays, average=False
        )
        assert handle.done()
        for out, a in zip(handle.wait(), arrays):
            assert (out.shape, out.dtype) == (a.shape, a.dtype)
        assert rt.push_pull("one", np.ones((2, 0), np.float32)).shape == (2, 0)
        assert rt._rounds == {} and rt._signatures == {}
    finally:
        rt.close()

    def fn(rt):
        arrays = [np.full(s, rt.rank + 1, d) for s, d in zip(shapes, dtypes)]
        names = [f"m{i}" for i in range(len(arrays))]
        return [
            rt.push_pull_async(names, arrays, average=False).wait()
            for _ in range(2)
        ]

    for rounds in run_workers(n, servers, fn):
        for outs in rounds:
            for out, s, d in zip(outs, shapes, dtypes):
                assert (out.shape, out.dtype) == (s, np.dtype(d))
                np.testing.assert_array_equal(out, 3)


@pytest.mark.timeout(60)
def test_async_optimizer_does_not_claim_names(start_servers):
    """Issue 13: constructing it made every later "grads" push_pull raise."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxps

    first, second = start_servers(2, 1)
    tree = {"w": jnp.arange(3.0)}
    try:
        for server in (first, second):  # a fresh job after shutdown/init
            jaxps.init(servers=server.address, num_workers=1, timeout=10)
            jaxps.AsyncDistributedOptimizer(optax.sgd(0.1), name="g")
            out = jaxps.push_pull(tree, name="grads")
            np.testing.assert_array_equal(out["w"], tree["w"])
            step = jax.jit(lambda t: jaxps.push_pull(t, name="grads_jit"))
            np.testing.assert_array_equal(step(tree)["w"], tree["w"])
            got = jaxps.push_pull_numpy("g_numpy", np.ones(2, np.float32))
            np.testing.assert_array_equal(got, 1.0)
            # the call says "async", these servers sum: refused at trace time
            with pytest.raises(errors.JaxpsError, match="started with --async"):
                jaxps.push_pull(tree, name="grads", mode="async")
            jaxps.shutdown()
    finally:
        jaxps.shutdown()


@pytest.mark.timeout(60)
def test_empty_jax_leaves_send_nothing(start_servers):
    """Rank 0 alone in a 2-worker job: empty leaves must not wait."""
    import jax
    import jax.numpy as jnp

    import jaxps

    (server,) = start_servers(1, 2)
    tree = {
        "a": jnp.zeros((0,)),
        "b": jnp.zeros((3, 0), jnp.int32),
        "c": [jnp.zeros((0, 4), jnp.bfloat16)],
    }
    try:
        jaxps.init(
            servers=server.address, num_workers=2, worker_rank=0, timeout=5
        )
        began = time.monotonic()
        for f in (
            lambda t: jaxps.push_pull(t, average=False, name="e"),
            jax.jit(lambda t: jaxps.push_pull(t, average=False, name="ej")),
        ):
            out = f(tree)
            assert jax.tree.structure(out) == jax.tree.structure(tree)
            for got, leaf in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
                assert (got.shape, got.dtype) == (leaf.shape, leaf.dtype)
        assert time.monotonic() - began < 5
        assert jaxps._src.state.runtime()._rounds == {}
    finally:
        jaxps.shutdown()
