"""Celery tasks on RabbitMQ: relaybox's AMQP publisher, with publisher confirms,
sending Celery's task messages (`relaybox.publishers.celery` says which and why)."""

from __future__ import annotations

from typing import cast

import aio_pika
from pamqp.common import FieldValue

from relaybox.core.records import StoredMessage
from relaybox.publishers import amqp
from relaybox.publishers.celery import CONTENT_TYPE, ENCODING, task_message


def celery_amqp(
    url: str, *, queue: str, exchange: str, routing_key: str, declare: bool, timeout: float,
    origin: str,
) -> amqp.AmqpPublisher:  # fmt: skip
    """relaybox's AMQP publisher, sending Celery's task messages to Celery's exchange."""

    def encode(message: StoredMessage) -> tuple[aio_pika.Message, str]:
        headers, body = task_message(message, origin)
        outgoing = aio_pika.Message(
            body,
            headers=cast(dict[str, FieldValue], headers),
            content_type=CONTENT_TYPE,
            content_encoding=ENCODING,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            correlation_id=str(message.id),
            priority=0,
        )
        return outgoing, routing_key

    topology = amqp.Topology(exchange, "direct", queue, routing_key)
    return amqp.AmqpPublisher(
        url, exchange=exchange, timeout=timeout, topology=topology, encode=encode,
        declare=declare,
    )  # fmt: skip
