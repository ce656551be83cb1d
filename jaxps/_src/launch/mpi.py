"""MPI: ``mpirun -np N python train.py``, the servers started separately.

Open MPI gives each process ``OMPI_COMM_WORLD_RANK`` and
``OMPI_COMM_WORLD_SIZE``; MPICH's Hydra and other PMI launchers give
``PMI_RANK`` and ``PMI_SIZE``. jaxps needs no MPI library: only the rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxps._src.launch import cluster


def detect(env: Mapping[str, str]) -> cluster.Detected | None:
    """Open MPI's variables, else PMI's."""
    return cluster.from_variables(
        env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    ) or cluster.from_variables(env, "PMI_RANK", "PMI_SIZE")
