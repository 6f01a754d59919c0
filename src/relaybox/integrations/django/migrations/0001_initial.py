"""relaybox's outbox and inbox tables as relaybox 0.1 builds them (outbox schema
version 3, inbox schema version 2), with relaybox's own DDL for the database's vendor."""

from django.db import migrations

from relaybox.integrations.django.schema import ApplySchema


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [ApplySchema("outbox", 3), ApplySchema("inbox", 2)]
