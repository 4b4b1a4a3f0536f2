"""Regenerate the Python stubs of `shardgate.proto` with grpcio-tools.

The stubs are committed (so installing Shardgate needs no code generation and readers can see
them); `tests/unit/test_grpc_stubs.py` regenerates into a temporary directory and fails when the
committed files differ. Run `python proto/generate.py` after editing the `.proto`.

protoc writes `import shardgate_pb2` into the gRPC stub, which only works with `proto/` on
sys.path; this script rewrites it to the package import `from shardgate.proto import ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "shardgate.proto"
GENERATED = ("shardgate_pb2.py", "shardgate_pb2.pyi", "shardgate_pb2_grpc.py")
BARE_IMPORT = "import shardgate_pb2 as shardgate__pb2"
PACKAGE_IMPORT = "from shardgate.proto import shardgate_pb2 as shardgate__pb2"


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of `shardgate.proto` into `out_dir`; returns the files written."""
    from grpc_tools import protoc  # a build/test dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    code = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_FILE),
    ])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    grpc_stub = out_dir / "shardgate_pb2_grpc.py"
    text = grpc_stub.read_text()
    if BARE_IMPORT not in text:
        raise RuntimeError(f"expected {BARE_IMPORT!r} in the generated gRPC stub")
    grpc_stub.write_text(text.replace(BARE_IMPORT, PACKAGE_IMPORT))
    return [out_dir / name for name in GENERATED]


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR
    for path in generate(out_dir):
        print(path)


if __name__ == "__main__":
    main()
