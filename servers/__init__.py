"""The jaxps summation server (``jaxps.servers``).

Servers only sum: each sums the chunks pushed by all workers for a (key, round)
and answers every worker's pull with the sum. Run one with the ``jaxps-server``
command, or in-process with `serve`.
"""

from ._cli import main as main
from ._server import ServerOptions as ServerOptions
from ._server import create_server as create_server
from ._server import serve as serve
from ._store import Store as Store
from ._store import StoreError as StoreError

__all__ = [
    "ServerOptions",
    "Store",
    "StoreError",
    "create_server",
    "main",
    "serve",
]
