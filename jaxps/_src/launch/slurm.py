"""SLURM: ``srun`` gives each task its rank and the number of tasks."""

from __future__ import annotations

from collections.abc import Mapping

from jaxps._src.launch import cluster


def detect(env: Mapping[str, str]) -> cluster.Detected | None:
    """``SLURM_PROCID`` and ``SLURM_NTASKS``."""
    return cluster.from_variables(env, "SLURM_PROCID", "SLURM_NTASKS")
