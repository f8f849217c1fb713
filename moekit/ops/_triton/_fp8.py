"""FP8 conversion shared by the quantizing kernels.

The Triton 3.6 CPU interpreter rounds float32 -> e4m3 wrongly (the mantissa carry is lost:
125.3 becomes 64, 17 becomes 18). With ``EMULATE`` (set from ``interpreting()``), values are first
rounded to the e4m3 grid in float32 (round to nearest even), and the conversion of an exactly
representable value is then exact. On the GPU, ``EMULATE`` is False and the hardware converts.
"""

import triton
import triton.language as tl

from moekit.ops._common import interpreting

EMULATE_FP8 = interpreting()


@triton.jit
def to_fp8(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
    if EMULATE:
        bits = v.to(tl.int32, bitcast=True)
        # Keep 3 of the 23 mantissa bits, round to nearest even (a carry may bump the exponent).
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        normal = rounded.to(tl.float32, bitcast=True)
        # e4m3 subnormals (|v| < 2**-6) are multiples of 2**-9: the add/subtract trick rounds there.
        magic = 24576.0  # 1.5 * 2**23 * 2**-9
        a = tl.abs(v)
        sub = (a + magic) - magic
        sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
        v = tl.where(a < 0.015625, sub, normal)
        # The interpreter also turns a NaN into a finite value (0x7C, 384): write the NaN pattern
        # (0x7F is NaN in e4m3fn and in e5m2) where the input is NaN, as the GPU's cvt does.
        q = v.to(dtype).to(tl.int8, bitcast=True)
        q = tl.where(v != v, tl.full(v.shape, 0x7F, tl.int8), q)
        return q.to(dtype, bitcast=True)
    return v.to(dtype)
