"""broadcast between real workers: bits, roots, grad, empty leaves, flax nnx.

One module-wide job: a real ``jaxps-server`` and two worker processes that
run this file as a script (``python test_broadcast.py CHECK...``). Each
worker runs every check, prints ``ok CHECK`` or ``FAIL CHECK`` and the
traceback; each test below asserts one check on both ranks.
"""

import concurrent.futures
import sys
import traceback

import pytest

CHECKS = (
    "dtypes",
    "jit",
    "empty",
    "grad",
    "mismatched_roots",
    "mismatched_layouts",
    "nnx",
)

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def job(module_server, tmp_path_factory):
    """Every check's per-rank output: {check: [(ok, rank output)]}."""
    cwd = tmp_path_factory.mktemp("broadcast")
    # imported here, not at the top: this file also runs as a script
    from .test_push_pull import run_checks

    return run_checks(__file__, CHECKS, module_server.address, cwd, timeout=120)


def _assert_ok(job, check):
    from .test_push_pull import assert_check_ok

    assert_check_ok(job, check)


def test_every_dtype_arrives_bit_for_bit_from_root_1(job):
    _assert_ok(job, "dtypes")


def test_under_jit_bit_for_bit_and_repeatable(job):
    _assert_ok(job, "jit")


def test_empty_leaves_and_trees_make_no_server_call(job):
    _assert_ok(job, "empty")


def test_grad_is_the_sum_of_cotangents_on_root(job):
    _assert_ok(job, "grad")


def test_mismatched_roots_raise_naming_each_rank(job):
    _assert_ok(job, "mismatched_roots")


def test_mismatched_dtypes_and_shapes_raise_naming_both(job):
    _assert_ok(job, "mismatched_layouts")


def test_flax_nnx_state_with_rngs_and_optimizer(job):
    _assert_ok(job, "nnx")


# ---- the worker side: ``python test_broadcast.py CHECK...`` ----------------


def _values(rank):
    """A tree of every dtype whose bits differ per rank."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def view(bits, carrier, dtype):
        return jnp.asarray(np.array(bits, carrier).view(dtype))

    r = rank
    return {
        "f32": view(
            [0x80000000, 0x7FC01234 + r, 0x7F800001 + r, 0x3F800000 + r],
            np.uint32,
            np.float32,
        ),  # -0.0, quiet and signalling NaNs with payloads, 1.0 + r ulp
        "f64": view(
            [1 << 63, 0x7FF80000000ABCDE + r, 0xFFF0000000000001 + r],
            np.uint64,
            np.float64,
        ),
        "f16": view([0x8000, 0x7E01 + r, 0xFC01 + r], np.uint16, np.float16),
        "bf16": view([0x8000, 0x7FC1 + r], np.uint16, jnp.bfloat16),
        "f8": view([0x80, 0x7F, 0x01 + r], np.uint8, jnp.float8_e4m3fn),
        "c64": jnp.array([complex(-0.0, r), complex(np.nan, -0.0)]),
        "i8": jnp.array([-128, 127, -r], jnp.int8),
        "i16": jnp.array([-(2**15), 2**15 - 1, r], jnp.int16),
        "i32": jnp.array([-(2**31), 2**31 - 1, r], jnp.int32),
        "i64": jnp.array([-(2**63), 2**63 - 1, r], jnp.int64),
        "i4": jnp.array([-8, 7, r], jnp.int4),
        "u8": jnp.array([255, r, 0], jnp.uint8),
        "u16": jnp.array([2**16 - 1, r], jnp.uint16),
        "u32": jnp.array([2**32 - 1, r], jnp.uint32),
        "u64": jnp.array([2**64 - 1, r], jnp.uint64),
        "bool": jnp.array([r == 1, r != 1, True]),
        "scalar": jnp.float32(r + 0.5),
        "odd": jnp.arange(5, dtype=jnp.uint8) + r,  # 5 bytes: padding
        "key": jax.random.key(r),
        "keys": jax.random.split(jax.random.key(7 + r), (2, 3)),
        "rbg": jax.random.key(r, impl="rbg"),
        "raw_key": jax.random.PRNGKey(r),
        "matrix": jnp.full((3, 4), r - 0.25, jnp.bfloat16),
    }


def _assert_bitwise(actual, expected):
    import jax
    import numpy as np

    leaves, treedef = jax.tree_util.tree_flatten_with_path(actual)
    assert treedef == jax.tree.structure(expected), (treedef, expected)
    for (path, a), e in zip(leaves, jax.tree.leaves(expected)):
        where = jax.tree_util.keystr(path)
        assert a.dtype == e.dtype and a.shape == e.shape, (where, a, e)
        if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(e))
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        assert a.tobytes() == e.tobytes(), (where, a, e)


def check_dtypes(jaxps):
    out = jaxps.broadcast(_values(jaxps.rank()), root=1, name="dtypes")
    _assert_bitwise(out, _values(1))
    leaf = jaxps.broadcast(_values(jaxps.rank())["f32"], root=1, name="leaf")
    _assert_bitwise(leaf, _values(1)["f32"])


def check_jit(jaxps):
    import jax

    f = jax.jit(lambda t: jaxps.broadcast(t, root=0, name="jit"))
    for _ in range(2):  # the same compiled program, round after round
        _assert_bitwise(f(_values(jaxps.rank())), _values(0))


def check_empty(jaxps):
    import jax
    import jax.numpy as jnp
    import numpy as np

    # A server call would hang (rank 1 makes none) or, as the ranks pass
    # different roots, raise.
    rank = jaxps.rank()
    empty = {
        "a": jnp.zeros((0,), jnp.float32),
        "b": np.zeros((3, 0), np.int8),
        "c": None,
    }
    calls = [
        lambda: jaxps.broadcast({}, root=rank),
        lambda: jaxps.broadcast([], root=rank),
        lambda: jaxps.broadcast(empty, root=rank),
        lambda: jax.jit(lambda t: jaxps.broadcast(t, root=rank))(empty),
    ]
    if rank == 0:
        calls.append(lambda: jaxps.broadcast(empty, root=1, name="alone"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        outs = [pool.submit(call).result(timeout=15) for call in calls]
    assert outs[0] == {} and outs[1] == []
    for out in outs[2:]:
        assert out["c"] is None
        assert out["a"].shape == (0,) and out["a"].dtype == jnp.float32
        assert out["b"].shape == (3, 0) and out["b"].dtype == jnp.int8
    # mixed: the empty leaves come back as they were, the others from root
    mixed = {"e": jnp.zeros((2, 0), jnp.bfloat16), "x": _values(rank)["i32"]}
    out = jaxps.broadcast(mixed, root=1, name="mixed")
    _assert_bitwise(out, {"e": mixed["e"], "x": _values(1)["i32"]})


def check_grad(jaxps):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rank, size = jaxps.rank(), jaxps.size()

    def weights(r):
        return jnp.arange(4.0) + 10.0 * r

    def loss(tree):
        out = jaxps.broadcast(tree, root=1, name="grad")
        return jnp.sum(out["w"] * weights(rank)) + jnp.sum(out["h"] ** 2)

    tree = {
        "w": jnp.full(4, rank, jnp.float32),
        "h": jnp.full(2, 3.0 + rank, jnp.float16),
        "n": jnp.int32(rank),
        "key": jax.random.key(rank),
    }
    # d/dw_root of sum_r <w_root, weights(r)> is sum_r weights(r), and
    # d/dh_root of sum_r |h_root|^2 is 2 * size * h_root: on root only
    w = sum(weights(r) for r in range(size)) if rank == 1 else jnp.zeros(4)
    h = np.full(2, 2 * size * 4.0 if rank == 1 else 0.0, np.float16)
    eager = jax.grad(loss, allow_int=True)
    # under jit too, the non-root still pushes the cotangents it discards
    for grad in (eager, jax.jit(eager)):
        g = grad(tree)
        np.testing.assert_array_equal(g["w"], w)
        np.testing.assert_array_equal(g["h"], h)
        assert g["w"].dtype == jnp.float32 and g["h"].dtype == jnp.float16
        assert g["n"].dtype == g["key"].dtype == jax.dtypes.float0
    # the forward value is root's: w = 1, h = 4
    assert float(loss(tree)) == float(jnp.sum(weights(rank))) + 2 * 16.0


def check_mismatched_roots(jaxps):
    import jax
    import jax.numpy as jnp

    rank = jaxps.rank()
    want = "broadcast 'roots': ranks passed different roots: rank 0 root=0, "
    want += "rank 1 root=1"
    tree = {"x": jnp.arange(3) + rank}
    try:
        jaxps.broadcast(tree, root=rank, name="roots")
    except jaxps.errors.JaxpsError as err:
        assert want in str(err), str(err)
    else:
        raise AssertionError("eager broadcast with mismatched roots returned")
    f = jax.jit(lambda t: jaxps.broadcast(t, root=rank, name="roots"))
    try:
        jax.block_until_ready(f(tree))
    except jax.errors.JaxRuntimeError as err:
        assert want in str(err) and "JaxpsError" in str(err), str(err)
        # the runtime error leads back to the callback's own error
        assert type(jaxps.errors.original(err)) is jaxps.errors.JaxpsError
    else:
        raise AssertionError("jitted broadcast with mismatched roots returned")
    # Under jaxps.errors.typed the jitted error is caught by its own type,
    # chained to JAX's runtime error.
    try:
        with jaxps.errors.typed():
            jax.block_until_ready(f(tree))
    except jaxps.errors.JaxpsError as err:
        assert want in str(err), str(err)
        assert isinstance(err.__cause__, jax.errors.JaxRuntimeError)
    else:
        raise AssertionError("jitted broadcast with mismatched roots returned")
    step = jaxps.errors.typed()(f)  # as a decorator
    try:
        jax.block_until_ready(step(tree))
    except jaxps.errors.JaxpsError as err:
        assert want in str(err), str(err)
    else:
        raise AssertionError("jitted broadcast with mismatched roots returned")
    # the job goes on: the next broadcast agrees again
    _assert_bitwise(jaxps.broadcast(tree, name="roots"), {"x": jnp.arange(3)})


def check_mismatched_layouts(jaxps):
    """Same bytes, different dtypes or shapes: never root's bits read as
    another dtype, but MismatchError naming both ranks' leaves."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    rank = jaxps.rank()
    cases = {
        "dtype": (np.arange(4, dtype=np.int32), np.ones(4, np.float32)),
        "shape": (np.ones((2, 2), np.float32), np.ones(4, np.float32)),
    }
    for what, (first, second) in cases.items():
        mine = first if rank == 0 else second
        eager = functools.partial(jaxps.broadcast, name=f"eager-{what}")
        jitted = jax.jit(functools.partial(jaxps.broadcast, name=f"jit-{what}"))
        for run in (eager, jitted):  # (a mismatched call's name is spent)
            try:
                with jaxps.errors.typed():
                    jax.block_until_ready(run({"x": mine}))
            except jaxps.errors.MismatchError as err:
                for leaf in (first, second):
                    described = f"{leaf.dtype}{leaf.shape}"
                    assert described in str(err), (what, str(err))
            else:
                raise AssertionError(f"broadcast of different {what}s returned")
    # the job goes on
    _assert_bitwise(jaxps.broadcast({"x": jnp.arange(3)}), {"x": jnp.arange(3)})


def check_nnx(jaxps):
    import jax
    import optax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.bn = nnx.BatchNorm(2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.rngs = rngs

    def make(r):
        model = Net(nnx.Rngs(params=r, dropout=100 + r))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return model, opt

    model, opt = make(jaxps.rank())
    reference, reference_opt = make(1)
    nnx.update(model, jaxps.broadcast(nnx.state(model), root=1, name="m"))
    nnx.update(opt, jaxps.broadcast(nnx.state(opt), root=1, name="opt"))
    _assert_bitwise(nnx.state(model), nnx.state(reference))
    _assert_bitwise(nnx.state(opt), nnx.state(reference_opt))
    # the broadcast RNG streams go on identically
    _assert_bitwise(model.rngs.dropout(), reference.rngs.dropout())
    # and optax states straight from init
    state = optax.adam(1e-3).init(nnx.state(model, nnx.Param))
    out = jaxps.broadcast(state, root=1, name="optax")
    _assert_bitwise(out, state)
    assert jax.tree.structure(out) == jax.tree.structure(state)


def main(checks):
    import jax

    jax.config.update("jax_enable_x64", True)  # for the 64-bit dtypes
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
