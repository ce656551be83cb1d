"""Kubernetes: a worker pod of an Indexed Job.

Each pod of an Indexed Job (``completionMode: Indexed``) gets its index in
``JOB_COMPLETION_INDEX``, which is its rank. The number of workers is the
job's ``completions``, which the pod does not see: the manifest sets
``JAXPS_NUM_WORKERS`` to it (`examples/kubernetes/`).
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxps._src.launch import cluster


def detect(env: Mapping[str, str]) -> cluster.Detected | None:
    """``JOB_COMPLETION_INDEX``; no size."""
    return cluster.from_variables(env, "JOB_COMPLETION_INDEX", None)
