"""Shardgate proto package."""
