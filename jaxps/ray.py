"""jaxps on Ray: servers as CPU actors, workers as actors in a placement
group (see ``jaxps/_src/launch/ray.py``; ``pip install "jaxps[ray]"``).

>>> import jaxps.ray  # doctest: +SKIP
>>> jaxps.ray.run(train, num_workers=2, num_servers=2)  # doctest: +SKIP
"""

from jaxps._src.launch.ray import RaySettings as RaySettings
from jaxps._src.launch.ray import run as run

__all__ = ["RaySettings", "run"]
