"""sync_batch_stats between real workers: linen, nnx, integers, empty, errors.

One module-wide job: a real ``jaxps-server`` and two worker processes that
run this file as a script (``python test_batch_stats.py CHECK...``). Each
worker trains on its own data, so its BatchNorm statistics are its own,
saves them before and after `jaxps.sync_batch_stats` to ``CHECK_RANK.npz``
and prints ``ok CHECK`` (or ``FAIL CHECK`` and the traceback). The tests
below compare the two ranks' files.
"""

import sys
import traceback

import numpy as np
import pytest

CHECKS = ("linen", "nnx", "integers", "empty", "bad_input")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def job(module_server, tmp_path_factory):
    """``(cwd, {check: [(ok, rank output)]})`` of one 2-worker job."""
    cwd = tmp_path_factory.mktemp("batch_stats")
    # imported here, not at the top: this file also runs as a script
    from ..ops.test_push_pull import run_checks

    return cwd, run_checks(
        __file__, CHECKS, module_server.address, cwd, timeout=100
    )


def _assert_ok(job, check):
    from ..ops.test_push_pull import assert_check_ok

    assert_check_ok(job[1], check)


def _load(job, check):
    _assert_ok(job, check)
    return [dict(np.load(job[0] / f"{check}_{rank}.npz")) for rank in (0, 1)]


def _assert_averaged(ranks):
    """Before: the ranks differ; after: equal, and the mean of before."""
    before = [
        {k[7:]: v for k, v in r.items() if k[:7] == "before/"} for r in ranks
    ]
    after = [
        {k[6:]: v for k, v in r.items() if k[:6] == "after/"} for r in ranks
    ]
    assert before[0] and sorted(before[0]) == sorted(after[0])
    for key in before[0]:
        assert not np.allclose(before[0][key], before[1][key]), key
        np.testing.assert_array_equal(after[0][key], after[1][key], key)
        mean = (before[0][key] + before[1][key]) / 2
        np.testing.assert_allclose(after[0][key], mean, rtol=1e-6, atol=1e-7)


def test_linen_batch_stats_become_the_mean_over_ranks(job):
    _assert_averaged(_load(job, "linen"))


def test_nnx_batch_stats_become_the_mean_and_ranks_evaluate_alike(job):
    ranks = _load(job, "nnx")
    _assert_averaged(ranks)
    # the same parameters, now the same statistics: the same predictions
    np.testing.assert_array_equal(ranks[0]["eval/"], ranks[1]["eval/"])


def test_integer_leaves_take_rank_0s_value(job):
    ranks = _load(job, "integers")
    for r in ranks:
        count, flag = r["stats/['count']"], r["stats/['flag']"]
        assert count.dtype == np.int32 and count == 10
        assert flag.dtype == np.bool_ and flag
        np.testing.assert_array_equal(r["stats/['mean']"], [0.5, 1.5])


def test_empty_collections_make_no_server_call(job):
    _assert_ok(job, "empty")


def test_bad_input_raises_a_clear_type_error(job):
    _assert_ok(job, "bad_input")


# ---- the worker side: ``python test_batch_stats.py CHECK...`` --------------


def _data(rank, n=64, features=4):
    """Inputs whose mean and spread depend on the rank, and targets."""
    rng = np.random.default_rng(rank)
    x = (1 + rank) * rng.normal(size=(n, features)) + 3 * rank
    return x.astype(np.float32), rng.normal(size=(n,)).astype(np.float32)


def _save(check, rank, **trees):
    """Saves each tree's leaves as ``NAME/PATH`` to ``CHECK_RANK.npz``."""
    import jax

    arrays = {}
    for prefix, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            arrays[f"{prefix}/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    np.savez(f"{check}_{rank}.npz", **arrays)


def _assert_same(a, b):
    import jax

    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def check_linen(jaxps):
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
            return nn.Dense(1)(nn.relu(x))[:, 0]

    class State(train_state.TrainState):
        batch_stats: dict

    rank = jaxps.rank()
    x, y = _data(rank)
    net = Net()
    variables = net.init(jax.random.key(0), x, train=False)
    state = State.create(
        apply_fn=net.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=jaxps.DistributedOptimizer(optax.sgd(0.01), name="linen_grads"),
    )

    @jax.jit
    def step(state, x, y):
        def loss(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            return jnp.mean((out - y) ** 2), updates["batch_stats"]

        grads, stats = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    for i in range(3):
        state = step(state, x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)])

    synced = jaxps.sync_batch_stats(state, name="linen_state")  # TrainState
    _assert_same(synced.params, state.params)
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    from_dict = jaxps.sync_batch_stats(variables, name="linen_vars")
    assert from_dict["params"] is state.params
    jitted = jax.jit(
        functools.partial(jaxps.sync_batch_stats, name="linen_jit")
    )(state.batch_stats)
    _assert_same(from_dict["batch_stats"], synced.batch_stats)
    _assert_same(jitted, synced.batch_stats)
    _save("linen", rank, before=state.batch_stats, after=synced.batch_stats)


def check_nnx(jaxps):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
            self.lin2 = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.lin2(nnx.relu(self.bn(self.lin1(x))))[:, 0]

    rank = jaxps.rank()
    x, y = _data(rank)
    model = Net(nnx.Rngs(rank))
    nnx.update(model, jaxps.broadcast(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(
        model,
        jaxps.DistributedOptimizer(optax.sgd(0.01), name="nnx_grads"),
        wrt=nnx.Param,
    )

    @nnx.jit
    def step(model, opt, x, y):
        def loss(model):
            return jnp.mean((model(x) - y) ** 2)

        opt.update(model, nnx.grad(loss)(model))

    for i in range(3):
        step(model, opt, x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)])

    before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    twin = nnx.clone(model)
    assert jaxps.sync_batch_stats(model, name="nnx") is None  # in place
    nnx.jit(lambda m: jaxps.sync_batch_stats(m, name="nnx_jit"))(twin)
    after = nnx.state(model, nnx.BatchStat)
    _assert_same(nnx.state(twin, nnx.BatchStat), after)
    _assert_same(nnx.state(model, nnx.Param), params)

    model.eval()
    probe = jnp.linspace(-3, 3, 20, dtype=jnp.float32).reshape(5, 4)
    _save("nnx", rank, before=before, after=after, eval=model(probe))


def check_integers(jaxps):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rank = jaxps.rank()
    stats = {
        "mean": jnp.array([rank, rank + 1], jnp.float32),
        "count": jnp.int32(10 + rank),  # rank 0's: 10
        "flag": jnp.bool_(rank == 0),
    }
    eager = jaxps.sync_batch_stats(stats, name="ints")
    jitted = jax.jit(lambda s: jaxps.sync_batch_stats(s, name="ints_jit"))(
        stats
    )
    _assert_same(jitted, eager)
    for key in stats:
        assert eager[key].dtype == stats[key].dtype, key

    class Counted(nnx.Module):  # an integer BatchStat in an nnx Module
        def __init__(self):
            self.seen = nnx.BatchStat(jnp.int32(100 * rank + 7))
            self.mean = nnx.BatchStat(jnp.float32(rank))

    counted = Counted()
    jaxps.sync_batch_stats(counted, name="ints_nnx")
    assert counted.seen[...].dtype == jnp.int32 and counted.seen[...] == 7
    assert counted.mean[...] == 0.5
    _save("integers", rank, stats=eager)


def check_empty(jaxps):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rounds = dict(jaxps._src.state.runtime()._rounds)
    assert jaxps.sync_batch_stats({}) == {}
    assert jaxps.sync_batch_stats({"batch_stats": {}}) == {"batch_stats": {}}
    variables = {"params": {"w": jnp.ones(3)}}  # linen, no BatchNorm
    assert jaxps.sync_batch_stats(variables) is variables
    empty = {"mean": jnp.zeros((0, 3))}
    _assert_same(jax.jit(jaxps.sync_batch_stats)(empty), empty)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(jaxps.rank()))  # no BatchStat
    kernel = np.asarray(model.kernel[...])
    assert jaxps.sync_batch_stats(model) is None
    nnx.jit(lambda m: jaxps.sync_batch_stats(m))(model)
    np.testing.assert_array_equal(model.kernel[...], kernel)  # not averaged
    assert jaxps._src.state.runtime()._rounds == rounds, "a server call"


def check_bad_input(jaxps):
    import flax.linen as nn
    import jax.numpy as jnp

    cases = [
        ("abc", "got str, which is not an array"),
        (object(), "got object, which is not an array"),
        (nn.BatchNorm(), "A linen Module holds no variables"),
        (
            {"bn": {"mean": jnp.ones(2), "var": "1"}},
            "got str at ['bn']['var'], which is not an array",
        ),
    ]
    for tree, message in cases:
        try:
            jaxps.sync_batch_stats(tree)
        except TypeError as err:
            assert "sync_batch_stats takes" in str(err), str(err)
            assert message in str(err), str(err)
        else:
            raise AssertionError(f"no TypeError for {tree!r}")


def main(checks):
    import jaxps

    jaxps.init()
    try:
        for check in checks:
            try:
                globals()[f"check_{check}"](jaxps)
            except Exception:
                print(f"FAIL {check}\n{traceback.format_exc()}", flush=True)
            else:
                print(f"ok {check}", flush=True)
    finally:
        jaxps.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
