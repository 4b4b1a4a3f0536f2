"""Shardgate core package."""
