"""An embedding table split on the hidden dim and an LM head split on its rows (a row-parallel
MatMul over all 8 ranks), the loss on its logits (`benchmarks/plan_quality.py`'s embedding +
LM head)."""

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(dataset_strategy="full_batch")
B, S, H, V = 8, 16, 32, 64
class EmbeddingHead(nn.Cell):
    def __init__(self):
        super().__init__()
        self.table = Parameter(initializer("normal", [V, H]), "table")
        self.head = Parameter(initializer("normal", [H, V]), "head")
        self.gather = ops.Gather().shard(((1, 8), (1, 1)))
        self.reshape = ops.Reshape()
        self.matmul = ops.MatMul().shard(((1, 8), (8, 1)))
    def construct(self, tokens):
        h = self.reshape(self.gather(self.table, tokens, 0), (B * S, H))
        return self.matmul(h, self.head)
def model():
    set_seed(1)
    return EmbeddingHead()
def inputs():
    return (np.random.default_rng(0).integers(0, V, (B, S)).astype(np.int32),)
def labels():
    return (np.random.default_rng(1).integers(0, V, (B * S,)).astype(np.int32),)
def loss():
    return nn.CrossEntropyLoss()
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
