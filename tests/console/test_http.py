"""The console's HTTP layer on its own: who may change what (token, session cookie, CSRF
token, origin, read-only), the shapes of its answers and its refusals of bad requests.
A small stand-in for the operations records what the layer asks of them; the console
over real tables is tested in the browser (test_browser.py)."""

from __future__ import annotations

import dataclasses
import datetime
import time
import uuid
import warnings
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

with warnings.catch_warnings():  # newer starlettes ask for httpx2 here; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from relaybox.console import create_app, guard
from relaybox.console.guard import SESSION_SECONDS
from relaybox.console.views import filter_of
from relaybox.core.inspection import (
    AuditAction,
    Change,
    MessageDetail,
    MessageFilter,
    MessageState,
    MessageSummary,
    RelayMember,
    TargetStuck,
)
from relaybox.core.lifecycle import Status
from relaybox.core.records import OutboxStats
from relaybox.errors import ConfigurationError
from relaybox.operations.messages import KeyQueue, MessageView, Outcome, Page, Plan
from relaybox.operations.views import payload

TOKEN = "a-console-token-of-some-length"
HOST = "http://testserver"
NOW = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC)


def summary(seq: int, key: str | None = "k", state: MessageState = MessageState.ABANDONED) -> Any:
    return MessageSummary(
        seq=seq, id=uuid.UUID(int=seq), state=state, target="default", topic="orders",
        key=key, type="order.created", attempts=1, created_at=NOW, available_at=None,
        occurred_at=NOW, published_at=None, abandoned_at=NOW, last_error="refused",
        correlation_id=None,
    )  # fmt: skip


@dataclasses.dataclass
class FakeOperations:
    """What the HTTP layer asks of a table, recorded; answers are fixed."""

    name: str = "sqlite:///tmp/x.db outbox"
    searches: list[tuple[MessageFilter | None, dict[str, Any]]] = dataclasses.field(
        default_factory=list
    )
    acts: list[tuple[AuditAction, Any, Change, bool]] = dataclasses.field(default_factory=list)

    async def stats(self) -> OutboxStats:
        return OutboxStats({Status.ABANDONED: 2}, None, 0, {"default": 1})

    async def search(self, where: MessageFilter | None = None, **options: Any) -> Page:
        self.searches.append((where, options))
        return Page([summary(7)], None)

    async def show(self, seq: int) -> MessageView | None:
        if seq != 7:
            return None
        detail = MessageDetail(
            summary=summary(7), external=False, partition=3, content_type="application/json",
            payload=b'{"a": 1}', headers={"h": "v"}, causation_id=None, tenant_id=None,
            aggregate_id=None, locked_by=None, locked_until=None,
        )  # fmt: skip
        return MessageView(
            detail, KeyQueue([], [summary(8, state=MessageState.PENDING)], False, [])
        )

    async def act(
        self, action: AuditAction, selection: Any, change: Change, *, dry_run: bool = False,
        delay: float = 0.0,
    ) -> Outcome:  # fmt: skip
        self.acts.append((action, selection, change, dry_run))
        plan = Plan(action, [7], [("default", "k")], [summary(9, state=MessageState.PUBLISHED)])
        return Outcome(plan, 0 if dry_run else 1, dry_run)

    async def relays(self) -> list[RelayMember]:
        return [RelayMember("relay-1", "default", NOW, NOW, (0, 2))]

    async def stuck(self) -> list[TargetStuck]:
        return [TargetStuck("default", 0, 0, 1, NOW)]

    async def audit(self, *, limit: int = 50, before: int | None = None) -> list[Any]:
        return []


def client(fake: FakeOperations, **options: Any) -> TestClient:
    options.setdefault("token", TOKEN)
    return TestClient(create_app([fake], **options), base_url=HOST)  # type: ignore[list-item]


REPLAY = {"seqs": [7], "actor": "ana", "reason": "schema fixed"}
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def altered(token: str) -> str:
    """The token with its last character changed (never left as it was)."""
    return token[:-1] + ("1" if token.endswith("0") else "0")


def signed_in(http: TestClient, token: str = TOKEN) -> str:
    """Sign in like the page does; the session's CSRF token."""
    answer = http.post("/api/login", json={"token": token}, headers={"Origin": HOST})
    assert answer.status_code == 200, answer.text
    session = http.get("/api/session").json()
    assert session["signed_in"]
    csrf: str = session["csrf"]
    return csrf


def test_the_token_as_a_bearer_changes_and_a_wrong_one_or_none_does_not() -> None:
    fake = FakeOperations()
    http = client(fake)
    assert http.post("/api/tables/0/actions/replay", json=REPLAY, headers=BEARER).status_code == 200
    wrong = {"Authorization": "Bearer a-console-token-of-some-lengtX"}
    assert http.post("/api/tables/0/actions/replay", json=REPLAY, headers=wrong).status_code == 401
    assert http.post("/api/tables/0/actions/replay", json=REPLAY).status_code == 401
    assert [(a, s, c.actor, d) for a, s, c, d in fake.acts] == [
        (AuditAction.REPLAY, [7], "ana", False)
    ]


def test_the_session_cookie_is_httponly_strict_and_scoped_to_the_console() -> None:
    http = client(FakeOperations())
    answer = http.post("/api/login", json={"token": TOKEN}, headers={"Origin": HOST})
    cookie = answer.headers["set-cookie"].lower()
    assert "httponly" in cookie
    assert "samesite=strict" in cookie
    assert "path=/;" in cookie
    assert TOKEN not in answer.headers["set-cookie"]
    wrong = http.post("/api/login", json={"token": TOKEN[:-1]}, headers={"Origin": HOST})
    assert wrong.status_code == 401


def test_a_browser_change_needs_the_csrf_token_and_the_consoles_origin() -> None:
    fake = FakeOperations()
    http = client(fake)
    csrf = signed_in(http)
    url = "/api/tables/0/actions/replay"
    refused = [
        http.post(url, json=REPLAY, headers={"Origin": HOST}),  # no CSRF token
        http.post(url, json=REPLAY, headers={"Origin": HOST, "X-CSRF-Token": altered(csrf)}),
        http.post(
            url, json=REPLAY, headers={"Origin": "http://evil.example", "X-CSRF-Token": csrf}
        ),
        http.post(url, json=REPLAY, headers={"X-CSRF-Token": csrf}),  # neither Origin nor Referer
        http.post(url, json=REPLAY, headers={"Origin": "null", "X-CSRF-Token": csrf}),
    ]
    assert [answer.status_code for answer in refused] == [403] * 5
    assert fake.acts == []
    by_referer = http.post(url, json=REPLAY, headers={"Referer": f"{HOST}/", "X-CSRF-Token": csrf})
    assert by_referer.status_code == 200
    assert len(fake.acts) == 1


def test_a_backfill_from_the_browser_needs_the_csrf_token_and_the_consoles_origin() -> None:
    http = client(FakeOperations())
    csrf = signed_in(http)
    body = {"name": "late", "filter": {"target": "default"}, "to": "late", "actor": "ana",
            "dry_run": True}  # fmt: skip
    url = "/api/tables/0/backfills"
    refused = [
        http.post(url, json=body, headers={"Origin": HOST}),
        http.post(url, json=body, headers={"Origin": "http://evil.example", "X-CSRF-Token": csrf}),
        http.post(url, json=body, headers={"X-CSRF-Token": csrf}),
    ]
    assert [answer.status_code for answer in refused] == [403] * 3
    assert "CSRF" in refused[0].json()["error"]


def test_a_forged_or_foreign_session_cookie_is_not_a_session() -> None:
    fake = FakeOperations()
    other = client(FakeOperations(), token="another-token-of-some-length")
    signed_in(other, "another-token-of-some-length")
    http = client(fake)
    http.cookies.set("relaybox_console", other.cookies["relaybox_console"])
    assert http.get("/api/session").json()["signed_in"] is False
    answer = http.post(
        "/api/tables/0/actions/replay", json=REPLAY, headers={"Origin": HOST, "X-CSRF-Token": "x"}
    )
    assert answer.status_code == 401
    assert fake.acts == []


def test_a_session_ends_after_its_time_and_on_signing_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeOperations()
    http = client(fake)
    csrf = signed_in(http)
    later = time.time() + SESSION_SECONDS + 1
    monkeypatch.setattr(guard.time, "time", lambda: later)
    assert http.get("/api/session").json()["signed_in"] is False
    answer = http.post(
        "/api/tables/0/actions/replay", json=REPLAY, headers={"Origin": HOST, "X-CSRF-Token": csrf}
    )
    assert answer.status_code == 401
    monkeypatch.undo()
    signed_in(http)
    out = http.post("/api/logout", json={}, headers={"Origin": HOST})
    assert out.status_code == 200
    assert 'relaybox_console=""' in out.headers["set-cookie"]
    assert http.get("/api/session").json()["signed_in"] is False
    assert fake.acts == []


def test_signing_in_from_another_origin_is_refused() -> None:
    http = client(FakeOperations())
    answer = http.post("/api/login", json={"token": TOKEN}, headers={"Origin": "http://evil"})
    assert answer.status_code == 403
    assert "set-cookie" not in answer.headers


@pytest.mark.parametrize(
    "options", [{"read_only": True}, {"token": None}], ids=["read-only", "no-token"]
)
def test_read_only_refuses_every_change_even_with_the_token(options: dict[str, Any]) -> None:
    fake = FakeOperations()
    http = client(fake, **options)
    for action in ("replay", "discard", "delay", "expedite", "hold", "release"):
        answer = http.post(f"/api/tables/0/actions/{action}", json=REPLAY, headers=BEARER)
        assert answer.status_code == 403, action
        assert "read-only" in answer.json()["error"]
    assert (
        http.post("/api/login", json={"token": TOKEN}, headers={"Origin": HOST}).status_code == 403
    )
    session = http.get("/api/session").json()
    assert (session["changes"], session["csrf"]) == (False, None)
    assert fake.acts == []


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("state=stuck", 'state "stuck": one of pending'),
        ("min_seq=abc", 'min_seq "abc": a whole number'),
        ("max_seq=0", "max_seq 0: a whole number"),
        ("min_seq=5&max_seq=2", "min_seq 5 is above max_seq 2"),
        ("since=yesterday", 'since "yesterday": an ISO 8601 time'),
        ("id=not-a-uuid", 'id "not-a-uuid": not a UUID'),
        ("limit=0", "limit 0: a whole number from 1 to 1000"),
        ("limit=5000", "limit 5000"),
        ("order=sideways", 'order "sideways": newest or oldest'),
        ("after=-1", 'after "-1"'),
        ("key=a&key=b", "key: give it once"),
        (f"key={'x' * 1001}", "key: at most 1000 characters"),
    ],
)
def test_a_bad_search_value_is_a_400_that_says_what_is_wrong(query: str, says: str) -> None:
    answer = client(FakeOperations()).get(f"/api/tables/0/messages?{query}")
    assert answer.status_code == 400
    assert says in answer.json()["error"]


def test_every_filter_field_reaches_the_search() -> None:
    fake = FakeOperations()
    ident = uuid.uuid4()
    query = (
        "state=abandoned&state=held&target=t&topic=o&key=k&type=y"
        f"&id={ident}&correlation_id=c&causation_id=d&tenant_id=n&aggregate_id=g"
        "&min_seq=2&max_seq=9&since=2024-05-01T00:00:00Z&until=2024-05-02T00:00:00"
        "&order=oldest&limit=10&after=3"
    )
    assert client(fake).get(f"/api/tables/0/messages?{query}").status_code == 200
    where, options = fake.searches[-1]
    assert where == MessageFilter(
        states=frozenset({MessageState.ABANDONED, MessageState.HELD}), target="t", topic="o",
        key="k", type="y", id=ident, correlation_id="c", causation_id="d", tenant_id="n",
        aggregate_id="g", min_seq=2, max_seq=9,
        since=datetime.datetime(2024, 5, 1, tzinfo=datetime.UTC),
        until=datetime.datetime(2024, 5, 2, tzinfo=datetime.UTC),
    )  # fmt: skip
    assert options == {"limit": 10, "after": 3, "newest_first": False}


def test_bad_action_requests_are_400s_and_change_nothing() -> None:
    fake = FakeOperations()
    http = client(fake)
    bad = [
        ("replay", {"actor": "ana"}),  # names nothing
        ("replay", {"seqs": [7], "filter": {"key": "k"}, "actor": "ana"}),
        ("replay", {"filter": {}, "actor": "ana"}),  # the whole table
        ("replay", {"filter": {"colour": "red"}, "actor": "ana"}),
        ("replay", {"seqs": ["7; drop"], "actor": "ana"}),
        ("replay", {"seqs": [7], "actor": " "}),
        ("replay", {"seqs": [7], "actor": "ana", "dry_run": "yes"}),
        ("delay", {"seqs": [7], "actor": "ana", "delay": "soon"}),
        ("backfill", {"seqs": [7], "actor": "ana"}),
    ]
    for action, body in bad:
        answer = http.post(f"/api/tables/0/actions/{action}", json=body, headers=BEARER)
        assert answer.status_code == 400, (action, body, answer.text)
        assert answer.json()["error"]
    not_json = http.post(
        "/api/tables/0/actions/replay",
        content=b"{",
        headers={**BEARER, "Content-Type": "application/json"},
    )
    assert not_json.status_code == 400
    assert fake.acts == []


def test_a_dry_run_answers_the_plan_and_a_filter_reaches_the_action() -> None:
    fake = FakeOperations()
    body = {"filter": {"key": "k", "state": ["abandoned"]}, "actor": "ana", "dry_run": True}
    answer = client(fake).post("/api/tables/0/actions/replay", json=body, headers=BEARER)
    assert answer.status_code == 200
    found = answer.json()
    assert (found["dry_run"], found["matched"], found["changed"], found["seqs"]) == (
        True,
        1,
        0,
        [7],
    )
    assert found["keys"] == [{"target": "default", "key": "k"}]
    assert [m["seq"] for m in found["published_ahead"]] == [9]
    ((action, selection, change, dry_run),) = fake.acts
    assert selection == MessageFilter(states=frozenset({MessageState.ABANDONED}), key="k")
    assert (action, change.actor, dry_run) == (AuditAction.REPLAY, "ana", True)


def test_tables_message_and_missing_message_shapes() -> None:
    http = client(FakeOperations())
    (table,) = http.get("/api/tables").json()["tables"]
    assert table["name"] == "sqlite:///tmp/x.db outbox"
    assert table["counts"]["abandoned"] == 2
    assert table["targets"] == {
        "default": {"live": 1, "retrying": 0, "held": 0, "abandoned": 1,
                    "stuck_since": NOW.isoformat()},
    }  # fmt: skip
    assert table["held"] == 0
    assert table["relays"] == [{
        "worker": "relay-1", "target": "default", "joined_at": NOW.isoformat(),
        "lease_until": NOW.isoformat(), "partitions": [0, 2],
    }]  # fmt: skip
    found = http.get("/api/tables/0/messages/7").json()
    assert found["payload"]["kind"] == "json"
    assert [m["seq"] for m in found["queue"]["behind"]] == [8]
    assert http.get("/api/tables/0/messages/8").status_code == 404
    assert http.get("/api/tables/1/messages/7").status_code == 404


def test_mounted_under_a_prefix_every_url_is_relative() -> None:
    app = Starlette(routes=[Mount("/ops", create_app([FakeOperations()], token=TOKEN))])  # type: ignore[list-item]
    http = TestClient(app, base_url=HOST)
    page = http.get("/ops/")
    assert page.status_code == 200
    assert 'src="static/console.js"' in page.text
    assert 'href="static/console.css"' in page.text
    assert "'self'" in page.headers["content-security-policy"]
    assert http.get("/ops/static/console.js").status_code == 200
    assert http.get("/ops/api/tables").json()["tables"][0]["index"] == 0
    login = http.post("/ops/api/login", json={"token": TOKEN}, headers={"Origin": HOST})
    assert "path=/ops/" in login.headers["set-cookie"].lower()
    script = http.get("/ops/static/console.js").text
    assert 'fetch("/' not in script
    assert "innerHTML" not in script


def test_no_answer_carries_the_token() -> None:
    http = client(FakeOperations())
    csrf = signed_in(http)
    url = "/api/tables/0/actions/replay"
    answers = [
        http.get("/"),
        http.get("/api/session"),
        http.get("/api/tables"),
        http.get("/api/tables/0/messages/7"),
        http.post(url, json=REPLAY, headers={"Origin": HOST, "X-CSRF-Token": csrf}),
        http.post(url, json=REPLAY, headers={"Authorization": "Bearer x"}),
    ]
    for answer in answers:
        assert TOKEN not in answer.text
        assert TOKEN not in str(answer.headers)


def test_a_short_token_or_no_table_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="16 characters"):
        create_app([FakeOperations()], token="short")  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="at least one table"):
        create_app([], token=TOKEN)


def test_payloads_show_as_json_text_or_hex() -> None:
    assert payload("application/json", b'{"a":1}')["text"] == '{\n  "a": 1\n}'
    assert payload("application/json", b"{not json")["kind"] == "text"
    assert payload("text/plain", "héllo".encode())["text"] == "héllo"
    assert payload("application/octet-stream", b"\xff\x00")["text"] == "ff 00"


def test_an_empty_query_value_is_a_field_not_given() -> None:
    assert filter_of({"key": [""], "state": [""]}) == MessageFilter()


# -- the host application's authentication -------------------------------------------------


def host_user(request: Any) -> str | None:
    """A host application's word on who the request's user is: here its own cookie, as
    an application's session middleware would have checked it."""
    user: str | None = request.cookies.get("host_session")
    return user


def host_client(fake: FakeOperations, **options: Any) -> TestClient:
    return client(fake, token=None, authorize=host_user, **options)


def test_a_host_authorized_user_changes_as_themselves_with_the_page_s_csrf_token() -> None:
    fake = FakeOperations()
    http = host_client(fake)
    http.cookies.set("host_session", "ana@example.com")
    session = http.get("/api/session").json()
    assert (session["changes"], session["signed_in"], session["host_user"]) == (
        True, True, "ana@example.com",
    )  # fmt: skip
    headers = {"Origin": HOST, "X-CSRF-Token": session["csrf"]}
    body = {**REPLAY, "actor": "someone else"}
    answer = http.post("/api/tables/0/actions/replay", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    ((_, _, change, _),) = fake.acts
    assert change == Change("ana@example.com", "schema fixed")  # the host's user, not the body's


def test_a_host_authorized_change_without_the_csrf_token_or_from_elsewhere_is_refused() -> None:
    fake = FakeOperations()
    http = host_client(fake)
    http.cookies.set("host_session", "ana@example.com")
    csrf = http.get("/api/session").json()["csrf"]
    other = guard.Guard(None, False, host_user).host_csrf("ana@example.com")  # another start
    refused = [
        {"Origin": HOST},
        {"Origin": HOST, "X-CSRF-Token": other},
        {"Origin": "http://evil.example", "X-CSRF-Token": csrf},
        {"X-CSRF-Token": csrf},
    ]
    for headers in refused:
        answer = http.post("/api/tables/0/actions/replay", json=REPLAY, headers=headers)
        assert answer.status_code == 403, (headers, answer.text)
    http.cookies.set("host_session", "bo@example.com")  # ana's token is not bo's
    answer = http.post(
        "/api/tables/0/actions/replay", json=REPLAY, headers={"Origin": HOST, "X-CSRF-Token": csrf}
    )
    assert answer.status_code == 403
    assert fake.acts == []


def test_without_the_host_s_word_nothing_changes_and_read_only_still_wins() -> None:
    fake = FakeOperations()
    http = host_client(fake)
    session = http.get("/api/session").json()
    assert (session["changes"], session["signed_in"], session["host_user"]) == (True, False, None)
    answer = http.post("/api/tables/0/actions/replay", json=REPLAY, headers={"Origin": HOST})
    assert answer.status_code == 401
    assert "authentication does not allow" in answer.json()["error"]
    read_only = host_client(fake, read_only=True)
    read_only.cookies.set("host_session", "ana@example.com")
    assert read_only.get("/api/session").json()["changes"] is False
    answer = read_only.post("/api/tables/0/actions/replay", json=REPLAY, headers={"Origin": HOST})
    assert answer.status_code == 403
    assert fake.acts == []


def test_the_token_still_works_beside_the_host_s_authentication() -> None:
    fake = FakeOperations()
    http = client(fake, authorize=host_user)
    answer = http.post("/api/tables/0/actions/replay", json=REPLAY, headers=BEARER)
    assert answer.status_code == 200, answer.text
    ((_, _, change, _),) = fake.acts
    assert change.actor == "ana"  # a script names its actor
