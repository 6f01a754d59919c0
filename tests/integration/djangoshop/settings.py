"""Settings of the management commands the tests run as processes: the SQLite file and
the RELAYBOX setting come from the environment (RELAYBOX_TEST_SQLITE and, as JSON,
RELAYBOX_TEST_SETTINGS)."""

import json
import os

SECRET_KEY = "relaybox-tests"
INSTALLED_APPS = ["relaybox.integrations.django", "tests.integration.djangoshop"]
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["RELAYBOX_TEST_SQLITE"]}
}
RELAYBOX = json.loads(os.environ["RELAYBOX_TEST_SETTINGS"])
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
