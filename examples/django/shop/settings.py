"""The shop example's settings: Django's minimum, and relaybox's."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-a-secret")
INSTALLED_APPS = ["relaybox.integrations.django", "shop"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", BASE_DIR / "shop.db"),
    }
}
if os.environ.get("SHOP_POSTGRES"):  # a PostgreSQL database of this name instead
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["SHOP_POSTGRES"],
        "HOST": "127.0.0.1",
        "USER": "postgres",
    }
if os.environ.get("SHOP_MYSQL"):  # a MariaDB or MySQL database of this name instead
    import pymysql

    pymysql.install_as_MySQLdb()  # Django's MySQL backend over PyMySQL, not mysqlclient
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": os.environ["SHOP_MYSQL"],
        "HOST": "127.0.0.1",
        "USER": "root",
    }
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

RELAYBOX = {
    "OUTBOX_TABLE": "shop_outbox",
    "BROKERS": {"default": os.environ.get("SHOP_BROKER", "nats://127.0.0.1:4222")},
    "RELAY": {"hold_keys": True},
}
