"""The operator's web console: a JSON API and a page in the browser over the operations
module (relaybox.operations.messages), so that it, the command line and any script see
and change messages the same way.

    from relaybox.console import create_app
    app = create_app([await Operations.open(db_url, "outbox")], token=token)

Starlette and uvicorn come with the `console` extra and load only when an application
is created.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relaybox.core.extras import needs_extras

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request

    from relaybox.operations.inboxes import InboxWatch
    from relaybox.operations.messages import Operations


def create_app(
    tables: Sequence[Operations],
    *,
    token: str | None = None,
    read_only: bool = False,
    inboxes: Sequence[InboxWatch] = (),
    authorize: Callable[[Request], str | None] | None = None,
) -> Starlette:
    """The console of `tables` as an ASGI application, watching the consumers of
    `inboxes` too (`InboxWatch(db_url, table)` each). Changes need `token` (at least
    16 characters): sent as `Authorization: Bearer <token>`, or typed into the page's
    sign-in form. Mounted in an application that authenticates its users, `authorize`
    may take its word instead: given the request, it names the user allowed to change
    messages (the actor of their audit records) or gives None; the browser's changes
    still need the page's CSRF token and the console's own origin. Without a token or
    `authorize`, or with `read_only`, the console changes nothing."""
    with needs_extras("the console"):
        from relaybox.console.app import build

    return build(tables, token=token, read_only=read_only, inboxes=inboxes, authorize=authorize)
