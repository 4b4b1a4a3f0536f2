"""In a cluster an AMQP connection asks the cluster's exchange directory about a name its node
does not know yet (declared on another node an instant ago) before answering 404: for a
passive declare, a bind and a publish. The directory here is a stand-in for the cluster's
(`shardgate/cluster/amqp_topology.py`), which reads etcd."""

from __future__ import annotations

import asyncio
from typing import Any

from pamqp import commands
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.protocols.amqp.service import AmqpService
from shardgate.protocols.amqp.settings import AmqpSettings
from shardgate.protocols.amqp.vhost import Exchange, VirtualHost

from tests.unit.test_amqp_connection import Client
from tests.unit.test_publish_batch import until


class ElsewhereDeclared:
    """Knows exchanges "declared on another node"; a lookup brings them into the vhost."""

    def __init__(self, known: dict[str, str]) -> None:
        self.known = known
        self.asked: list[str] = []

    def lookup(self, vhost: VirtualHost, names: list[str]) -> asyncio.Future[None]:
        self.asked.extend(names)
        for name in names:
            if name in self.known:
                vhost.exchanges[name] = Exchange(name, self.known[name], durable=False)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def create(self, vhost: Any, name: str, definition: dict[str, Any]) -> asyncio.Future[None]:
        return self.lookup(vhost, [name])

    def in_use_elsewhere(self, vhost: Any, name: str) -> asyncio.Future[bool]:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        done.set_result(False)
        return done

    def auto_delete(self, vhost: Any, name: str) -> None:
        vhost.auto_delete(name)

    def deleted(self, vhost: Any, name: str) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_an_exchange_declared_elsewhere_is_looked_up_before_a_404() -> None:
    service = AmqpService(Edge(Broker()), AmqpSettings(), scheduler=asyncio.get_running_loop())
    service.start()
    try:
        directory = ElsewhereDeclared({"remote-x": "fanout"})
        service.vhosts["/"].exchange_directory = directory
        client = Client(service)
        client.handshake()
        client.open_channel(1)
        got: list[Any] = []
        client.send(1, commands.Confirm.Select(), commands.Queue.Declare(queue="q"))
        got.extend(client.publish(1, "remote-x", "", b"hello"))
        await until(lambda: got.extend(client.read()) or any(
            isinstance(v, commands.Basic.Ack) for _, v in got))
        assert directory.asked == ["remote-x"]
        got.extend(client.send(1, commands.Queue.Bind(queue="q", exchange="remote-x")))
        await until(lambda: got.extend(client.read()) or any(
            isinstance(v, commands.Queue.BindOk) for _, v in got))
        # an unknown name is asked about once, then refused as on a single node
        got.extend(client.publish(1, "nowhere-x", "", b"lost"))
        await until(lambda: got.extend(client.read()) or any(
            isinstance(v, commands.Channel.Close) for _, v in got))
        close = next(v for _, v in got if isinstance(v, commands.Channel.Close))
        assert (close.reply_code, close.reply_text) == (404, "NOT_FOUND - no exchange 'nowhere-x' in vhost '/'")
        assert directory.asked == ["remote-x", "nowhere-x"]
    finally:
        service.stop()
