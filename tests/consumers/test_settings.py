"""The settings the broker consumers share: one name and one default each, wherever they
apply, read from `relaybox.consumers.base.SharedSettings`; and the backoffs built on
`RetryPolicy`. No broker is needed: only the constructors' signatures are read."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import relaybox.consumers
from relaybox.consumers.amqp import AmqpConsumer
from relaybox.consumers.base import (
    DEFAULTS,
    MAX_RECONNECT_WAIT,
    Backoff,
    BrokerConsumer,
    redelivery_policy,
)
from relaybox.consumers.http import WebhookReceiver
from relaybox.consumers.kafka import KafkaConsumer
from relaybox.consumers.mqtt import MqttConsumer
from relaybox.consumers.nats import NatsConsumer
from relaybox.consumers.redis import RedisConsumer
from relaybox.errors import ConfigurationError

SHARED = dataclasses.asdict(DEFAULTS)
BROKER_CONSUMERS: list[type[BrokerConsumer]] = [
    AmqpConsumer, KafkaConsumer, MqttConsumer, NatsConsumer, RedisConsumer,
]  # fmt: skip
#: The shared settings a consumer does not take, and why.
NOT_TAKEN: dict[type[BrokerConsumer], set[str]] = {
    # RabbitMQ and an MQTT broker push their deliveries: there is no pull to wait in.
    AmqpConsumer: {"fetch_timeout"},
    MqttConsumer: {"fetch_timeout"},
    # Joining a group lasts as long as its rebalance, which Kafka's own timeouts bound.
    KafkaConsumer: {"timeout"},
    # A failed entry stays pending until it is claimed again after `claim_idle`.
    RedisConsumer: {"retry_delay", "max_retry_delay"},
}
#: Spellings the consumers once had for shared settings: none may come back.
RETIRED = {
    "bootstrap_servers", "servers", "batch", "count", "max_records", "block",
    "retry_backoff", "max_retry_backoff", "connect_timeout", "reconnect_delay",
    "reconnect_interval",
}  # fmt: skip


def test_every_broker_consumer_is_checked() -> None:
    for module in pkgutil.iter_modules(relaybox.consumers.__path__):
        importlib.import_module(f"relaybox.consumers.{module.name}")
    found = {
        subclass
        for subclass in BrokerConsumer.__subclasses__()
        if subclass.__module__.startswith("relaybox.consumers.")
    }
    assert found == set(BROKER_CONSUMERS)


@pytest.mark.parametrize("consumer_class", BROKER_CONSUMERS, ids=lambda c: c.__name__)
def test_a_consumer_takes_the_shared_settings_by_one_name_with_one_default(
    consumer_class: type[BrokerConsumer],
) -> None:
    parameters = inspect.signature(consumer_class).parameters
    assert list(parameters)[:2] == ["url", "consumer"]
    skipped = NOT_TAKEN.get(consumer_class, set())
    taken = {name: p.default for name, p in parameters.items() if name in SHARED}
    assert taken == {name: value for name, value in SHARED.items() if name not in skipped}
    assert {parameters[name].kind for name in taken} == {inspect.Parameter.KEYWORD_ONLY}
    assert not RETIRED & parameters.keys()


def test_the_webhook_receiver_takes_only_max_attempts() -> None:
    """It reads no broker: requests come to it, and the relay's publisher resends; but
    it does park a message whose attempts ran out."""
    parameters = inspect.signature(WebhookReceiver).parameters
    assert (SHARED.keys() | RETIRED | {"url"}) & parameters.keys() == {"max_attempts"}
    assert parameters["max_attempts"].default == DEFAULTS.max_attempts


def test_reconnect_waits_double_up_to_their_cap_and_start_over_after_a_success() -> None:
    backoff = Backoff.reconnects(1.0)
    waits = [backoff.failed() for _ in range(7)]
    assert waits == [min(2.0**n, MAX_RECONNECT_WAIT) for n in range(7)]
    assert waits[-1] == MAX_RECONNECT_WAIT
    backoff.succeeded()
    assert backoff.failed() == 1.0
    longer = Backoff.reconnects(MAX_RECONNECT_WAIT * 2)
    assert {longer.failed() for _ in range(3)} == {MAX_RECONNECT_WAIT * 2}
    with pytest.raises(ConfigurationError, match="reconnect_wait=0"):
        Backoff.reconnects(0)


def test_redelivery_delays_double_per_failure_up_to_max_retry_delay() -> None:
    retries = Backoff(redelivery_policy(0.5, 3.0))
    assert [retries.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert redelivery_policy(0, 0).nominal_delay(3) == 0
    with pytest.raises(ConfigurationError, match="retry_delay <= max_retry_delay"):
        redelivery_policy(2.0, 1.0)
    with pytest.raises(ConfigurationError, match="retry_delay=-1"):
        redelivery_policy(-1, 1.0)
