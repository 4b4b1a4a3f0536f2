"""The users file authenticates AMQP clients too: pika logins against a secured broker."""

from __future__ import annotations

import pika
import pytest
from pika.exceptions import ProbableAuthenticationError

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port


@pytest.fixture
def secured(broker_factory) -> ThreadedBroker:
    broker = broker_factory(listeners={"amqp_port": free_port()})
    save_users(broker.config.data_dir / "users.json",
               {"alice": User("alice", hash_password("alice-pw"))})
    broker.call(lambda: install_security(broker.app))
    return broker


def connect(port: int, user: str, password: str) -> pika.BlockingConnection:
    credentials = pika.PlainCredentials(user, password)
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=credentials, connection_attempts=1))


def test_amqp_user_from_users_file_logs_in(secured: ThreadedBroker) -> None:
    connection = connect(secured.app.port("amqp"), "alice", "alice-pw")
    channel = connection.channel()
    channel.queue_declare("q-auth")
    connection.close()


@pytest.mark.parametrize(("user", "password"), [("alice", "wrong"), ("guest", "guest"),
                                                ("mallory", "alice-pw")])
def test_amqp_bad_login_is_refused_403_and_counted(secured: ThreadedBroker, user: str,
                                                    password: str) -> None:
    with pytest.raises(ProbableAuthenticationError) as info:
        connect(secured.app.port("amqp"), user, password)
    assert "403" in str(info.value) or "ACCESS_REFUSED" in str(info.value)
    assert secured.app.security.denials[("amqp", "connect")] == 1


def test_amqp_default_guest_login_works_on_an_open_loopback_broker(broker_factory) -> None:
    broker = broker_factory(listeners={"amqp_port": free_port()})
    security = broker.call(lambda: install_security(broker.app))
    assert security.allow_anonymous
    connection = connect(broker.app.port("amqp"), "guest", "guest")
    connection.close()
