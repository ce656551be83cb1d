"""``python -m jaxps.servers`` runs ``jaxps-server``."""

import sys

from ._cli import main

sys.exit(main())
