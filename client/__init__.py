"""Shardgate client package."""
