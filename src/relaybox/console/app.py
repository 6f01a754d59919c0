"""The console as one Starlette application: the JSON API under /api and the page that
calls it. Every URL the page uses is relative, so the application runs mounted under
any prefix of another application.

Reading is open to whoever reaches the application (it binds to 127.0.0.1 unless told
otherwise; mount it behind your own application's authentication to share it);
changing needs the token (see relaybox.console.guard).
"""

from __future__ import annotations

import datetime
import importlib.resources
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relaybox.console import views
from relaybox.console.backfills import Backfills
from relaybox.console.guard import COOKIE, SESSION_SECONDS, Authorize, Guard, same_origin
from relaybox.errors import ConfigurationError, RelayboxError, StorageError
from relaybox.operations import views as shapes
from relaybox.operations import watch
from relaybox.operations.inboxes import InboxWatch
from relaybox.operations.messages import Operations

#: The largest request body read (an action names at most views.MAX_NAMED seqs).
MAX_BODY = 256 * 1024
#: Sent with every answer: the page loads its script and style from this application
#: only, runs no inline script, and may not be framed by another page.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}
_ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "static/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "static/console.css": ("console.css", "text/css; charset=utf-8"),
}


Handler = Callable[[Request], Awaitable[Response]]


def build(
    tables: Sequence[Operations],
    *,
    token: str | None,
    read_only: bool,
    inboxes: Sequence[InboxWatch] = (),
    authorize: Authorize | None = None,
) -> Starlette:
    if not tables:
        raise ConfigurationError("the console needs at least one table")
    if token is not None and len(token) < 16:
        raise ConfigurationError("a console token has at least 16 characters")
    api = _Api(list(tables), list(inboxes), Guard(token, read_only, authorize))
    routes = [
        Route("/api/session", api.session),
        Route("/api/login", api.login, methods=["POST"]),
        Route("/api/logout", api.logout, methods=["POST"]),
        Route("/api/tables", api.tables),
        Route("/api/tables/{table:int}/messages", api.search),
        Route("/api/tables/{table:int}/messages/{seq:int}", api.message),
        Route("/api/tables/{table:int}/actions/{action}", api.act, methods=["POST"]),
        Route("/api/tables/{table:int}/audit", api.audit),
        Route("/api/tables/{table:int}/activity", api.activity),
        Route("/api/tables/{table:int}/backfills", api.backfill, methods=["POST"]),
        Route("/api/tables/{table:int}/backfills/{name:path}", api.backfill_status),
        Route("/api/inboxes", api.inboxes),
        Route("/api/inboxes/{inbox:int}/activity", api.inbox_activity),
        *(Route(f"/{path}", _asset(name, kind)) for path, (name, kind) in _ASSETS.items()),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: _http_error,
        RelayboxError: _relaybox_error,
        Exception: _unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.add_middleware(_SecurityHeaders)
    return app


class _Api:
    """The API's handlers over the tables' operations, table N being the Nth given, and
    over the inboxes watched, inbox N being the Nth given."""

    def __init__(self, tables: list[Operations], inboxes: list[InboxWatch], guard: Guard) -> None:
        self.operations = tables
        self.watched = inboxes
        self.guard = guard
        self.backfills = Backfills()

    # -- who is asking -----------------------------------------------------------------

    async def session(self, request: Request) -> Response:
        answer: dict[str, Any] = {
            "changes": self.guard.changes,
            "read_only_reason": None if self.guard.changes else self.guard.read_only_reason(),
            "host_user": None,
            # Whether the page offers the token's sign-in (not when only the host
            # application's authentication lets users change messages).
            "token_sign_in": self.guard.token is not None,
        }
        user = self.guard.host_user(request) if self.guard.changes else None
        if user is not None:
            answer.update(signed_in=True, csrf=self.guard.host_csrf(user), host_user=user)
            return JSONResponse(answer)
        nonce = self.guard.session_nonce(request.cookies.get(COOKIE))
        answer.update(
            signed_in=nonce is not None, csrf=None if nonce is None else self.guard.csrf(nonce)
        )
        return JSONResponse(answer)

    async def login(self, request: Request) -> Response:
        if not self.guard.changes:
            return _error(403, self.guard.read_only_reason())
        if not _from_here(request):
            return _error(403, "sign in from the console's own page")
        given = (await _body(request)).get("token")
        if not isinstance(given, str) or not self.guard.token_ok(given):
            return _error(401, "wrong token")
        response = JSONResponse({"signed_in": True})
        response.set_cookie(
            COOKIE,
            self.guard.new_session(),
            max_age=SESSION_SECONDS,
            path=_cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    async def logout(self, request: Request) -> Response:
        if not _from_here(request):
            return _error(403, "sign out from the console's own page")
        response = JSONResponse({"signed_in": False})
        response.delete_cookie(COOKIE, path=_cookie_path(request), httponly=True, samesite="strict")
        return response

    def refusal(self, request: Request) -> Response | None:
        """Why this request may not change anything; None when it may."""
        if not self.guard.changes:
            return _error(403, self.guard.read_only_reason())
        bearer = request.headers.get("authorization")
        if bearer is not None and self.guard.token is not None:
            return None if self.guard.bearer_ok(bearer) else _error(401, "wrong token")
        csrf = request.headers.get("x-csrf-token")
        user = self.guard.host_user(request)
        if user is not None:
            return _page_refusal(request, self.guard.host_csrf_ok(user, csrf))
        if self.guard.token is None:
            return _error(401, "the application's authentication does not allow this change")
        nonce = self.guard.session_nonce(request.cookies.get(COOKIE))
        if nonce is None:
            return _error(401, "sign in with the console's token first")
        return _page_refusal(request, self.guard.csrf_ok(nonce, csrf))

    def host_user(self, request: Request) -> str | None:
        """The user the host application authenticated, unless the request brings the
        console's token (then the body names the actor)."""
        if self.guard.token is not None and request.headers.get("authorization") is not None:
            return None
        return self.guard.host_user(request)

    # -- reading -----------------------------------------------------------------------

    async def tables(self, request: Request) -> Response:
        found = []
        for index, table in enumerate(self.operations):
            stats, stuck, relays = await table.stats(), await table.stuck(), await table.relays()
            found.append(views.table_json(index, table.name, stats, stuck, relays))
        return JSONResponse({"tables": found})

    async def search(self, request: Request) -> Response:
        table = self._table(request)
        query = _query(request)
        asked = views.search_of(query)
        page = await table.search(
            asked.where, limit=asked.limit, after=asked.after, newest_first=asked.newest_first
        )
        return JSONResponse(
            {
                "messages": [shapes.summary(row) for row in page.messages],
                "next_after": page.next_after,
            }
        )

    async def message(self, request: Request) -> Response:
        table = self._table(request)
        view = await table.show(request.path_params["seq"])
        if view is None:
            return _error(404, f"no message with seq {request.path_params['seq']}")
        return JSONResponse(shapes.message(view))

    async def audit(self, request: Request) -> Response:
        table = self._table(request)
        limit, before = views.audit_page_of(_query(request))
        records = await table.audit(limit=limit, before=before)
        more = len(records) == limit
        return JSONResponse(
            {
                "records": [shapes.audit(record) for record in records],
                "next_before": records[-1].id if more and records else None,
            }
        )

    async def activity(self, request: Request) -> Response:
        """The table's targets, a point per minute of the window, with the live relays'
        circuit state per target and the partitions each holds."""
        table = self._table(request)
        minutes = views.minutes_of(_query(request))
        series = await watch.outbox_activity(table.storage, _window_start(minutes))
        statuses = await watch.relay_statuses(table.storage)
        stats, relays = await table.stats(), await table.relays()
        return JSONResponse(
            {
                "minutes": minutes,
                "targets": watch.target_series_json(series),
                "statuses": watch.statuses_json(statuses),
                "relays": views.relays_json(relays),
                "oldest_pending_age": stats.oldest_pending_age,
                "held": stats.held,
                "held_keys": stats.held_keys,
            }
        )

    async def inboxes(self, request: Request) -> Response:
        return JSONResponse(
            {"inboxes": [{"index": n, "name": each.name} for n, each in enumerate(self.watched)]}
        )

    async def inbox_activity(self, request: Request) -> Response:
        """The inbox's consumers, a point per minute of the window, and how many of each
        one's messages are parked now."""
        index: int = request.path_params["inbox"]
        if index >= len(self.watched):
            raise HTTPException(404, f"no inbox {index}")
        inbox = self.watched[index]
        minutes = views.minutes_of(_query(request))
        series = await inbox.activity(_window_start(minutes))
        return JSONResponse(
            {
                "index": index,
                "name": inbox.name,
                "minutes": minutes,
                "consumers": watch.consumer_series_json(series),
                "parked_now": await inbox.parked_now(),
            }
        )

    async def backfill_status(self, request: Request) -> Response:
        table = self._table(request)
        index: int = request.path_params["table"]
        name: str = request.path_params["name"]
        job = await table.storage.backfill_job(name)
        running = self.backfills.running(index, name)
        if job is None and not running:
            return _error(404, f"no backfill named {views.shown(name)}")
        error = self.backfills.error(index, name)
        return JSONResponse(views.backfill_json(name, job, running, error))

    # -- changing ----------------------------------------------------------------------

    async def backfill(self, request: Request) -> Response:
        """A backfill's dry run (`dry_run`: true), or its start as a task of this
        process; its progress is read from backfill_status."""
        table = self._table(request)
        index: int = request.path_params["table"]
        refused = self.refusal(request)
        if refused is not None:
            return refused
        body = await _body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise ConfigurationError("dry_run: true or false")
        asked = views.backfill_of(body, self.host_user(request))
        if self.backfills.running(index, asked.name):
            return _error(409, f"backfill {views.shown(asked.name)} is running already")
        if dry_run:
            planned = await self.backfills.plan(table, asked)
            return JSONResponse(
                {
                    "plan": views.plan_json(planned.plan),
                    **views.backfill_json(asked.name, planned.job, False, None),
                }
            )
        self.backfills.start(index, table, asked)
        job = await table.storage.backfill_job(asked.name)
        return JSONResponse(views.backfill_json(asked.name, job, True, None), status_code=202)

    async def act(self, request: Request) -> Response:
        table = self._table(request)
        action = views.action_of(request.path_params["action"])
        refused = self.refusal(request)
        if refused is not None:
            return refused
        body = await _body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise ConfigurationError("dry_run: true or false")
        selection = views.selection_of(body)
        change = views.change_of(body, self.host_user(request))
        outcome = await table.act(
            action, selection, change, dry_run=dry_run, delay=views.delay_of(body)
        )
        return JSONResponse(shapes.outcome(outcome))

    def _table(self, request: Request) -> Operations:
        index: int = request.path_params["table"]
        if index >= len(self.operations):
            raise HTTPException(404, f"no table {index}")
        return self.operations[index]


def _window_start(minutes: int) -> datetime.datetime:
    """The start of a window of `minutes` minutes that ends now (the current minute
    counts as one)."""
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=minutes - 1)


def _query(request: Request) -> dict[str, list[str]]:
    query: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        query.setdefault(name, []).append(value)
    return query


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object, read up to MAX_BODY bytes."""
    if "json" not in request.headers.get("content-type", ""):
        raise ConfigurationError("send the request's body as application/json")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise ConfigurationError(f"a request's body is at most {MAX_BODY} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise ConfigurationError("the request's body is not JSON") from None
    if not isinstance(body, dict):
        raise ConfigurationError("the request's body is a JSON object")
    return body


def _from_here(request: Request) -> bool:
    headers = request.headers
    return same_origin(headers.get("host"), headers.get("origin"), headers.get("referer"))


def _page_refusal(request: Request, csrf_ok: bool) -> Response | None:
    """A change the browser asks for comes from the console's own page, with the CSRF
    token that page was given."""
    if not _from_here(request):
        return _error(403, "a change must come from the console's own page")
    if not csrf_ok:
        return _error(403, "missing or wrong CSRF token; reload the page")
    return None


def _cookie_path(request: Request) -> str:
    """The cookie goes to this application only, wherever it is mounted."""
    return (request.scope.get("root_path") or "").rstrip("/") + "/"


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return _error(error.status_code, str(error.detail))


async def _relaybox_error(request: Request, error: Exception) -> Response:
    """The database's trouble is a 503; every other relaybox error names what was wrong
    with the request (relaybox's messages carry masked URLs only)."""
    return _error(503 if isinstance(error, StorageError) else 400, str(error))


async def _unexpected(request: Request, error: Exception) -> Response:
    """Anything else is answered without its details, which could hold anything; the
    server logs it."""
    return _error(500, "the console failed; see its log")


def _asset(name: str, kind: str) -> Handler:
    content = importlib.resources.files("relaybox.console").joinpath("static", name).read_bytes()

    async def serve(request: Request) -> Response:
        return Response(content, media_type=kind)

    return serve


class _SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, sending)
