"""The transformers integration's token rows in the layout moekit's gathers want."""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Token rows as the gather op wants them (unit last stride, row stride a multiple of 8)."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8):
        return x.contiguous()
    return x
