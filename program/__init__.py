"""What passes from compiling to running (issue 37 move 1). The room sits above passes/ and
below the front end (ir/ <- passes/ <- program/ <- compiler/, tests/e2e/test_layering.py):

- `rank_program`: `RankProgram`, the typed, data-only program the compiler hands to the code
  generators (rank graphs, layouts, abstract initial values, pipeline program, run report);

and the run-time pieces a rank needs without the front end, which import `ir/` only:

- `init_math`, `initializers`: parameter data generated block by block from a seed ticket
  (the initializers, `InitializedData`, Philox and its float64 arithmetic);
- `pretrained`: a tensor of a safetensors file, checked against its recorded identity and read
  slice by slice;
- `dataset`: the dataset spec written into a rank program (`DATASET`) and the batch slicing by
  layout;
- `progress`: logging, MindSpore's loss lines, the bounded read-back of a run's losses and the
  run's progress display (imports nothing of pcompile: `pcompile --version` loads it).

The front end (compiler/frontend/initializer.py, compiler/frontend/serialization.py,
compiler/driver/runtime.py, compiler/driver/data_checks.py) re-exports these under the names model
files and tests use.
"""
