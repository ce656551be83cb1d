"""The rank and size of a worker that a scheduler started.

`jaxps.Config` asks `detect` for ``worker_rank`` and ``num_workers`` that
neither an argument nor ``JAXPS_*`` sets. Each scheduler is a module of
this package, tried in this order; the first that knows the rank gives
both (a size it does not know stays the default, 1):

- `slurm`: ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``);
- `mpi`: ``mpirun`` of Open MPI (``OMPI_COMM_WORLD_RANK``, ``_SIZE``) or
  of MPICH and other PMI launchers (``PMI_RANK``, ``PMI_SIZE``);
- `kubernetes`: an Indexed Job (``JOB_COMPLETION_INDEX``; the size is the
  job's ``completions``, which only the manifest knows: set
  ``JAXPS_NUM_WORKERS`` there);
- `jax.distributed`, once initialized (``jax.process_index()``,
  ``jax.process_count()``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import NamedTuple

from jaxps._src import errors


class Detected(NamedTuple):
    """A worker's rank and size, and where they came from.

    Attributes:
      rank: the worker's rank.
      size: the number of workers, or None if the source does not say.
      source: the variables (or API) read, for messages.
    """

    rank: int
    size: int | None
    source: str


def read_int(env: Mapping[str, str], var: str) -> int | None:
    """``env[var]`` as an int (None if unset); a clear error if not one."""
    if var not in env:
        return None
    try:
        return int(env[var])
    except ValueError:
        raise errors.ConfigError(
            f"{var} must be an integer. Got {var}={env[var]!r}."
        ) from None


def from_variables(
    env: Mapping[str, str], rank_var: str, size_var: str | None
) -> Detected | None:
    """The rank from `rank_var` and the size from `size_var`, if set."""
    size = None if size_var is None else read_int(env, size_var)
    rank = read_int(env, rank_var)
    if rank is None:
        return None
    source = rank_var if size_var is None else f"{rank_var}/{size_var}"
    return Detected(rank, size, source)


def _jax_distributed() -> Detected | None:
    jax = sys.modules.get("jax")  # only if the program already uses JAX
    if jax is None or not jax.distributed.is_initialized():
        return None
    return Detected(jax.process_index(), jax.process_count(), "jax.distributed")


def detect(env: Mapping[str, str]) -> Detected | None:
    """The first scheduler's rank and size (see the module docstring)."""
    from jaxps._src.launch import kubernetes, mpi, slurm

    for source in (slurm, mpi, kubernetes):
        found = source.detect(env)
        if found is not None:
            return found
    return _jax_distributed()
