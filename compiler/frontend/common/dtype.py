"""`pcompile.common.dtype` (MindSpore's `mindspore.common.dtype`, imported as `mstype`): the
element types pcompile has, by MindSpore's names, and MindSpore's groups of them."""

from __future__ import annotations

from pcompile.ir.types import DType

float16 = DType.float16
float32 = DType.float32
float64 = DType.float64
bfloat16 = DType.bfloat16
int32 = DType.int32
int64 = DType.int64
uint8 = DType.uint8
bool_ = DType.bool_

float_type = (float16, float32, float64, bfloat16)
int_type = (int32, int64)
uint_type = (uint8,)
number_type = (*int_type, *uint_type, *float_type)

__all__ = ["DType", "bfloat16", "bool_", "float16", "float32", "float64", "float_type",
           "int32", "int64", "int_type", "number_type", "uint8", "uint_type"]
