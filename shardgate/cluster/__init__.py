"""Cluster mode: several `shardgate serve` processes form one broker, coordinated by etcd.

`membership` is the contract between the control plane (etcd client, node registration,
controller election, placement) and the data plane (forwarding publishes to a shard's owner,
the route table, pushing matching messages to the nodes whose clients subscribed).
Nothing here runs on a single node.
"""
