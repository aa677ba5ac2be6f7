"""What the tests that start rank processes share: a clean environment for the child
processes, and the source of the small MLP model file they compile and run."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence

# Variables that would make a child process join another job (a launcher's or a scheduler's)
# or change how pcompile behaves.
JOB_PREFIXES = ("PCOMPILE_", "OMPI_", "SLURM_", "PMI_")


def clean_env(*drop: str, prefixes: Sequence[str] = JOB_PREFIXES, **extra: str) -> dict[str, str]:
    """This process's environment for a child on CPU: without variables starting with one of
    `prefixes` or `drop`, with JAX_PLATFORMS=cpu and `extra`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith((*prefixes, *drop))}
    out.update(JAX_PLATFORMS="cpu", **extra)
    return out


_MLP = '''
import numpy as np
{imports}from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 8]), "w")
{second_init}        self.matmul = ops.MatMul().shard({strategy})
{second_ops}
    def construct(self, x):
        return {body}


def model():
    set_seed(3)
    return Net()


def inputs():
    return (np.zeros((8, 16), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)

'''

_DATASET = '''
def dataset():
    rng = np.random.default_rng(7)
    for _ in range(3):
        yield (rng.standard_normal((8, 16)).astype(np.float32),
               rng.standard_normal((8, 8)).astype(np.float32))
'''


def mlp_source(strategy: str, *, relu_matmul: bool = False, data: str | None = _DATASET,
               imports: str = "") -> str:
    """A model file: `x [8, 16] @ w [16, 8]` with `strategy` (the MatMul's, as Python source),
    then, with `relu_matmul`, a ReLU and a strategy-less `@ w2 [8, 8]`; MSELoss, Momentum;
    `data` (Python source: by default three random batches as `dataset()`); `imports`: lines
    added after `import numpy as np`."""
    second_init = '        self.w2 = Parameter(initializer("normal", [8, 8]), "w2")\n' \
        if relu_matmul else ""
    second_ops = "        self.relu = ops.ReLU()\n        self.matmul2 = ops.MatMul()\n" \
        if relu_matmul else ""
    body = ("self.matmul2(self.relu(self.matmul(x, self.w)), self.w2)" if relu_matmul
            else "self.matmul(x, self.w)")
    source = _MLP.format(imports=imports, second_init=second_init, strategy=strategy,
                         second_ops=second_ops, body=body)
    return textwrap.dedent(source).rstrip("\n") + "\n\n\n" + (data or "").lstrip("\n")
