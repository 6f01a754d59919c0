"""URLs in logs and reports."""

from __future__ import annotations

import urllib.parse


def mask_password(url: str) -> str:
    """Any URL (database or broker) with its password replaced, for logs and reports."""
    password = urllib.parse.urlsplit(url).password
    if not password:
        return url
    return url.replace(f":{password}@", ":***@", 1).replace(
        f":{urllib.parse.unquote(password)}@", ":***@", 1
    )
