"""``python -m jaxps._src.launch``: the ``jaxps-launch`` command."""

import sys

from jaxps._src.launch import main

sys.exit(main())
