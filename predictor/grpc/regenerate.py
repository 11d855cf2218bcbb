"""Regenerate the gRPC modules from leadtime.proto: `python -m leadtime.predictor.grpc.regenerate [DIR]`.

The generated modules are committed, so running the service needs grpcio and protobuf but not grpcio-tools (it
comes with the test extra, whose pinned version gives the committed files byte for byte: a test holds that).
Their import of `leadtime_pb2` is rewritten to an absolute one so they work inside `leadtime.predictor.grpc`,
and each file is marked `# ruff: noqa` (generated code is not linted). DIR (default: beside the proto) is where
they are written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = ("leadtime_pb2.py", "leadtime_pb2.pyi", "leadtime_pb2_grpc.py")


def generate(out: Path = HERE) -> None:
    """Write the generated modules into `out`; RuntimeError if protoc fails, ImportError without grpcio-tools."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(HERE / "leadtime.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    stub = out / "leadtime_pb2_grpc.py"
    text = re.sub(
        r"^import leadtime_pb2 as", "from leadtime.predictor.grpc import leadtime_pb2 as", stub.read_text(), flags=re.M
    )
    stub.write_text(text)
    for name in GENERATED:
        path = out / name
        path.write_text("# ruff: noqa\n" + path.read_text())


def main(argv: list[str]) -> int:
    """Generate into DIR (argv[0], default beside the proto); 2 with one line on stderr when that fails."""
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m leadtime.predictor.grpc.regenerate [DIR]  (where to write; default beside the proto)")
        return 0
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(f"error: takes one folder, DIR, and no options: got {' '.join(argv)}", file=sys.stderr)
        return 2
    try:
        generate(Path(argv[0]) if argv else HERE)
    except ImportError:
        print(
            "error: grpcio-tools is not installed (pip install 'leadtime[test]', or -e '.[test]' in a checkout)",
            file=sys.stderr,
        )
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
