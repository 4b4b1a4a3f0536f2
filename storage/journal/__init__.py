"""Shardgate storage.journal package."""
