"""AMQP transactions (class tx, AMQP 0-9-1 §1.9, as RabbitMQ runs them): a transactional
channel holds its publishes and its acks/nacks/rejects until tx.commit, which routes the
publishes, then applies the settlements, and answers commit-ok only once the publishes to
reliable streams are journaled; tx.rollback forgets the publishes and makes the settled
deliveries unacknowledged again."""

from __future__ import annotations

from pamqp import commands

from ...core.message import Message
from .base import ConnectionBase
from .channel import AmqpChannel, Delivery
from .errors import ChannelException, ReplyCode
from .frames import State, method_ids


class Transaction:
    """What a transactional channel did since its last commit or rollback (AMQP 0-9-1 §1.9
    class tx): publishes, and the acks/nacks/rejects of deliveries, in the order they came."""

    __slots__ = ("publishes", "settlements")

    def __init__(self) -> None:
        self.publishes: list[tuple[commands.Basic.Publish, Message]] = []
        # (requeue or None for an ack, deliveries with their delivery tags)
        self.settlements: list[tuple[bool | None, list[tuple[int, Delivery]]]] = []


class TransactionsMixin(ConnectionBase):
    """tx.select, tx.commit, tx.rollback."""

    def _tx_select(self, channel: AmqpChannel, frame: commands.Tx.Select) -> None:
        if channel.confirm:
            # rabbit_channel: tx.select on a channel in confirm mode.
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from confirm to tx mode", *method_ids(frame)
            )
        if channel.tx is None:
            channel.tx = Transaction()
        self.send_method(channel.number, commands.Tx.SelectOk())

    def _tx_commit(self, channel: AmqpChannel, frame: commands.Tx.Commit) -> None:
        """Route the held publishes, then apply the held settlements (RabbitMQ's order); the
        commit-ok waits until the publishes to reliable streams are journaled, and this
        connection reads nothing more until then."""
        tx = channel.tx
        if tx is None:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", *method_ids(frame)
            )
        publishes, settlements = tx.publishes, tx.settlements
        channel.tx = Transaction()
        for publish, message in publishes:
            self._deliver_publish(channel, publish, message, -1)
        self._flush_publishes()
        for requeue, tagged in settlements:
            deliveries = [delivery for _, delivery in tagged]
            if requeue is None:
                for delivery in deliveries:
                    delivery.queue.settle(delivery.entry)
            else:
                self._settle_negative(channel, deliveries, requeue)
        if channel.tx_landing:
            self._paused = True  # resumed, with the commit-ok sent, once they are stored
        else:
            self._commit_ok(channel)

    def _commit_ok(self, channel: AmqpChannel) -> None:
        if channel.closing or self.state is not State.OPEN:
            return
        if channel.tx_failed:
            channel.tx_failed = False
            self._close_channel(channel, ChannelException(
                ReplyCode.INTERNAL_ERROR, "the transaction's messages could not be stored",
                *method_ids(commands.Tx.Commit),
            ))
            return
        self.send_method(channel.number, commands.Tx.CommitOk())

    def _tx_rollback(self, channel: AmqpChannel, frame: commands.Tx.Rollback) -> None:
        """Forget the held publishes; deliveries acknowledged in the transaction are
        unacknowledged again (rabbit_channel handle_method tx.rollback)."""
        tx = channel.tx
        if tx is None:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", *method_ids(frame)
            )
        channel.tx = Transaction()
        for _, tagged in tx.settlements:
            channel.restore_unacked(tagged)
        self.send_method(channel.number, commands.Tx.RollbackOk())

