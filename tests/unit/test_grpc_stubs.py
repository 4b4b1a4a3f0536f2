"""The committed gRPC stubs are exactly what `proto/generate.py` produces from the `.proto`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def _load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("shardgate_proto_generate", PROTO_DIR / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    generator = _load_generator()
    for fresh in generator.generate(tmp_path):
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run python proto/generate.py"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python proto/generate.py and commit the result"
        )


def test_grpc_stub_imports_the_packaged_messages() -> None:
    text = (PROTO_DIR / "shardgate_pb2_grpc.py").read_text()
    assert "from shardgate.proto import shardgate_pb2 as shardgate__pb2" in text
    from shardgate.proto import shardgate_pb2, shardgate_pb2_grpc

    assert shardgate_pb2.DESCRIPTOR.package == "shardgate.v1"
    assert hasattr(shardgate_pb2_grpc, "ProducerStub")
    assert hasattr(shardgate_pb2_grpc, "add_AdminServicer_to_server")
