"""The room above the backends: what wires a compiled program to the outside world.

`compiler.driver.compile_program` returns a `CompiledProgram` and writes nothing; here it is
written out (`tools.compile`: dumps, plan.json, the rank programs), run in one process
(`tools.runners`: the numpy interpreter and simulator, the JAX lowering), checked against the
single-device program (`tools.oracle`) and checked on a shrunk copy (`tools.shrink`). The CLI and
the façade's `pcompile.compile` call these; nothing below (`compiler`, `passes`, `ir`, `backends`)
imports them."""
