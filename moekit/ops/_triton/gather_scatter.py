"""Triton kernels: token gather + scale (+ FP8 row-wise quant) and scatter-add (dense, padded,
deterministic), one module per family:

- ``gs_common``: conventions shared by all (valid-row count, row-copy tiles, tile sizes);
- ``gs_gather``: ``gather_scale_dense_tokens``, ``gather_scale_quant_dense_tokens``;
- ``gs_scatter``: ``scatter_add_dense_tokens`` (atomics / locked / bucket sum), ``scatter_add_padded_tokens``;
- ``gs_scatter_det``: ``scatter_add_dense_tokens_deterministic``.

This module is the one namespace over them (``moekit.ops.gather_scatter`` and tests use it): it
holds every name of the families, private ones included, and setting one here (tools tune
``_SCAN_MAX_ROWS``, ``_GATHER_STREAM_PROGRAMS_PER_SM``, tests replace ``launch``, ...) sets it in
every family module that holds it, as when they were one module. (Set them here, not on a family
module, or this namespace keeps the old value.) Tests pin the tuning constants as knobs instead
(``settings.override(knobs={"SCAN_MAX_ROWS": 0})``: the names without the leading underscore;
``moekit.settings`` lists them).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from moekit.ops._triton import gs_common, gs_gather, gs_scatter, gs_scatter_det
from moekit.ops._triton.gs_gather import gather_scale_dense_tokens, gather_scale_quant_dense_tokens
from moekit.ops._triton.gs_scatter import scatter_add_dense_tokens, scatter_add_padded_tokens
from moekit.ops._triton.gs_scatter_det import scatter_add_dense_tokens_deterministic

__all__ = [
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "scatter_add_dense_tokens",
    "scatter_add_dense_tokens_deterministic",
    "scatter_add_padded_tokens",
]

_FAMILIES = (gs_gather, gs_scatter, gs_scatter_det, gs_common)

# Every name of the families, private ones included (tests and tools read and tune them here).
for _m in _FAMILIES:
    for _k, _v in vars(_m).items():
        if not _k.startswith("__"):
            globals().setdefault(_k, _v)
del _m, _k, _v


class _Families(types.ModuleType):
    """Setting (or deleting) a name here does it in every family module that holds it too."""

    def __setattr__(self, name: str, value: Any) -> None:
        for m in _FAMILIES:
            if name in vars(m):
                setattr(m, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        for m in _FAMILIES:
            if name in vars(m):
                delattr(m, name)
        super().__delattr__(name)


sys.modules[__name__].__class__ = _Families
