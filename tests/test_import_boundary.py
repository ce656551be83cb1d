"""The worker side imports only the wire contract of ``jaxps.servers``."""

import subprocess
import sys

SERVER_ONLY = (
    "jaxps.servers._service",
    "jaxps.servers._summation",
    "jaxps.servers._data",
    "jaxps.servers._engine",
    "jaxps.servers._round",
    "jaxps.servers._kernels",
    "jaxps.servers._store",
    "jaxps.servers._async_store",
    "jaxps.servers._metrics",
    "jaxps.servers._cli",
    "jaxps.servers._server",
    "grpc_health.v1",  # grpc itself imports the bare grpc_health package
)


def _loaded_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return set(out.split())


def test_runtime_does_not_load_the_server():
    loaded = _loaded_after("import jaxps._src.runtime")
    leaked = sorted(
        m for m in loaded if any(m.startswith(s) for s in SERVER_ONLY)
    )
    assert not leaked, f"the worker runtime loads server modules: {leaked}"


def test_launcher_does_not_load_the_server():
    loaded = _loaded_after("import jaxps._src.launch")
    leaked = sorted(
        m for m in loaded if any(m.startswith(s) for s in SERVER_ONLY)
    )
    assert not leaked, f"the launcher loads server modules: {leaked}"


def test_server_exports_still_import():
    loaded = _loaded_after(
        "from jaxps.servers import ServerOptions, Store, StoreError, main"
    )
    assert "jaxps.servers._server" in loaded


def test_server_starts_without_ml_dtypes():
    # ml_dtypes (bfloat16) takes about a second to import; a server loads it
    # only when a bfloat16 push arrives, so every server start is that much
    # faster (tests/servers/test_sum.py and test_runtime.py sum bfloat16).
    loaded = _loaded_after("import jaxps.servers._cli")
    assert "ml_dtypes" not in loaded
    loaded = _loaded_after(
        "from jaxps.servers import _wire; _wire.code_dtype(_wire.pb.BFLOAT16)"
    )
    assert "ml_dtypes" in loaded
