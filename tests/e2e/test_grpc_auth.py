"""gRPC authorization with the users and ACL files, and the admin's kick of gRPC streams.

Each test writes the users and ACL files into the broker's data directory, then installs the
security model on the broker's loop with `install_security(broker.app)`, which fills the gRPC
server's `authorizer` hook.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from shardgate.client import Client, PermissionDenied, Unauthenticated, Unavailable
from shardgate.core.edge import Principal, Verdict

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port, wait_for

TIMEOUT = 5.0

ACL = """
[[allow]]
actions = ["publish", "subscribe"]
topics = ["devices/%u/#"]

[[allow]]
user = "monitor"
actions = "subscribe"
topics = ["devices/#"]

[[deny]]
actions = "publish"
topics = ["devices/+/secret"]
"""

USERS = {"alice": "alice-pw", "bob": "bob-pw", "monitor": "monitor-pw"}


@pytest.fixture
def secured(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    data_dir = broker.config.data_dir
    save_users(data_dir / "users.json",
               {name: User(name, hash_password(password)) for name, password in USERS.items()})
    (data_dir / "acl.toml").write_text(ACL)
    broker.call(lambda: install_security(broker.app))
    assert broker.app.edge.security.policy is broker.app.security
    return broker


def url_of(broker: ThreadedBroker) -> str:
    return f"127.0.0.1:{broker.app.port('grpc')}"


def client_for(broker: ThreadedBroker, user: str) -> Client:
    return Client(url_of(broker), username=user, password=USERS[user])


async def test_publish_is_authorized_per_topic(secured: ThreadedBroker) -> None:
    async with client_for(secured, "alice") as client:
        producer = client.producer()
        receipt = await producer.publish("devices/alice/temp", b"21")
        assert receipt.stream == "default"
        with pytest.raises(PermissionDenied) as refused:
            await producer.publish("devices/bob/temp", b"21")
        assert "devices/bob/temp" in refused.value.details
        assert "alice" in refused.value.details
        with pytest.raises(PermissionDenied):
            await producer.publish("devices/alice/secret", b"x")  # a deny rule beats the allow
    assert secured.app.security.denials[("grpc", "publish")] >= 2


async def test_stream_publish_refuses_single_messages_and_goes_on(secured: ThreadedBroker) -> None:
    async with client_for(secured, "bob") as client:
        producer = client.producer()
        futures = [producer.send_nowait(topic, b"v") for topic in
                   ("devices/bob/a", "devices/alice/a", "devices/bob/b", "other/topic", "devices/bob/c")]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert [type(o).__name__ for o in outcomes] == [
            "Receipt", "PermissionDenied", "Receipt", "PermissionDenied", "Receipt"]
        assert "not authorized to publish to 'devices/alice/a'" in outcomes[1].details
        # The stream is still open and usable.
        receipt = await producer.send("devices/bob/d", b"v")
        assert receipt.offset >= 0
        await producer.close()


async def test_subscribe_is_authorized_per_filter(secured: ThreadedBroker) -> None:
    async with client_for(secured, "alice") as alice, client_for(secured, "monitor") as monitor:
        with pytest.raises(PermissionDenied) as refused:
            await alice.consumer("alice-all", ["devices/alice/#", "devices/#"]).subscribe()
        assert "devices/#" in refused.value.details
        with pytest.raises(PermissionDenied):
            await alice.consumer("alice-bob", ["devices/bob/+"]).subscribe()
        with pytest.raises(PermissionDenied):
            await monitor.consumer("monitor-all", ["#"]).subscribe()
        own = await alice.consumer("alice-own", ["devices/alice/#"]).subscribe()
        watcher = await monitor.consumer("monitor-temp", ["devices/+/temp"]).subscribe()
        await alice.producer().publish("devices/alice/temp", b"22")
        for consumer in (own, watcher):
            message = await consumer.receive(TIMEOUT)
            assert (message.topic, message.payload) == ("devices/alice/temp", b"22")
            message.ack()
        # Subscribing to devices/# grants no publish there.
        with pytest.raises(PermissionDenied):
            await monitor.producer().publish("devices/alice/x", b"1")
        await own.close()
        await watcher.close()
    denials = secured.app.security.denials
    assert denials[("grpc", "subscribe")] >= 3
    # The subscriptions refused were not created.
    assert "alice-all" not in secured.app.broker.subscriptions
    assert "monitor-all" not in secured.app.broker.subscriptions


async def test_authenticator_gets_the_peer_address(secured: ThreadedBroker) -> None:
    seen: list[tuple[str | None, str]] = []
    security = secured.app.security

    class Recording:
        """The broker's policy, recording who authenticates from where."""

        allow_anonymous = security.allow_anonymous
        checks_credentials = security.checks_credentials
        authorize_principal = security.authorize_principal
        count_denial = security.count_denial

        def authenticate_principal(self, principal: Principal, password: bytes | str | None) -> Verdict:
            seen.append((principal.username, principal.remote))
            return security.authenticate_principal(principal, password)

    secured.call(lambda: secured.app.edge.security.install(Recording()))
    async with client_for(secured, "alice") as client:
        await client.producer().publish("devices/alice/x", b"1")
    async with Client(url_of(secured), username="alice", password="nope") as client:
        with pytest.raises(Unauthenticated):
            await client.producer().publish("devices/alice/x", b"1")
    assert seen and all(user == "alice" and "127.0.0.1" in remote for user, remote in seen)


async def test_kick_ends_consumer_and_producer_streams(secured: ThreadedBroker) -> None:
    server = secured.app.grpc
    async with client_for(secured, "alice") as client:
        consumer = await client.consumer("kicked", ["devices/alice/#"], reconnect=False).subscribe()
        producer = client.producer("alice-producer")
        await producer.send("devices/alice/1", b"1")
        message = await consumer.receive(TIMEOUT)
        assert message.payload == b"1"  # delivered, not acked: handed over on kick
        assert secured.call(lambda: server.kick(consumer.consumer_id)) == 1
        with pytest.raises(Unavailable) as ended:
            await consumer.receive(TIMEOUT)
        assert "kicked by administrator" in ended.value.details
        wait_for(lambda: secured.call(lambda: not server.consumers))  # the stream's cleanup
        # A producer stream: listed under its id and its name; the SDK reconnects and resends.
        assert [p.name for p in server.producers] == ["alice-producer"]
        producer_id = next(iter(server.producers)).id
        assert secured.call(lambda: server.kick(producer_id)) == 1
        receipt = await producer.send("devices/alice/2", b"2")
        assert receipt.offset >= 0
        assert secured.call(lambda: server.kick("alice-producer")) == 1
        assert secured.call(lambda: server.kick("nobody")) == 0
        await producer.close()
