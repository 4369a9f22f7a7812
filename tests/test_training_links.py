"""A driver's link to a paused replica's stage: an order to it is that replica's loss
(ReplicaLost, which the driver handles), never an assertion that ends the agent."""

from __future__ import annotations

import pytest

from p2pswarm.agent.training.links import Link
from p2pswarm.errors import ReplicaLost
from p2pswarm.wire.training import Ack


async def test_an_order_to_a_closed_link_is_a_replica_lost() -> None:
    link = Link(stage=1, fellow="f3", addr="127.0.0.1:1")
    with pytest.raises(ReplicaLost, match="stage 1 on f3"):
        await link.ask(Ack(0), Ack)
    with pytest.raises(ReplicaLost):
        await link.receive(Ack)
