"""Regenerate the Python stubs of the `.proto` files with grpcio-tools.

`shardgate.proto` is the public API (clients, the SDK); `cluster.proto` is the internal link
between the nodes of a cluster (messages only: its frames travel on a plain TCP connection,
so it has no gRPC stub).

The stubs are committed (so installing Shardgate needs no code generation and readers can see
them); `tests/unit/test_grpc_stubs.py` regenerates into a temporary directory and fails when the
committed files differ. Run `python proto/generate.py` after editing the `.proto`.

protoc writes `import shardgate_pb2` into a gRPC stub, which only works with `proto/` on
sys.path; this script rewrites it to the package import `from shardgate.proto import ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("shardgate.proto", "cluster.proto")


def _generated(stem: str) -> tuple[str, str, str]:
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def _imports(stem: str) -> tuple[str, str]:
    """The import protoc writes into the gRPC stub, and the package import it becomes."""
    alias = stem.replace("_", "__") + "__pb2"
    return f"import {stem}_pb2 as {alias}", f"from shardgate.proto import {stem}_pb2 as {alias}"


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every `.proto` into `out_dir`; returns the files written."""
    from grpc_tools import protoc  # a build/test dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    written: list[Path] = []
    for proto_file in PROTO_FILES:
        stem = proto_file.removesuffix(".proto")
        code = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / proto_file),
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto_file} with exit code {code}")
        bare_import, package_import = _imports(stem)
        grpc_stub = out_dir / f"{stem}_pb2_grpc.py"
        text = grpc_stub.read_text()
        written += [out_dir / name for name in _generated(stem)]
        if "Servicer" not in text:  # no service in it (cluster.proto): messages only
            grpc_stub.unlink()
            written.remove(grpc_stub)
            continue
        if bare_import not in text:
            raise RuntimeError(f"expected {bare_import!r} in the generated gRPC stub")
        grpc_stub.write_text(text.replace(bare_import, package_import))
    return written


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR
    for path in generate(out_dir):
        print(path)


if __name__ == "__main__":
    main()
