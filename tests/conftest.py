"""Test-suite settings.

* Every IR dump written during the tests must re-parse to the same text (checked by the driver
  when PCOMPILE_CHECK_ROUNDTRIP is set).
* Under CI (CI=true) hypothesis runs derandomized, so a CI result is reproducible; local runs
  keep exploring new examples.
"""

import os

from hypothesis import settings

os.environ.setdefault("PCOMPILE_CHECK_ROUNDTRIP", "1")

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
