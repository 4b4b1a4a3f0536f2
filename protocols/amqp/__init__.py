"""AMQP 0-9-1 protocol adapter: RabbitMQ clients (aio-pika, pika, ...) on the Shardgate core."""
