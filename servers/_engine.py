"""Where a push is summed: on the event loop, or on its key's engine thread.

Each engine is one thread (a single-thread executor); a key is pinned to
one (`_store.Keys`), so a key's pushes are summed one at a time and in
order while different keys are summed in parallel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from ._store import PushPullStore, Ticket

#: Pushes of at most this many bytes are always summed on the event loop.
INLINE_SUM_BYTES = 256 * 1024


class Engines:
    """Runs tickets on `threads` engine threads (shared by all stores).

    Small pushes, and any push while its engine has nothing queued (a lone
    chunk waits for it), are summed on the event loop: cheaper than the hop
    to the engine thread and back. A key's pushes stay in order, since they
    all have one size.
    """

    def __init__(self, threads: int):
        n = max(1, threads)
        # tickets handed to each engine and not completed yet
        self._jobs = [0] * n
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"jaxps-engine-{i}"
            )
            for i in range(n)
        ]

    def queued(self, engine: int) -> int:
        """Tickets handed to `engine` and not completed yet."""
        return self._jobs[engine]

    async def sum(self, ticket: Ticket, store: PushPullStore) -> None:
        """Sums `ticket`, then completes it (``store.finish_push``).

        Returns once it is summed if the store acknowledges pushes after
        their sum (raising what the sum raised), else once it is scheduled:
        the payload stays valid (the request's bytes, or a slot lent until
        the pull), and a failed sum fails its round.
        """
        engine = ticket.engine
        if ticket.data.nbytes <= INLINE_SUM_BYTES or self._jobs[engine] == 0:
            try:
                ticket.run()
            except Exception as err:
                store.finish_push(ticket, err)
            else:
                store.finish_push(ticket)
            return
        self._jobs[engine] += 1
        summed = asyncio.get_running_loop().run_in_executor(
            self._threads[engine], ticket.run
        )
        if not store.acks_after_sum:
            summed.add_done_callback(
                functools.partial(self._summed, ticket, store)
            )
            return
        error = None
        try:
            await summed
        except Exception as err:
            error = err
        finally:
            self._jobs[engine] -= 1
        store.finish_push(ticket, error)

    def _summed(self, ticket: Ticket, store: PushPullStore, future) -> None:
        self._jobs[ticket.engine] -= 1
        if not future.cancelled():  # cancelled: the server is stopping
            store.finish_push(ticket, future.exception())

    def close(self) -> None:
        """Stops the engine threads; queued sums are dropped."""
        for thread in self._threads:
            thread.shutdown(wait=False, cancel_futures=True)
