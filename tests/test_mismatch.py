"""Ranks that push_pull different trees under one name are told at once.

Each rank's call carries a call check (a hash of its names, shapes and
dtypes) to a server chosen from the call's name alone; the server fails
the call on every rank with both ranks' trees, instead of every rank
waiting for the timeout on keys the other never pushes. (A tree of one
leaf against one of several is not caught: a call of one leaf keeps its
path in its call name, see `plan.call_name`; it times out as before.)
"""

import pathlib
import re
import sys
import textwrap

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent / "ops"))
from test_push_pull import start_ranks  # noqa: E402

WORKER = textwrap.dedent(
    """
    import time
    import jax.numpy as jnp
    import numpy as np
    import jaxps
    from jaxps import errors

    jaxps.init()
    r = jaxps.rank()
    CASES = {
        "shape": {"w": jnp.ones((3, 4 + r), jnp.float32)},
        "dtype": {"w": jnp.ones((3, 4), [jnp.float32, jnp.bfloat16][r])},
        "structure": (
            {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}
            if r == 0
            else {"w": jnp.ones((3, 4)), "b": jnp.ones(4), "c": jnp.ones(2)}
        ),
        # under jit small leaves cross fused: of one size on both ranks
        "transposed": {"a": jnp.ones([(2, 3), (3, 2)][r]), "b": jnp.ones(4)},
    }
    # a matching call first: the check passes, and keys are warm
    out = jaxps.push_pull({"w": jnp.full(3, r + 1.0)}, name="fine")
    np.testing.assert_allclose(out["w"], 1.5)
    for case, tree in CASES.items():
        began = time.monotonic()
        try:
            jax_out = jaxps.push_pull(tree, name=case)
            print("NOERROR", case, flush=True)
        except Exception as err:  # noqa: BLE001 - the test reads the text
            text = str(err).replace(chr(10), " ")
            print(
                "CASE", case, round(time.monotonic() - began, 3),
                type(err).__name__, text, flush=True,
            )
    # under jit, caught by its own type (jaxps.errors.typed)
    import jax
    from jaxps.ops import _host
    CASES["crossing"] = {"a": jnp.ones(3), "b": jnp.ones(4)}
    for case in ("shape", "transposed", "crossing"):
        if case == "crossing" and r == 1:  # fuses as a GPU rank would not
            _host.CPU_FUSE_BYTES = 0
        step = jax.jit(lambda t: jaxps.push_pull(t, name="jitted" + case))
        began = time.monotonic()
        try:
            with errors.typed():
                jax.block_until_ready(step(CASES[case]))
            print("NOERROR jitted", case, flush=True)
        except errors.MismatchError as err:
            text = str(err).replace(chr(10), " ")
            print(
                "JITTED", case, round(time.monotonic() - began, 3), text,
                flush=True,
            )
    # a matching numpy call after the mismatches still works
    x = jaxps.push_pull_numpy("after", np.full(5, r, np.float32))
    np.testing.assert_allclose(x, 0.5)
    print("DONE", flush=True)
    """
)

EXPECTED = {
    "shape": ("['w'] float32[3, 4]", "['w'] float32[3, 5]"),
    "dtype": ("['w'] float32[3, 4]", "['w'] bfloat16[3, 4]"),
    "structure": (
        "['b'] float32[4], ['w'] float32[3, 4]",
        "['b'] float32[4], ['c'] float32[2], ['w'] float32[3, 4]",
    ),
    "transposed": (
        "['a'] float32[2, 3], ['b'] float32[4]",
        "['a'] float32[3, 2], ['b'] float32[4]",
    ),
}


def _pushed(text):
    """Each rank's tree, as a mismatch names it."""
    return dict(re.findall(r"rank (\d) pushed \[(.*?)\](?: but|;)", text))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_mismatch_is_named_at_once(
    start_servers, tmp_path, monkeypatch, transport
):
    servers = start_servers(2, 2)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    monkeypatch.setenv("JAXPS_TRANSPORT", transport)
    results = start_ranks(
        script,
        [],
        [s.address for s in servers],
        2,
        tmp_path,
        timeout=100,
        jaxps_timeout=30,  # a timeout would take 30 s, far past the bound
    )
    for rank, (code, out) in enumerate(results):
        assert code == 0 and "DONE" in out, f"rank {rank}:\n{out}"
        assert "NOERROR" not in out, out
        cases = {}
        for line in out.splitlines():
            if line.startswith("CASE "):
                _, case, seconds, kind, text = line.split(" ", 4)
                cases[case] = (float(seconds), kind, text)
        assert set(cases) == set(EXPECTED), out
        jitted = [x for x in out.splitlines() if x.startswith("JITTED ")]
        assert len(jitted) == 3, out
        for line in jitted:
            _, case, seconds, text = line.split(" ", 3)
            assert float(seconds) < 2.0, line  # with compilation
            if case == "crossing":  # the same tree, crossing otherwise
                tree = "['a'] float32[3], ['b'] float32[4]"
                mine, theirs = f"{tree} (fused leaves 0,1)", tree
            else:
                mine, theirs = EXPECTED[case]
            if case == "transposed":  # its two small leaves cross fused
                mine, theirs = (
                    f"{t} (fused leaves 0,1)" for t in (mine, theirs)
                )
            assert _pushed(text) == {"0": mine, "1": theirs}, text
        for case, (seconds, kind, text) in cases.items():
            assert seconds < 2.0, (case, seconds, text)
            assert kind == "MismatchError", (case, kind, text)
            assert "push_pull mismatch" in text, text
            mine, theirs = EXPECTED[case]
            assert _pushed(text) == {"0": mine, "1": theirs}, text
