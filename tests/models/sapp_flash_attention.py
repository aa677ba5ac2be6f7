"""MindSpore's test_auto_parallel_sapp_flash_attention.py: a MatMul, a Reshape to the
FlashAttentionScore layout FA_LAYOUT (BNSD, BSH, SBH or BSND), then the attention of the
result with itself under a [B, 1, S, S] mask; batch 8, sequence 1024, 32 heads of 128, float16,
recursive programming on 8 devices, full batch, rp_matmul_mem_coef 2**-10 for BNSD and 1
otherwise."""

import os

import numpy as np

from pcompile import nn, ops, set_auto_parallel_context, set_cost_model_context

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="recursive_programming",
                          device_num=8, dataset_strategy="full_batch")
LAYOUT = os.environ.get("FA_LAYOUT", "BNSD")
set_cost_model_context(rp_matmul_mem_coef=2.0 ** -10 if LAYOUT == "BNSD" else 1.0)
B, S, N, D = 8, 1024, 32, 128
SHAPES = {"BNSD": (B, N, S, D), "BSH": (B, S, N * D), "SBH": (S, B, N * D), "BSND": (B, S, N, D)}


class FATestNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul()
        self.flash_attention = ops.FlashAttentionScore(head_num=N, input_layout=LAYOUT)
        self.reshape = ops.Reshape()

    def construct(self, x, w, att_mask):
        x = self.reshape(self.matmul(x, w), SHAPES[LAYOUT])
        return self.flash_attention(x, x, x, None, None, None, att_mask, None)[3]


def model():
    return FATestNet()


def inputs():
    rows, cols = (B * N, S * D) if LAYOUT == "BNSD" else (B * S, N * D)
    return (np.ones((rows, 64), np.float16), np.ones((64, cols), np.float16),
            np.ones((B, 1, S, S), np.uint8))
