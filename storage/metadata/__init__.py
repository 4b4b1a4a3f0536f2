"""Shardgate storage.metadata package."""
