"""Shared test set-up: hypothesis profiles.

`ci` (the default) keeps the suite within CI's budget on 2 cores; run the long one
with KVSCHED_HYPOTHESIS=long for a deeper search.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("KVSCHED_HYPOTHESIS", "ci"))
