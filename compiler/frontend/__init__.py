"""The compiler's front end: what a model file calls and how its calls become a graph. The user
API (`Tensor`, `Parameter`, `nn`, `ops`, `mint`, `amp`, `communication`, the dataset API,
`Model` and its callbacks, initializers, checkpoints and their name maps), tracing
(tracing.py, primitive.py, the training step, custom bprops, the optimizer's update) and the
ops' front-end pieces (functional.py, dropout, batch norm, morph, ragged). It imports
compiler/config/; the driver (compiler/driver/) imports it, never the other way round.

Model files reach these modules through `pcompile` (`pcompile.nn`, `pcompile.ops`, ...), whose
aliases name them here; their paths inside the package may change."""
