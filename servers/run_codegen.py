"""Runs protoc to generate the messages of ``jaxps.proto``.

Only the message classes (and their ``.pyi``) are generated: the service's
method handlers and the workers' stubs are built by hand, because the
messages that carry payloads are encoded by ``_codec``. Run from the
repository root after editing ``servers/jaxps.proto``::

    python servers/run_codegen.py
"""

import pathlib

from grpc_tools import protoc

_HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{_HERE}",
            f"--python_out={_HERE}",
            f"--pyi_out={_HERE}",
            str(_HERE / "jaxps.proto"),
        ]
    )
    if code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
