"""Messages, plans and audit records as JSON-ready dicts: the one shape the command
line's `--json` and the console's API both print.

Text in them came from anywhere (keys, headers, payloads, a broker's errors); it is
returned as it is, and each printer escapes it for where it goes (a terminal, HTML).
"""

from __future__ import annotations

import binascii
import datetime
import json
from typing import Any

from relaybox.core.inspection import AuditRecord, MessageSummary
from relaybox.operations.messages import MessageView, Outcome

#: The most payload bytes a view shows; the rest is counted, not shown.
PAYLOAD_SHOWN = 64 * 1024


def _time(value: datetime.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def summary(message: MessageSummary) -> dict[str, Any]:
    return {
        "seq": message.seq, "id": str(message.id), "state": message.state.value,
        "target": message.target, "topic": message.topic, "key": message.key,
        "type": message.type, "attempts": message.attempts,
        "created_at": _time(message.created_at), "available_at": _time(message.available_at),
        "occurred_at": _time(message.occurred_at),
        "published_at": _time(message.published_at),
        "abandoned_at": _time(message.abandoned_at), "last_error": message.last_error,
        "correlation_id": message.correlation_id,
    }  # fmt: skip


def payload(content_type: str, body: bytes) -> dict[str, Any]:
    """How to show a payload: `json` (pretty-printed) when the content type says JSON
    and it parses, `text` when it is UTF-8, else `hex`; at most PAYLOAD_SHOWN bytes."""
    shown, size = body[:PAYLOAD_SHOWN], len(body)
    cut = size > PAYLOAD_SHOWN
    base = {"content_type": content_type, "size": size, "truncated": cut}
    media = content_type.split(";", 1)[0].strip().lower()
    if not cut and (media == "application/json" or media.endswith("+json")):
        try:
            parsed = json.loads(body)
        except ValueError:
            pass
        else:
            return {
                **base,
                "kind": "json",
                "text": json.dumps(parsed, indent=2, ensure_ascii=False),
            }
    try:
        text = shown.decode("utf-8")
    except UnicodeDecodeError:
        return {**base, "kind": "hex", "text": binascii.hexlify(shown, " ", 1).decode()}
    return {**base, "kind": "text", "text": text}


def message(view: MessageView) -> dict[str, Any]:
    detail = view.detail
    found = summary(detail.summary)
    found.update({
        "external": detail.external, "partition": detail.partition,
        "headers": dict(detail.headers), "causation_id": detail.causation_id,
        "tenant_id": detail.tenant_id, "aggregate_id": detail.aggregate_id,
        "locked_by": detail.locked_by, "locked_until": _time(detail.locked_until),
        "payload": payload(detail.content_type, detail.payload),
    })  # fmt: skip
    queue = view.queue
    found["queue"] = None if queue is None else {
        "ahead": [summary(m) for m in queue.ahead],
        "behind": [summary(m) for m in queue.behind],
        "more_behind": queue.more_behind,
        "published_after": [summary(m) for m in queue.published_after],
    }  # fmt: skip
    return found


def outcome(result: Outcome) -> dict[str, Any]:
    plan = result.plan
    return {
        "action": plan.action.value, "dry_run": result.dry_run, "matched": plan.count,
        "changed": result.changed, "seqs": plan.seqs,
        "keys": [{"target": target, "key": key} for target, key in plan.keys],
        "published_ahead": [summary(m) for m in plan.published_ahead],
    }  # fmt: skip


def audit(record: AuditRecord) -> dict[str, Any]:
    return {
        "id": record.id, "at": _time(record.at), "actor": record.actor,
        "action": record.action.value, "reason": record.reason, "seq": record.seq,
        "message_id": str(record.message_id), "target": record.target, "key": record.key,
    }  # fmt: skip
