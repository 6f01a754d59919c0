"""Hypothesis profiles for every property test (tests/conftest.py loads them): a few
hundred examples a property in every test run (seconds), many thousands under
`make fuzz` (RELAYBOX_FUZZ=1, about five minutes for all of them; RELAYBOX_FUZZ_EXAMPLES
sets how many a property gets).

No example database, and hypothesis' caches in a temporary directory removed at exit:
a test run leaves nothing behind. A failure prints the example and the
`@reproduce_failure` line that replays it.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

_CACHES = tempfile.TemporaryDirectory(prefix="relaybox-hypothesis-")  # removed at exit
set_hypothesis_home_dir(_CACHES.name)

settings.register_profile(
    "relaybox",
    max_examples=200,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "relaybox-fuzz",
    parent=settings.get_profile("relaybox"),
    max_examples=int(os.environ.get("RELAYBOX_FUZZ_EXAMPLES", "4000")),
)
settings.load_profile("relaybox-fuzz" if os.environ.get("RELAYBOX_FUZZ") else "relaybox")
