"""The users file authenticates gRPC calls too: the SDK with Basic credentials."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from shardgate.client import Client, Unauthenticated

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port


@pytest.fixture
def secured(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    save_users(broker.config.data_dir / "users.json",
               {"alice": User("alice", hash_password("alice-pw"))})
    broker.call(lambda: install_security(broker.app))
    return broker


async def test_grpc_basic_credentials_from_the_users_file(secured: ThreadedBroker) -> None:
    url = f"127.0.0.1:{secured.app.port('grpc')}"
    async with Client(url, username="alice", password="alice-pw") as client:
        receipt = await client.producer().send("devices/alice/temp", b"21")
        assert receipt.stream == "default"
    for kwargs in ({"username": "alice", "password": "wrong"}, {"username": "mallory", "password": "x"},
                   {"token": "not-a-user"}, {}):
        async with Client(url, **kwargs) as client:
            with pytest.raises(Unauthenticated):
                await client.producer().send("devices/alice/temp", b"21")
    # Counted per refused call (the SDK may make more than one per send); calls without any
    # credentials are refused by the gRPC layer itself from the mirrored anonymous flag.
    assert secured.app.security.denials[("grpc", "connect")] >= 3
