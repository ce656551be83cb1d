"""Runs protoc with the gRPC plugin to generate messages and gRPC stubs.

Run from the repository root after editing ``servers/jaxps.proto``::

    python servers/run_codegen.py
"""

import pathlib
import re

from grpc_tools import protoc

_HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{_HERE}",
            f"--python_out={_HERE}",
            f"--pyi_out={_HERE}",
            f"--grpc_python_out={_HERE}",
            str(_HERE / "jaxps.proto"),
        ]
    )
    if code != 0:
        raise SystemExit(code)
    # Generated stubs import siblings absolutely; make it package-relative.
    grpc_file = _HERE / "jaxps_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(
        r"^import jaxps_pb2 as", "from . import jaxps_pb2 as", text, flags=re.M
    )
    grpc_file.write_text(text)


if __name__ == "__main__":
    main()
