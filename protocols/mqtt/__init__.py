"""Shardgate protocols.mqtt package."""
