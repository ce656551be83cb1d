"""Launchers and cluster detection: one module for each way a job starts.

- `local`: ``jaxps-launch --workers N --servers K`` on one machine, and
  with ``--hostfile`` over ssh (`hostfile`); `process` runs the children.
- `ray`: ``jaxps-launch --ray``, and `jaxps.ray.run` (needs ``ray``).
- `cluster`: the rank and size of a worker that a scheduler started
  (SLURM, Open MPI and MPICH, a Kubernetes Indexed Job, `jax.distributed`),
  which `jaxps.Config` asks when ``JAXPS_*`` do not say.

Nothing here imports JAX or the server at import time.
"""


def main(argv=None) -> int:
    """The ``jaxps-launch`` command (see `local`)."""
    from jaxps._src.launch import local

    return local.main(argv)
