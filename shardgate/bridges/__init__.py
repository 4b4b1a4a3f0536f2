"""Bridges to remote brokers: MQTT (`bridge`, on amqtt's client) and AMQP 0-9-1
(`amqp_bridge`, on aio-pika)."""
