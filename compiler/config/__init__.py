"""The compiler's configuration room: MindSpore's context settings (`set_auto_parallel_context`,
`set_context`, the search's cost-model and algorithm parameters), their checks, the typed options
they become (`ParallelOptions`, `PassOptions`) and `Layout`. It imports nothing else of
pcompile.compiler: the front end and the driver read it, never the other way round."""
