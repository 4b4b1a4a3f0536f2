"""Shardgate: a multi-protocol message gateway on one shard-based core."""

__version__ = "0.1.0"
