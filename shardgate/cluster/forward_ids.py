"""The identity of a forwarded publish, so that a publish held through a failover
(`forwarding.HeldForwards`) is stored once.

A node forwarding a publish (QoS >= 1) to its shard's leader gives it an identity: its node id,
its incarnation (random, new at every start) and a sequence number, in the message's native
properties under `FORWARD_ID`. It is stored with the record, so it is in the shard's log and
replicated with it, as Kafka keeps a producer's id and sequence in its record batches. When the
leader dies after storing (and replicating) the message but before its answer arrived, the
forwarding node holds the message and sends it to the next leader marked as possibly stored
(the identity under `RESENT_ID`, on the wire only). That leader looks for the identity in its
own log before storing (`core/resends.py`, the same look-up a client's resend gets: a gRPC
producer's identity, `PRODUCER_ID`, travels untouched beside the node's): found, the message is
acknowledged at the offset it has; not found, it is stored (under `FORWARD_ID` again). A new
leader answers only once it has settled (its high watermark reached the end of the log it began
its epoch with, every record an earlier leader may have stored readable); before, the resend is
refused retryably and held again, as is one found above the high watermark (a resend to the
same leader whose first copy waits for its replicas), until it is committed there. What a
leader read is kept per shard (`core.resends.ResendCheck`, the broker's) until the view
changes, so a failover's resends read the log once.

A copy found there reaches live subscribers although this leader did not dispatch it itself:
either its earlier leader committed it, and dispatched it then, or it is in the tail this
leader inherited past the high watermark it knew, which it hands on (dispatches) once its own
high watermark passes that tail's end (`replicated_shards.ReplicatedShards._hand_on`, set up as
it takes the lead). That is also when it settles (its high watermark reaches the end its epoch
began with), and the check answers nothing before: so a found copy is acknowledged only once
its hand-on is due, never one that nobody dispatches.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

from ..core.resends import FORWARD_ID, RESENT_ID

if TYPE_CHECKING:
    from ..core.message import Message


class ForwardIds:
    """Gives the publishes this node forwards their identity (see the module docstring)."""

    def __init__(self, node_id: str) -> None:
        self._prefix = f"{node_id}:{os.urandom(6).hex()}:".encode()
        self._sequence = itertools.count(1)

    def tag(self, message: Message) -> None:
        native = message.native_properties
        forward_id = b"%s%d" % (self._prefix, next(self._sequence))
        if native is None:
            message.native_properties = {FORWARD_ID: forward_id}
        else:
            native = {name: value for name, value in native.items() if name != RESENT_ID}
            native[FORWARD_ID] = forward_id
            message.native_properties = native
