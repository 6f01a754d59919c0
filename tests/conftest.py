from __future__ import annotations

import pytest

from tests import hypothesis_profiles  # noqa: F401 - registers and loads the profile
from tests.databases import MYSQL_URL, PG_URL


@pytest.fixture(scope="session")
def pg_url() -> str:
    return PG_URL


@pytest.fixture(scope="session")
def mysql_url() -> str:
    return MYSQL_URL
