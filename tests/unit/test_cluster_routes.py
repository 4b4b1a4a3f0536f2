"""The route table: what a node advertises of its subscriptions, and matching other nodes'
routes against topic names."""

from __future__ import annotations

from shardgate.core.subscriptions import Subscription, SubscriptionType

from shardgate.cluster.frames import route_update, routes_from_update
from shardgate.cluster.routes import NOBODY, RemoteRoutes, Route, RouteDelta, diff, local_routes


def test_local_routes_hold_plain_filters_and_shared_groups_with_a_consumer():
    plain = Subscription("client-1")
    plain.filters = {"a/#": None, "b/+": None}
    idle_group = Subscription("$share/g/c/#", SubscriptionType.SHARED)
    idle_group.filters = {"c/#": None}
    busy_group = Subscription("$share/h/d", SubscriptionType.SHARED)
    busy_group.filters = {"d": None}
    busy_group.consumers.append(object())  # type: ignore[arg-type]
    assert local_routes([plain, idle_group, busy_group]) == {
        Route("a/#"), Route("b/+"), Route("d", "$share/h/d", 1),
    }


def test_a_durable_shared_subscription_is_routed_with_no_consumer_attached():
    """Its cursors keep what is published meanwhile (a durable queue, a durable gRPC Shared
    subscription whose consumers left): the owner must still push it here."""
    idle = Subscription("work", SubscriptionType.SHARED, durable=True)
    idle.filters = {"w/#": None}
    assert local_routes([idle]) == {Route("w/#", "work", 1, True)}


def test_diff_lists_added_and_removed_routes():
    delta = diff({Route("a"), Route("b")}, {Route("b"), Route("c")})
    assert delta.added == [Route("c")] and delta.removed == [Route("a")]
    assert not diff({Route("a")}, {Route("a")})


def test_lookup_names_plain_nodes_and_share_group_members():
    routes = RemoteRoutes()
    routes.reset("n2", [Route("sensors/#"), Route("sensors/+/t", "$share/g/sensors/+/t", 1)])
    routes.reset("n3", [Route("sensors/+/t", "$share/g/sensors/+/t", 3), Route("other")])
    interest = routes.lookup("sensors/1/t")
    assert interest.plain == {"n2"}
    assert dict(interest.groups) == {"$share/g/sensors/+/t": (("n2", 1), ("n3", 3))}
    assert routes.lookup("nothing/here") is NOBODY


def test_wildcards_do_not_match_system_topics():
    routes = RemoteRoutes()
    routes.reset("n2", [Route("#"), Route("+/x")])
    assert routes.lookup("$SYS/x") is NOBODY
    assert routes.lookup("a/x").plain == {"n2"}


def test_applying_deltas_and_forgetting_a_node_clear_cached_lookups():
    routes = RemoteRoutes()
    routes.apply("n2", RouteDelta([Route("a/#")], []))
    assert routes.lookup("a/b").plain == {"n2"}
    routes.apply("n2", RouteDelta([Route("a/b")], [Route("a/#")]))
    assert routes.lookup("a/b").plain == {"n2"} and routes.lookup("a/c") is NOBODY
    routes.forget("n2")
    assert routes.lookup("a/b") is NOBODY and routes.nodes() == []


def test_route_updates_round_trip_through_their_frame():
    delta = RouteDelta([Route("a/#"), Route("b", "$share/g/b", 2)], [Route("c")])
    update = route_update(delta, reset=True)
    assert update.reset
    assert routes_from_update(type(update).FromString(update.SerializeToString())) == delta
