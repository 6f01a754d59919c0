"""The relay's signals as Prometheus metrics (`pip install 'relaybox[metrics]'`).

`relaybox relay --http HOST:PORT` serves them at /metrics. An application that runs the
relay in its own process and already exposes a registry adds them there:

    from prometheus_client import REGISTRY
    from relaybox.observability.prometheus import RelayCollector

    REGISTRY.register(RelayCollector(relay))
    relay.sample_stats(every=15.0)   # keep the table's counts fresh between scrapes

The collector reads the relay's counters when scraped, so the relay pays nothing per
message for being watched; the table's counts come from the last sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from relaybox.core.circuit import CircuitState
from relaybox.core.extras import needs_extras
from relaybox.core.signals import (
    PROCESSOR_COUNTERS,
    SETTLED_OUTCOMES,
    TARGET_OUTCOMES,
    Histogram,
)

with needs_extras("Prometheus metrics"):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from relaybox.relay.engine import Relay

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RelayCollector(Collector):
    """Every signal of one `Relay`, read when collected."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay

    def collect(self) -> Iterator[Metric]:
        yield from self._relay_metrics()
        yield from self._outbox_metrics()
        yield from self._target_metrics()

    def _relay_metrics(self) -> Iterator[Metric]:
        relay = self._relay
        info = GaugeMetricFamily(
            "relaybox_relay_info", "This relay process", labels=["worker", "table", "version"]
        )
        info.add_metric([relay.worker, relay.table, _version()], 1)
        yield info
        labels = ["database"]
        for attribute, name, text in PROCESSOR_COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for processor in relay.processors:
                family.add_metric([processor.name], getattr(processor.metrics, attribute))
            yield family
        settled = CounterMetricFamily(
            "relaybox_relay_settled_messages",
            "Messages whose outcome the relay recorded in the table, by outcome",
            labels=["database", "outcome"],
        )
        held = GaugeMetricFamily(
            "relaybox_relay_partitions_held", "Partitions this relay holds", labels=labels
        )
        flying = GaugeMetricFamily(
            "relaybox_relay_batches_in_flight", "Batches being published or settled", labels=labels
        )
        unserved = GaugeMetricFamily(
            "relaybox_outbox_unserved_messages",
            "Rows waiting for a target that no live relay of the table serves, as last counted",
            labels=["database", "target"],
        )
        for processor in relay.processors:
            for target, count in processor.unserved.items():
                unserved.add_metric([processor.name, target], count)
            for outcome in SETTLED_OUTCOMES:
                settled.add_metric([processor.name, outcome], getattr(processor.metrics, outcome))
            if processor.partitions_held is not None:
                held.add_metric([processor.name], processor.partitions_held)
            flying.add_metric([processor.name], processor.in_flight)
        connected = GaugeMetricFamily(
            "relaybox_database_connected",
            "1 once the database was connected; 0 while the relay retries it",
            labels=labels,
        )
        for name in relay.database_urls:
            connected.add_metric([name], int(name not in relay.unreachable))
        yield from (settled, held, flying, unserved, connected)

    def _outbox_metrics(self) -> Iterator[Metric]:
        labels = ["database"]
        messages = GaugeMetricFamily(
            "relaybox_outbox_messages",
            "Rows in the outbox table by status, at the last sample",
            labels=["database", "status"],
        )
        oldest = GaugeMetricFamily(
            "relaybox_outbox_oldest_pending_age_seconds",
            "How long the oldest due message has waited, at the last sample",
            labels=labels,
        )
        leases = GaugeMetricFamily(
            "relaybox_outbox_active_leases", "Rows leased by row-lease relays", labels=labels
        )
        held = GaugeMetricFamily(
            "relaybox_outbox_held", "Held messages (not counted by status), at the last sample",
            labels=labels,
        )  # fmt: skip
        held_keys = GaugeMetricFamily(
            "relaybox_outbox_held_keys",
            "Keys whose later messages wait behind a held message, at the last sample",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "relaybox_outbox_sample_age_seconds", "Age of the last sample of the table",
            labels=labels,
        )  # fmt: skip
        up = GaugeMetricFamily(
            "relaybox_outbox_sample_ok", "1 if the last sample of the table succeeded",
            labels=labels,
        )  # fmt: skip
        now = time.monotonic()
        for processor in self._relay.processors:
            sample = processor.stats_sample
            if sample is None:
                continue
            up.add_metric([processor.name], 0 if sample.error else 1)
            sample_age = sample.age(now)
            if sample_age is not None:
                age.add_metric([processor.name], sample_age)
            if sample.stats is None:
                continue
            for status, count in sample.stats.by_status().items():  # zeros: no vanishing series
                messages.add_metric([processor.name, status], count)
            if sample.stats.oldest_pending_age is not None:
                oldest.add_metric([processor.name], sample.stats.oldest_pending_age)
            leases.add_metric([processor.name], sample.stats.active_leases)
            held.add_metric([processor.name], sample.stats.held)
            held_keys.add_metric([processor.name], sample.stats.held_keys)
        yield from (messages, oldest, leases, held, held_keys, age, up)

    def _target_metrics(self) -> Iterator[Metric]:
        labels = ["target"]
        outcomes = CounterMetricFamily(
            "relaybox_publish_messages",
            "Messages sent to a target, by what came of them (retried: a transient failure "
            "that counts an attempt; unavailable: handed back, no attempt counted)",
            labels=["target", "outcome"],
        )
        seconds = HistogramMetricFamily(
            "relaybox_publish_duration_seconds",
            "Time of one publish call, to the broker's confirmation",
            labels=labels,
        )
        lag = HistogramMetricFamily(
            "relaybox_delivery_lag_seconds",
            "From the creation of the first message of a publish call to its confirmation",
            labels=labels,
        )
        circuit = GaugeMetricFamily(
            "relaybox_circuit_state", "1 for the state the target's circuit is in",
            labels=["target", "state"],
        )  # fmt: skip
        connected = GaugeMetricFamily(
            "relaybox_target_connected",
            "1 once the target's broker was connected; 0 while the relay retries it",
            labels=labels,
        )
        unreachable = self._relay.unreachable
        states = self._relay.circuit_states()
        for target, counters in self._relay.target_counters().items():
            for outcome in TARGET_OUTCOMES:
                outcomes.add_metric([target, outcome], getattr(counters, outcome))
            seconds.add_metric([target], *_buckets(counters.publish_seconds))
            lag.add_metric([target], *_buckets(counters.lag_seconds))
            for state in CircuitState:
                circuit.add_metric([target, state.value], int(states.get(target) is state))
            connected.add_metric([target], int(f"target {target}" not in unreachable))
        yield from (outcomes, seconds, lag, circuit, connected)


def _buckets(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    buckets = [
        ("+Inf" if bound == float("inf") else repr(bound), float(count))
        for bound, count in histogram.cumulative()
    ]
    return buckets, histogram.sum


def render(relay: Relay) -> bytes:
    """The relay's metrics in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RelayCollector(relay))
    return generate_latest(registry)


def _version() -> str:
    from relaybox import __version__

    return __version__
