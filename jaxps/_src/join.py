"""`jaxps.join`: uneven data across ranks (horovod's ``hvd.join``)."""

from __future__ import annotations

from jaxps._src import state


def join(timeout: float | None = None) -> int:
    """Stops this rank's pushes until every rank has joined.

    A rank that runs out of data calls `join` instead of its next step. From
    then on the servers complete each round once the ranks that have not
    joined pushed it (a push this rank made before joining still counts), and
    an averaging push_pull divides by the number of ranks that contributed
    instead of `jaxps.size()`; a sum (``average=False``) is over those ranks.
    `join` first waits for this rank's push_pulls in flight, and returns once
    every rank has joined; then every rank starts again as in a fresh epoch
    (all ranks contribute, rounds from 0).

    Until `join` returns, push_pull on this rank raises `JaxpsError`. Works
    with synchronous servers only.

    Example::

      for batch in my_shard_of_the_data:  # ranks may have different lengths
        params, opt_state = step(params, opt_state, batch)
      last = jaxps.join()

    Args:
      timeout: seconds to wait for the other ranks (default: the ``timeout``
        setting of `jaxps.init`).

    Returns:
      The rank that joined last (the same on every rank; with one worker, 0).

    Raises:
      jaxps.errors.RoundTimeoutError: the other ranks did not all join within
        `timeout`; the message names those that did not. This rank stays
        joined: call `join` again to go on waiting.
    """
    return state.runtime().join(timeout)
