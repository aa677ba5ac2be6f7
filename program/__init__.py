"""What passes from compiling to running: the run-time pieces a rank needs without the front
end (issue 37 move 1). This room imports only `ir/` (tests/e2e/test_layering.py):

- `init_math`, `initializers`: parameter data generated block by block from a seed ticket
  (the initializers, `InitializedData`, Philox and its float64 arithmetic);
- `pretrained`: a tensor of a safetensors file, checked against its recorded identity and read
  slice by slice.

The front end (compiler/initializer.py, compiler/serialization.py) re-exports these under the
names a model file uses.
"""
