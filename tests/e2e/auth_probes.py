"""Clients that knock on a broker while it starts: each protocol's real client connects in a
loop with the given credentials and records what every attempt got, so a test can prove that a
starting node never lets a wrong password (or nobody) in, not even on its first connection."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as mqtt
import pika
import pika.exceptions
from shardgate.client import Client
from shardgate.client.errors import PermissionDenied, ShardgateError, Unauthenticated

# what one attempt got
NOT_LISTENING = "not listening"  # the connection was refused or closed before any answer
REFUSED = "refused"  # the protocol's own refusal of the credentials
ACCEPTED = "accepted"


def mqtt_attempt(port: int, username: str | None, password: str | None,
                 transport: str = "tcp") -> str:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="", protocol=mqtt.MQTTv5,
                         transport=transport)
    if username is not None:
        client.username_pw_set(username, password)
    answers: queue.Queue[int] = queue.Queue()
    client.on_connect = lambda c, u, flags, rc, props: answers.put(rc.value)
    try:
        client.connect("127.0.0.1", port, keepalive=30)
    except OSError:
        return NOT_LISTENING
    try:
        for _ in range(300):  # a loaded machine checks passwords (scrypt) slowly
            if client.loop(timeout=0.1) != mqtt.MQTT_ERR_SUCCESS:
                break
            if not answers.empty():
                break
        if answers.empty():
            return NOT_LISTENING
        return ACCEPTED if answers.get() == 0 else REFUSED
    finally:
        client.disconnect()


def amqp_attempt(port: int, username: str, password: str) -> str:
    parameters = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials(username, password),
        connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30,
        stack_timeout=30)
    try:
        connection = pika.BlockingConnection(parameters)
    except pika.exceptions.ProbableAuthenticationError:
        return REFUSED
    except pika.exceptions.AMQPError as exc:
        text = repr(exc)
        return REFUSED if "ACCESS_REFUSED" in text or "403" in text else NOT_LISTENING
    connection.close()
    return ACCEPTED


def grpc_attempt(port: int, username: str, password: str) -> str:
    async def attempt() -> str:
        client = Client(f"127.0.0.1:{port}", username=username, password=password, timeout=30)
        try:
            await client.admin.list_streams()
        except Unauthenticated:
            return REFUSED
        except PermissionDenied:
            return ACCEPTED  # authenticated, only not allowed this call
        except ShardgateError:
            return NOT_LISTENING  # not up yet, or no answer in time
        finally:
            await client.close()
        return ACCEPTED

    return asyncio.run(attempt())


class Prober:
    """Runs `attempt` in a loop on its own thread until `stop()`; `outcomes` counts the
    results, `refused_after_ready` those after `mark_ready()`."""

    def __init__(self, name: str, attempt: Callable[[], str]) -> None:
        self.name = name
        self.attempt = attempt
        self.outcomes: Counter[str] = Counter()
        self.refused_after_ready = 0
        self.ready = threading.Event()
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{name}", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def mark_ready(self) -> None:
        self.ready.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready = self.ready.is_set()
            try:
                outcome = self.attempt()
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return
            self.outcomes[outcome] += 1
            if ready and outcome == REFUSED:
                self.refused_after_ready += 1
            self._stop.wait(0.01)  # every refusal costs the broker a password check

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
