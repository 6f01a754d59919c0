"""Django configured once per test process, with one alias per database."""

from __future__ import annotations

from pathlib import Path

from tests.databases import PG_URL

_configured = False


def configure(sqlite_path: Path) -> None:
    global _configured
    from django.conf import settings

    if not _configured:
        import django
        import pymysql

        pymysql.install_as_MySQLdb()  # Django's MySQL backend over PyMySQL

        settings.configure(
            DATABASES={
                "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_path)},
                "pg": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": PG_URL.rsplit("/", 1)[1],
                    "HOST": "127.0.0.1",
                    "PORT": 5432,
                    "USER": "postgres",
                },
                "mysql": {
                    "ENGINE": "django.db.backends.mysql",
                    "NAME": "test",
                    "HOST": "127.0.0.1",
                    "PORT": 3306,
                    "USER": "root",
                    "PASSWORD": "",
                },
            },
            INSTALLED_APPS=["relaybox.integrations.django", "tests.integration.djangoshop"],
            USE_TZ=True,
            DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        )
        django.setup()
        _configured = True
    # The sqlite file differs per test: point the alias at this test's file.
    from django.db import connections

    connections["default"].close()
    connections["default"].settings_dict["NAME"] = str(sqlite_path)
