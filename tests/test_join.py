"""`jaxps.join` with uneven data: real servers and one process per rank.

Rank r has BATCHES[r] batches. A rank that runs out joins; the others go
on, their averages over the ranks that still push; once all joined, the
next epoch averages over every rank again.
"""

import pathlib
import sys
import textwrap

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent / "ops"))
from test_push_pull import start_ranks  # noqa: E402

WORKER = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    import jaxps
    from jaxps import errors
    from jaxps._src import state

    BATCHES = [int(b) for b in sys.argv[1].split(",")]
    jaxps.init()
    r, n = jaxps.rank(), jaxps.size()

    def grad_of(rank, step):
        return np.arange(4, dtype=np.float32) + (rank + 1) * 10.0 + step

    def mean(step, ranks):
        return np.mean([grad_of(q, step) for q in ranks], axis=0)

    # epoch 1: uneven; a jitted DistributedOptimizer step and a numpy call
    opt = jaxps.DistributedOptimizer(optax.sgd(1.0))
    params = {"w": jnp.zeros(4)}
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, g):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * g))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    want = np.zeros(4)
    for s in range(BATCHES[r]):
        ranks = [q for q in range(n) if BATCHES[q] > s]
        params, opt_state = step(params, opt_state, jnp.asarray(grad_of(r, s)))
        want -= mean(s, ranks)
        total = jaxps.push_pull_numpy("n", np.full(2, r + 1.0), average=False)
        np.testing.assert_allclose(total, sum(q + 1.0 for q in ranks))
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)
    last = jaxps.join()
    assert last == 0, last  # rank 0 has the most batches: it joins last
    print("ok uneven", last, flush=True)

    # epoch 2: everybody again, and all join in the same step
    for s in range(2):
        params, opt_state = step(params, opt_state, jnp.asarray(grad_of(r, s)))
        want -= mean(s, range(n))
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)
    jaxps.join()
    print("ok same_step", flush=True)

    # epoch 3: rank 1 starts a push_pull and joins without waiting for it;
    # rank 0 pushes that round later: the push made before joining counts
    runtime = state.runtime()
    if r == 1:
        handle = runtime.push_pull_async(["p"], [grad_of(r, 0)])
        jaxps.join()
        np.testing.assert_allclose(handle.wait()[0], mean(0, range(n)))
    else:
        if r == 0:
            time.sleep(0.5)
        out = runtime.push_pull("p", grad_of(r, 0))
        np.testing.assert_allclose(out, mean(0, range(n)))
        if r == 0:  # rank 1 joined: this one is over the others only
            out = runtime.push_pull("p", grad_of(r, 1))
            others = [q for q in range(n) if q != 1]
            np.testing.assert_allclose(out, mean(1, others))
        else:
            runtime.push_pull("p", grad_of(r, 1))
        jaxps.join()
    print("ok pending", flush=True)

    # epoch 4: rank 1's join times out (rank 0 is busy); it stays joined,
    # so its push_pull is refused; a second join then completes
    if r == 1:
        began = time.monotonic()
        try:
            jaxps.join(timeout=1.0)
            raise AssertionError("join did not time out")
        except errors.RoundTimeoutError as err:
            assert time.monotonic() - began < 4, time.monotonic() - began
            assert "waiting for rank(s) [0" in str(err), err
        try:
            jaxps.push_pull_numpy("late", np.ones(2, np.float32))
            raise AssertionError("push_pull after join was not refused")
        except errors.JaxpsError as err:
            assert "has joined" in str(err), err
        jaxps.join()
    else:
        if r == 0:
            time.sleep(3.0)
        jaxps.join()
    x = jaxps.push_pull_numpy("after", np.full(2, float(r), np.float32))
    np.testing.assert_allclose(x, np.mean(range(n)))
    print("ok refused", flush=True)
    jaxps.shutdown()
    """
)


def run(start_servers, tmp_path, batches):
    n = len(batches)
    servers = start_servers(2, n)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = start_ranks(
        script,
        [",".join(map(str, batches))],
        [s.address for s in servers],
        n,
        tmp_path,
        timeout=100,
        jaxps_timeout=20,
    )
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{out}"
        for name in ("uneven", "same_step", "pending", "refused"):
            assert f"ok {name}" in out, f"rank {rank}: {name}:\n{out}"
    # every rank names the same last rank
    assert all("ok uneven 0" in out for _, out in results)


@pytest.mark.timeout(120)
def test_join_two_workers(start_servers, tmp_path):
    run(start_servers, tmp_path, [5, 3])


@pytest.mark.timeout(120)
def test_join_three_workers(start_servers, tmp_path):
    run(start_servers, tmp_path, [5, 3, 4])
