"""Shared pieces of the gather / scatter-add Triton kernels (``moekit.ops._triton.gather_scatter``
re-exports every family): the valid-row count, the row-copy tile shapes, the tile sizes.

All kernels move whole rows of ``D`` elements (``D % 8 == 0``, validated by the public ops). A
program owns a ``[BLOCK_R, BLOCK_D]`` tile: several rows when ``D`` is small, a column slice of one
or a few rows when it is large. Row offsets are computed in int64 and written as
``row * (stride // 8) * 8`` so the compiler can prove 8-element alignment and emit 16-byte vector
accesses (bf16) for any ``D`` that is a multiple of 8; the column bound is written the same way so
the mask stays constant over 8 lanes.

Rows are skipped (left untouched) when they are at or past ``valid_token_count[0]`` or when an
index is negative or out of range (the ``-1`` tail of ``index_shuffling``), so nothing is read or
written out of bounds whatever the index values.

Every kernel starts with ``pdl_prologue`` (programmatic dependent launch, ``moekit.ops._common``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, next_pow2, num_sms

# Elements a program moves per tile (8 KB of bf16): large enough for 16-byte vectors on every lane
# of 8 warps, small enough that several programs fit on an SM and keep loads in flight.
_TILE = 4096
# Below this many programs per SM, row blocks shrink (more, smaller programs).
_MIN_PROGRAMS_PER_SM = 4


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_count(valid_ptr, n, HAS_VALID: tl.constexpr):
    """``min(valid_ptr[0], n)`` when a valid count is given, else ``n``."""
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_ptr).to(tl.int64), n)
    return n


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _warps(elems: int) -> int:
    return max(1, min(8, elems // 512))


def _tiles(rows: int, D: int, device: torch.device, max_block_d: int = 1024) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_D, number of column blocks, num_warps) for a row-copy kernel over ``rows``
    rows of ``D`` elements. Shape buckets only: powers of two, no autotuning."""
    block_d = min(next_pow2(D), max_block_d)
    n_db = cdiv(D, block_d)
    block_r = max(1, min(_TILE // block_d, next_pow2(rows)))
    target = _MIN_PROGRAMS_PER_SM * num_sms(device)
    while block_r > 1 and cdiv(rows, block_r) * n_db < target:
        block_r //= 2
    return block_r, block_d, n_db, _warps(block_r * block_d)
