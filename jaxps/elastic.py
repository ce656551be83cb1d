"""Elastic workers: training that goes on when workers leave or join.

Wrap the training function with `run` and keep what it must not lose in a
`State` that it commits at step boundaries (see ``jaxps/_src/elastic.py``
for how the membership is agreed).
"""

from jaxps._src.elastic import State as State
from jaxps._src.elastic import run as run

__all__ = ["State", "run"]
