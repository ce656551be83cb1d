"""Collective semantics of the runtime against real servers (issue 13).

The mode (sync/async) travels with each call.
"""

import numpy as np
import pytest

from jaxps import errors


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
