"""Elastic workers: training that goes on when workers leave or join.

`run` wraps a training function of a `State`. The workers agree on their
membership through the job's first server (see ``servers/_rendezvous.py``),
one *generation* at a time, and every generation is a new `jaxps.init`: a
new job incarnation on every server, so rounds of an old membership can
never mix into the new one's sums. Then:

- a lost worker makes the survivors' rounds time out (`RoundTimeoutError`,
  after ``timeout``); they roll back to the last `State.commit`, agree on
  the new membership (the survivors, after ``settle`` seconds of quiet) and
  call the function again, with averages over the new number of workers;
- a new worker waits at the rendezvous; at the next commit rank 0 sees it
  and tells the others in a one-element push_pull, so that every worker
  decides the same; all of them then re-form with it;
- each new generation starts with the state of its rank 0 (the lowest
  surviving rank), broadcast bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import time
import typing as tp

import numpy as np

from jaxps._src import errors, jit_errors, state
from jaxps._src.config import Config
from jaxps._src.transport.client import ServerClient, channel_credentials
from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

log = logging.getLogger("jaxps.elastic")

_PROBE = "jaxps.elastic.probe"
_STATE = "jaxps.elastic.state"


class _MembershipChanged(Exception):
    """Raised by `State.commit` when workers wait to join."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} worker(s) wait to join")
        self.waiting = waiting


def _copy(value):
    return value.copy() if isinstance(value, np.ndarray) else value


class State:
    """Training state that `run` rolls back and hands to joining workers.

    Fields are pytrees of arrays (jax arrays are kept by reference: they
    are immutable; numpy arrays are copied at commit) and Python scalars,
    given as keyword arguments and read and set as attributes::

      state = jaxps.elastic.State(params=params, opt_state=opt_state, step=0)

    Every worker must make the same fields, with the same structure.
    """

    def __init__(self, **fields: tp.Any):
        if not fields:
            raise TypeError("jaxps.elastic.State needs at least one field.")
        object.__setattr__(self, "_fields", dict(fields))
        object.__setattr__(self, "_membership", None)
        self._snapshot()

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_fields"][name]
        except KeyError:
            raise AttributeError(
                f"jaxps.elastic.State has no field {name!r}; its fields: "
                f"{sorted(self.__dict__['_fields'])}."
            ) from None

    def __setattr__(self, name: str, value) -> None:
        if name not in self._fields:
            raise AttributeError(
                f"jaxps.elastic.State has no field {name!r}; its fields: "
                f"{sorted(self._fields)} (fields are fixed at construction)."
            )
        self._fields[name] = value

    def __repr__(self) -> str:
        return f"jaxps.elastic.State({', '.join(sorted(self._fields))})"

    def _snapshot(self) -> None:
        import jax

        object.__setattr__(
            self, "_committed", jax.tree.map(_copy, dict(self._fields))
        )

    def commit(self) -> None:
        """Saves the state as the one to roll back to; under `run`, also
        the step boundary where waiting workers join (then it raises an
        internal exception that `run` handles: do not catch it)."""
        self._snapshot()
        if self._membership is not None:
            waiting = self._membership.waiting()
            if waiting:
                raise _MembershipChanged(waiting)

    def restore(self) -> None:
        """Goes back to the state of the last commit."""
        import jax

        self._fields.clear()
        self._fields.update(jax.tree.map(_copy, self._committed))

    def sync(self, root: int = 0) -> None:
        """Makes every worker's state `root`'s, bit for bit (and commits
        it). Python scalars keep their type."""
        import jax

        from jaxps.ops import broadcast

        leaves, treedef = jax.tree.flatten(dict(self._fields))
        scalar = [isinstance(x, (bool, int, float)) for x in leaves]
        scalars = [i for i, s in enumerate(scalar) if s]
        arrays = [i for i, s in enumerate(scalar) if not s]
        out = list(leaves)
        if arrays:
            got = broadcast([leaves[i] for i in arrays], root, name=_STATE)
            for i, x in zip(arrays, got):
                out[i] = (
                    np.asarray(x) if isinstance(leaves[i], np.ndarray) else x
                )
        if scalars:
            bits = np.array(
                [_scalar_bits(leaves[i]) for i in scalars], np.int64
            )
            if state.rank() != root:
                bits[:] = 0
            summed = state.push_pull_numpy(
                _STATE + ".scalars", bits, average=False
            )
            for i, b in zip(scalars, summed):
                out[i] = _from_bits(type(leaves[i]), int(b))
        self._fields.clear()
        self._fields.update(jax.tree.unflatten(treedef, out))
        self._snapshot()


def _scalar_bits(x) -> int:
    if isinstance(x, float):
        return int(np.array(x, np.float64).view(np.int64))
    try:
        return int(np.int64(x))
    except OverflowError:
        raise TypeError(
            f"jaxps.elastic.State holds the Python int {x}, which does not "
            "fit in 64 bits."
        ) from None


def _from_bits(kind, bits: int):
    if kind is float:
        return float(np.array(bits, np.int64).view(np.float64))
    return kind(bits)


class _Membership:
    """This worker's side of the rendezvous on the job's first server."""

    def __init__(self, config: Config, settle: float, join_timeout: float):
        every = config.servers + config.colocated_servers
        if not every:
            raise errors.ConfigError(
                "jaxps.elastic.run needs summation servers (the first one "
                "holds the membership): pass servers= or set JAXPS_SERVERS."
            )
        self.config = config
        self.settle = settle
        self.join_timeout = join_timeout
        self.member = secrets.token_hex(8)
        self.generation = 0
        #: this worker's rank: the launcher's, then that of its generation
        #: (orders it among newcomers if the server lost the membership)
        self.rank = config.worker_rank
        self.client = ServerClient(
            every[0],
            max_message_bytes=_wire.MESSAGE_OVERHEAD,
            timeout=config.timeout,
            token=config.token,
            credentials=channel_credentials(config),
        )

    def close(self) -> None:
        self.client.close()

    def arrive(self, expected: int) -> tuple[int, list[str]]:
        """Waits for the next generation; returns it and its members."""
        newcomer = self.generation == 0
        # Survivors of a lost worker reach here up to a round timeout apart.
        timeout = (
            self.join_timeout
            if newcomer
            else (self.config.timeout + self.settle + 5.0)
        )
        reply = self.client.rendezvous(
            pb.RendezvousRequest(
                job_id=self.config.job_id,
                member=self.member,
                generation=self.generation,
                expected=expected,
                settle=self.settle,
                hint=self.rank,
            ),
            timeout,
        )
        self.generation = reply.generation
        return reply.generation, list(reply.members)

    def waiting(self) -> int:
        """How many workers wait to join, the same answer on every rank:
        rank 0 asks the server and shares it in a one-element push_pull."""
        count = 0
        if state.rank() == 0:
            reply = self.client.rendezvous(
                pb.RendezvousRequest(job_id=self.config.job_id, probe=True),
                self.config.timeout,
            )
            count = reply.waiting
        if state.size() == 1:
            return count
        got = state.push_pull_numpy(
            _PROBE, np.array([count], np.int32), average=False
        )
        return int(got[0])


def _lost_worker(err: BaseException) -> errors.RoundTimeoutError | None:
    """The round timeout behind `err` (a lost worker), if it is one."""
    for e in (err, jit_errors.original(err)):
        if isinstance(e, errors.RoundTimeoutError):
            return e
    return None


def _quiesce() -> None:
    """Waits for the JAX computations in flight, so that no callback of
    the old generation runs against the new one's runtime."""
    import jax

    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failed step's own error
        pass


def run(
    func: tp.Callable | None = None,
    *,
    settle: float = 2.0,
    join_timeout: float = 600.0,
    min_workers: int = 1,
):
    """Runs ``func(state, *args, **kwargs)`` through worker loss and joins.

    Decorate the training function and call it with a `State`::

      @jaxps.elastic.run
      def train(state):
          while state.step < steps:
              ...  # one step, with jaxps.DistributedOptimizer
              state.step += 1
              state.commit()

    `run` initializes jaxps itself, from the settings of an earlier
    `jaxps.init` or else from the ``JAXPS_*`` variables, for each
    membership generation: `jaxps.rank()` and `jaxps.size()` change between
    calls of `func`, so read them inside it. After a lost worker (a round
    timed out) the state is rolled back to the last commit; `func` is
    called again with the state of the new rank 0. Other errors propagate.
    It needs synchronous servers.

    Args:
      func: the training function; its first argument is the `State`.
      settle: seconds without a new arrival after which the survivors of a
        lost worker close the new membership.
      join_timeout: seconds a new worker waits to be let in.
      min_workers: fewer workers than this end the run with an error.

    Returns:
      The wrapped function, which returns what `func` returns.
    """
    if func is None:
        return functools.partial(
            run,
            settle=settle,
            join_timeout=join_timeout,
            min_workers=min_workers,
        )
    for name, value in (("settle", settle), ("join_timeout", join_timeout)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0 <= value < float("inf"):
            raise errors.ConfigError(
                f"{name} must be a finite number of seconds >= 0, got "
                f"{value!r}."
            )

    @functools.wraps(func)
    def wrapper(train_state: State, *args, **kwargs):
        if not isinstance(train_state, State):
            raise TypeError(
                "a function wrapped by jaxps.elastic.run takes a "
                f"jaxps.elastic.State first, got {type(train_state).__name__}."
            )
        if state.is_initialized():
            base = state.runtime().config
            state.shutdown()
        else:
            base = Config.from_env()
        membership = _Membership(base, settle, join_timeout)
        expected = base.num_workers
        try:
            while True:
                began = time.monotonic()
                generation, members = membership.arrive(expected)
                size = len(members)
                if size < min_workers:
                    raise errors.JaxpsError(
                        f"elastic job {base.job_id!r} generation {generation} "
                        f"has {size} worker(s), fewer than min_workers="
                        f"{min_workers}."
                    )
                config = dataclasses.replace(
                    base,
                    num_workers=size,
                    worker_rank=members.index(membership.member),
                    generation=generation,
                )
                membership.rank = config.worker_rank
                state.init(config)
                object.__setattr__(train_state, "_membership", membership)
                try:
                    train_state.sync(0)
                    log.info(
                        "generation %d: rank %d of %d (agreed in %.2f s)",
                        generation,
                        config.worker_rank,
                        size,
                        time.monotonic() - began,
                    )
                    return func(train_state, *args, **kwargs)
                except _MembershipChanged as change:
                    expected = size + change.waiting
                    log.info("%d worker(s) join", change.waiting)
                except Exception as err:  # noqa: BLE001 - re-raised below
                    lost = _lost_worker(err)
                    if lost is None:
                        raise
                    log.warning("a worker was lost, rolling back: %s", lost)
                    expected = size
                finally:
                    object.__setattr__(train_state, "_membership", None)
                _quiesce()
                train_state.restore()
                state.shutdown()
        finally:
            membership.close()

    return wrapper
