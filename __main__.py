"""`python -m pcompile MODEL.py ...`: the command line."""

from pcompile.cli import main

main()
