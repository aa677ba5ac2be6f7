"""Test-suite settings: every IR dump written during the tests must re-parse to the same text
(checked by the driver when PCOMPILE_CHECK_ROUNDTRIP is set)."""

import os

os.environ.setdefault("PCOMPILE_CHECK_ROUNDTRIP", "1")
