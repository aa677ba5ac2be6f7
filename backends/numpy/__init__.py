"""The numpy reference interpreter: the oracle every plan is checked against. One rank runs
through `ir.interpret` (the op loop); `simulate` runs every rank of a plan in one process with
simulated collectives, `pipeline` a pipeline program's stages."""

from pcompile.ir.interpret import Collectives, SingleRank, run_graph

__all__ = ["Collectives", "SingleRank", "run_graph"]
