"""The Django app's configuration: checks `settings.RELAYBOX` when Django starts."""

from __future__ import annotations

from django.apps import AppConfig

from relaybox.integrations.django.conf import settings


class RelayboxConfig(AppConfig):  # type: ignore[misc]
    name = "relaybox.integrations.django"
    label = "relaybox"
    verbose_name = "relaybox"

    def ready(self) -> None:
        settings()  # a typo in RELAYBOX stops the project here, not at the first message
