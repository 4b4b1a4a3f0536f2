"""How a cluster-wide listing merges every node's answer (`shardgate.cluster.views`): pure
functions over the JSON each node gives."""

from __future__ import annotations

from shardgate.cluster.views import Answers, merge_nodes, merge_subscriptions


def test_node_table_has_a_row_per_node_and_names_the_silent_ones() -> None:
    answers = Answers(
        {"n2": [{"node": "n2", "rss_bytes": 2, "alarms": ["disk"], "connections": {"mqtt": 1}}],
         "n1": [{"node": "n1", "rss_bytes": 1, "alarms": [], "connections": {}}]},
        {"n3": "DEADLINE_EXCEEDED: no answer in 5 s"})
    rows = merge_nodes(answers)
    assert [row["node"] for row in rows] == ["n1", "n2", "n3"]
    assert rows[1]["alarms"] == ["disk"] and rows[1]["connections"] == {"mqtt": 1}
    assert rows[2] == {"node": "n3", "unanswered": "DEADLINE_EXCEEDED: no answer in 5 s"}


def test_a_subscription_on_several_nodes_is_one_row_with_its_nodes_and_consumers() -> None:
    group = {"name": "$share/workers/jobs/#", "type": "shared", "durable": False,
             "protocol": "mqtt", "filters": ["jobs/#"], "lag": 0, "inflight": 2, "queued": 1}
    answers = Answers({
        "n1": [dict(group, consumers=[{"id": "w1", "protocol": "mqtt", "active": True}]),
               {"name": "mqtt:w1", "type": "exclusive", "protocol": "mqtt", "filters": [],
                "consumers": [], "lag": 0, "inflight": 0, "queued": 0}],
        "n2": [dict(group, consumers=[{"id": "w2", "protocol": "mqtt", "active": True}],
                    inflight=3, queued=0)],
        # the same name with another protocol is another subscription
        "n3": [dict(group, protocol="grpc", consumers=[])],
    })
    rows = merge_subscriptions(answers, "json")
    assert [(row["name"], row["protocol"], row["node"]) for row in rows] == [
        ("$share/workers/jobs/#", "mqtt", "n1,n2"), ("$share/workers/jobs/#", "grpc", "n3"),
        ("mqtt:w1", "mqtt", "n1")]
    shared = rows[0]
    assert shared["nodes"] == ["n1", "n2"]
    assert [(c["id"], c["node"]) for c in shared["consumers"]] == [("w1", "n1"), ("w2", "n2")]
    assert (shared["inflight"], shared["queued"], shared["filters"]) == (5, 1, ["jobs/#"])


def test_the_grpc_admin_shape_merges_without_fields_its_messages_lack() -> None:
    info = {"name": "g", "type": "SUBSCRIPTION_TYPE_SHARED", "durable": False,
            "topic_filters": ["a/#"], "protocol": "grpc", "lag": "0", "max_deliveries": 0}
    answers = Answers({"n1": [dict(info, consumers=[{"consumer_id": "c1"}])],
                       "n2": [dict(info, topic_filters=["b/#"], consumers=[{"consumer_id": "c2"}])]})
    (row,) = merge_subscriptions(answers, "proto")
    assert row["node"] == "n1,n2" and "nodes" not in row
    assert row["consumers"] == [{"consumer_id": "c1"}, {"consumer_id": "c2"}]
    assert row["topic_filters"] == ["a/#", "b/#"]
