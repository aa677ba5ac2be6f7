"""The package version (read by pyproject.toml and `pcompile --version`)."""

__version__ = "0.2.0"
