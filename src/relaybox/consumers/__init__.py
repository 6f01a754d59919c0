"""Broker consumers: receive, run the handler with the inbox check, acknowledge after
the commit. One module per broker, each importing its client library lazily:
`relaybox.consumers.nats`, `.amqp`, `.kafka`, `.redis`, `.mqtt`, `.http`."""

from relaybox.consumers.base import BrokerConsumer, Verdict

__all__ = ["BrokerConsumer", "Verdict"]
