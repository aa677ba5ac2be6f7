"""The router of examples/mixtral.py alone: its dispatch and combine tensors, balance loss
and probabilities for [groups, tokens, hidden] inputs (tests/e2e/test_mixtral.py checks them
against a numpy routing)."""

import importlib.util
import os

import numpy as np

from pcompile import nn

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mixtral.py")
_SPEC = importlib.util.spec_from_file_location("_moe_router_mixtral", _PATH)
mixtral = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mixtral)


class Router(nn.Cell):
    def __init__(self):
        super().__init__()
        self.router = mixtral.TopKRouter(mixtral.HIDDEN, 1)

    def construct(self, x):
        dispatch, combine, aux = self.router(x)
        groups, tokens, dim = x.shape
        logits = self.router.dense(self.router.reshape(x, (groups * tokens, dim)))
        probs = self.router.softmax(self.router.reshape(logits, (groups, tokens, -1)))
        return dispatch, combine, aux, probs


def model():
    return Router()


def inputs():
    rng = np.random.default_rng(int(os.environ.get("ROUTER_SEED", "0")))
    tokens = int(os.environ.get("ROUTER_TOKENS", "16"))
    return (rng.standard_normal((2, tokens, mixtral.HIDDEN)).astype(np.float32),)
