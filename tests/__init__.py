"""The test suite, in rooms that mirror the package: ir/, passes/, compiler/, backends/, tools/
and e2e/ (whole runs through the CLI, the examples and the docs). Shared here: the model sources
under models/, op_harness.py, multiprocess.py and the subprocess workers."""

import os

#: The repository root (the package `pcompile`).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
