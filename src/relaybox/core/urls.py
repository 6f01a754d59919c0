"""URLs in logs and reports."""

from __future__ import annotations

import re
import urllib.parse

#: `//user:password@` at the start of a URL's authority.
_USERINFO = re.compile(r"(//[^/@:]*:)[^/@]*@")


def mask_password(url: str) -> str:
    """Any URL (database or broker) with its password replaced, for logs and reports."""
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:  # a URL urllib cannot take apart (an unclosed [IPv6] bracket)
        return _USERINFO.sub(r"\1***@", url, count=1)
    if not password:
        return url
    return url.replace(f":{password}@", ":***@", 1).replace(
        f":{urllib.parse.unquote(password)}@", ":***@", 1
    )
