"""Compiler passes, one module each."""
