import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(initializer("normal", [32, 16]), "w")
        self.weight2 = Parameter(initializer("normal", [16, 16]), "w2")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU().shard(((2, 4),))
        self.matmul2 = ops.MatMul().shard(((2, 4), (4, 1)))
    def construct(self, x):
        out = self.matmul(x, self.weight)
        out = self.relu(out)
        out = self.matmul2(out, self.weight2)
        return out
def model():
    set_seed(1)
    return Net()
def inputs(): return (np.random.default_rng(0).random((16, 32)).astype(np.float32),)
def labels(): return (np.random.default_rng(1).random((16, 16)).astype(np.float32),)
def loss(): return nn.MSELoss()
def optimizer(params): return nn.Momentum(params, learning_rate=0.2, momentum=0.1)
