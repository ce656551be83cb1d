"""Every public name imports and is documented (as optax checks its own)."""

import importlib

import pytest


@pytest.mark.parametrize(
    "module", ["jaxps", "jaxps.ops", "jaxps.servers", "jaxps.errors"]
)
def test_public_names_import_and_have_docstrings(module):
    mod = importlib.import_module(module)
    assert mod.__doc__, module
    for name in mod.__all__:
        value = getattr(mod, name)
        doc = getattr(value, "__doc__", None)
        assert doc and doc.strip(), f"{module}.{name} has no docstring"


def test_servers_do_not_import_jax():
    import subprocess
    import sys

    code = (
        "import sys, jaxps.servers, jaxps._src.launch; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
