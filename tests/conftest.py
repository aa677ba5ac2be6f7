"""Test-suite settings.

* Every IR dump written during the tests must re-parse to the same text (checked by the driver
  when PCOMPILE_CHECK_ROUNDTRIP is set), and the graph is verified after every pass
  (PCOMPILE_VERIFY_EACH; a plain compile verifies the traced and the final graph).
* Under CI (CI=true) hypothesis runs derandomized, so a CI result is reproducible; local runs
  keep exploring new examples.
* `pcompile show` lays piped output out for COLUMNS when it is set: the tests run without the
  shell's (a test that wants a width passes --width or its own COLUMNS).
"""

import os

from hypothesis import settings

os.environ.setdefault("PCOMPILE_CHECK_ROUNDTRIP", "1")
os.environ.setdefault("PCOMPILE_VERIFY_EACH", "1")
os.environ.pop("COLUMNS", None)

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
