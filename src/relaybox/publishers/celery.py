"""Celery tasks: each outbox message enqueued as one task, in Celery's own message format.

    celery+amqp://guest:guest@127.0.0.1:5672//?queue=celery
    celery+amqps://user:secret@rabbit.example.com/production?queue=billing
    celery+redis://127.0.0.1:6379/0?queue=celery
    celery+rediss://:secret@redis.example.com:6380/0

A task sent from the outbox is sent if and only if the writer's transaction commits,
and a broker that is down at commit time only delays it: the relay sends it when the
broker is back. (Celery's own `delay_on_commit` sends after the commit, from the
process that committed: a broker down then, or a crash between the two, loses it.)

Mapping a message to a task:

- task name: the message's `task` header if it has one, else its type; `Message(
  topic="tasks", type="billing.tasks.charge", payload=[42])` runs
  `billing.tasks.charge(42)`.
- arguments: the JSON payload; an array is the positional arguments, an object the
  keyword arguments, `null` (a Message without a payload) or an empty payload none.
  Anything else (a number, text that is not JSON) fails permanently: no retry could
  make it a call.
- task id: the message id. The relay delivers at least once: after a crash between
  the broker's confirm and the relay's record of it, the message is sent again, as the
  same task id. A task must therefore be idempotent, or run its effects through
  relaybox's inbox (docs/inbox.md) keyed by `self.request.id`.

Options (the rest of the URL goes to the broker's client as it is):

- `queue`: the Celery queue (default "celery", Celery's `task_default_queue`).
- `exchange`, `routing_key` (RabbitMQ): where the task is published, by default the
  queue's name for both, as Celery routes a task to a queue it declared itself.
- `declare` (RabbitMQ): true|false (default true): declare the exchange (direct), the
  queue (durable) and their binding when the relay starts, as Celery's own producer
  does before it publishes; false when the queue is declared elsewhere with arguments
  of its own (a quorum queue). `relaybox setup` declares them too.
- `timeout`: seconds for connecting and for a whole publish() call (default 5).

On the wire (Celery's task message protocol 2): headers `lang`, `task`, `id`,
`root_id` (the id), `parent_id`, `group`, `retries`, `eta`, `expires`, `timelimit`,
`argsrepr`, `kwargsrepr`, `origin` and `ignore_result`; the body the JSON array
`[args, kwargs, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`,
content type application/json, encoding utf-8; correlation id the task id; persistent.
On RabbitMQ it is published with publisher confirms (relaybox's AMQP publisher, its
outcomes too: a queue nobody bound fails permanently as unroutable). On Redis it is
kombu's Redis transport format, one JSON document per task pushed (LPUSH) onto the list
named after the queue, the body base64-encoded; Redis's reply is the confirm.

Why not kombu, Celery's own messaging library: it is synchronous, so every publish
would hold a thread of its own beside the relay's event loop, and on RabbitMQ it would
replace the confirms, reconnects and per-message failure classification that the AMQP
and Redis publishers already have with a second client to keep in step. The task
message is a small, documented format (a header dict and a JSON body); building it here
costs a few lines, and the tests run a real Celery worker against both brokers to hold
it to Celery's reading of it.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from relaybox.core.extras import needs_extras
from relaybox.core.records import StoredMessage
from relaybox.core.urls import mask_url
from relaybox.errors import ConfigurationError, MessageError
from relaybox.ports import Publisher
from relaybox.publishers.options import BrokerUrl

#: The message header that names the task, when the message type does not.
TASK_HEADER = "task"
DEFAULT_QUEUE = "celery"
CONTENT_TYPE = "application/json"
ENCODING = "utf-8"
#: The third element of a protocol 2 body: no callbacks, errbacks, chain or chord.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
#: Longest argsrepr/kwargsrepr, as Celery's own default (`argsrepr_maxsize`).
_REPR_MAX = 1024
#: The brokers a `celery+` URL may name.
_REDIS = frozenset({"redis", "rediss"})
_AMQP = frozenset({"amqp", "amqps"})


def from_url(url: BrokerUrl) -> Publisher:
    transport = url.scheme.partition("+")[2]
    if transport not in _REDIS | _AMQP:
        raise ConfigurationError(
            f"{mask_url(url.scheme)}:// is no Celery broker: use celery+amqp://, "
            "celery+amqps://, celery+redis:// or celery+rediss://"
        )
    base = transport + url.base.removeprefix(url.scheme)
    queue = url.text("queue", DEFAULT_QUEUE)
    if not queue:
        raise ConfigurationError("celery option queue= must name a queue")
    timeout = url.number("timeout", 5.0, minimum=0.1)
    origin = f"relaybox@{socket.gethostname()}"
    with needs_extras(f"the broker URL {url.scheme}://"):
        if transport in _REDIS:
            from relaybox.publishers.celery_redis import CeleryRedisPublisher

            return CeleryRedisPublisher(base, queue=queue, timeout=timeout, origin=origin)
        from relaybox.publishers.celery_amqp import celery_amqp

    return celery_amqp(
        base, queue=queue, exchange=url.text("exchange", queue),
        routing_key=url.text("routing_key", queue), declare=url.flag("declare", True),
        timeout=timeout, origin=origin,
    )  # fmt: skip


def task_message(message: StoredMessage, origin: str) -> tuple[dict[str, Any], bytes]:
    """The protocol 2 headers and body of the task `message` asks for.

    Raises MessageError for a message that names no task or whose payload is no call.
    """
    name = message.headers.get(TASK_HEADER) or message.type
    if not name:
        raise MessageError(f"message {message.id} names no task: give it a type or a task header")
    args, kwargs = _arguments(message)
    task_id = str(message.id)
    headers: dict[str, Any] = {
        "lang": "py", "task": name, "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": ascii(args)[:_REPR_MAX], "kwargsrepr": ascii(kwargs)[:_REPR_MAX],
        "origin": origin, "ignore_result": False,
    }  # fmt: skip
    # ASCII, as JSON escapes the rest: a lone surrogate that the payload's JSON escaped
    # stays escaped instead of making text that UTF-8 (and AMQP headers) cannot carry.
    body = json.dumps([args, kwargs, _EMBED], separators=(",", ":"))
    return headers, body.encode(ENCODING)


def _arguments(message: StoredMessage) -> tuple[list[Any], dict[str, Any]]:
    if not message.payload.strip():
        return [], {}
    try:
        value = json.loads(message.payload)
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep
        raise MessageError(f"message {message.id}: the payload is not JSON ({error})") from None
    if value is None:  # a Message without a payload
        return [], {}
    if isinstance(value, list):
        return value, {}
    if isinstance(value, dict):
        return [], value
    raise MessageError(
        f"message {message.id}: a task's payload is a JSON array (positional arguments) "
        f"or object (keyword arguments), not {type(value).__name__}"
    )
