"""The numpy reference interpreter: the oracle every plan is checked against."""

from pcompile.backends.numpy.interpreter import Collectives, SingleRank, run_graph

__all__ = ["Collectives", "SingleRank", "run_graph"]
