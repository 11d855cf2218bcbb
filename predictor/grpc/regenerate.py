"""Regenerate the gRPC modules from leadtime.proto: `python -m leadtime.predictor.grpc.regenerate`.

The generated modules are committed, so running the service needs grpcio and protobuf but not grpcio-tools.
Their import of `leadtime_pb2` is rewritten to an absolute one so they work inside `leadtime.predictor.grpc`, and each
file is marked `# ruff: noqa` (generated code is not linted).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    from grpc_tools import protoc

    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={HERE}",
            f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}",
            str(HERE / "leadtime.proto"),
        ]
    )
    if code != 0:
        return int(code)
    stub = HERE / "leadtime_pb2_grpc.py"
    text = re.sub(
        r"^import leadtime_pb2 as", "from leadtime.predictor.grpc import leadtime_pb2 as", stub.read_text(), flags=re.M
    )
    stub.write_text(text)
    for name in ("leadtime_pb2.py", "leadtime_pb2.pyi", "leadtime_pb2_grpc.py"):
        path = HERE / name
        path.write_text("# ruff: noqa\n" + path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
