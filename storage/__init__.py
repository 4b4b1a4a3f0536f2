"""Shardgate storage package."""
