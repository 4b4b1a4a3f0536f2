"""How a cluster-wide listing merges every node's answer (`shardgate.cluster.views`): pure
functions over the JSON each node gives."""

from __future__ import annotations

from shardgate.cluster.views import Answers, merge_nodes


def test_node_table_has_a_row_per_node_and_names_the_silent_ones() -> None:
    answers = Answers(
        {"n2": [{"node": "n2", "rss_bytes": 2, "alarms": ["disk"], "connections": {"mqtt": 1}}],
         "n1": [{"node": "n1", "rss_bytes": 1, "alarms": [], "connections": {}}]},
        {"n3": "DEADLINE_EXCEEDED: no answer in 5 s"})
    rows = merge_nodes(answers)
    assert [row["node"] for row in rows] == ["n1", "n2", "n3"]
    assert rows[1]["alarms"] == ["disk"] and rows[1]["connections"] == {"mqtt": 1}
    assert rows[2] == {"node": "n3", "unanswered": "DEADLINE_EXCEEDED: no answer in 5 s"}
