"""AMQP 0-9-1 protocol adapter."""
