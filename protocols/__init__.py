"""Shardgate protocols package."""
