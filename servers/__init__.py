"""The jaxps summation server (``jaxps.servers``).

Servers only sum: each sums the chunks pushed by all workers for a (key, round)
and answers every worker's pull with the sum. Run one with the ``jaxps-server``
command, or in-process with `serve`.

The public names are loaded on first use, so that the workers, which import
only the wire contract (`_wire`, `_codec`, `jaxps_pb2`), never load the
server.
"""

import importlib

_EXPORTS = {
    "ServerOptions": "._server",
    "Store": "._store",
    "StoreError": "._store",
    "create_server": "._server",
    "main": "._cli",
    "serve": "._server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
