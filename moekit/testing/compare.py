"""Comparison with per-dtype tolerances, and output poisoning."""

from __future__ import annotations

from typing import Optional, Union

import torch

# Relative error ||out - ref|| / ||ref|| allowed for an output computed in this dtype (DESIGN §5).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    torch.float8_e4m3fn: 6e-2,
}
TF32_TOLERANCE = 2e-3


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are empty or both zero; inf on NaN)."""
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if o.shape != r.shape:
        raise AssertionError(f"shape mismatch: out {tuple(o.shape)} vs ref {tuple(r.shape)}")
    if o.numel() == 0:
        return 0.0
    if not torch.isfinite(o).all():
        return float("inf")
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    tol: Optional[float] = None,
    msg: str = "",
) -> float:
    """Assert ``rel_error(out, ref) <= tol``; integer and bool tensors must match exactly.

    ``tol`` defaults to ``TOLERANCES[dtype or out.dtype]``. Returns the relative error.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{msg} shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    if not out.is_floating_point() and not ref.is_floating_point():
        o, r = out.detach().cpu().long(), ref.detach().cpu().long()
        if not torch.equal(o, r):
            bad = (o != r).nonzero()
            first = tuple(bad[0].tolist())
            raise AssertionError(
                f"{msg} integer mismatch at {bad.shape[0]} of {o.numel()} positions; first at {first}: "
                f"out={o[first].item()} ref={r[first].item()}"
            )
        return 0.0
    if tol is None:
        tol = TOLERANCES[dtype if dtype is not None else out.dtype]
    err = rel_error(out, ref)
    if not err <= tol:
        raise AssertionError(f"{msg} relative error {err:.3e} > tolerance {tol:.1e} (shape {tuple(out.shape)})")
    return err


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel writes: NaN for floats, -1 for integers. FP8
    tensors get NaN's bit pattern (0x7F)."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def _is_poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8) == 0x7F
    if t.is_floating_point():
        return torch.isnan(t)
    return t == -1


def assert_poisoned(t: torch.Tensor, written: Union[torch.Tensor, slice], msg: str = "") -> None:
    """Rows selected by ``written`` (a bool row mask or a slice) hold no poison; all other rows
    are still entirely poisoned."""
    p = _is_poison(t).reshape(t.shape[0], -1).cpu() if t.dim() else _is_poison(t).reshape(1, 1).cpu()
    mask = torch.zeros(p.shape[0], dtype=torch.bool)
    if isinstance(written, slice):
        mask[written] = True
    else:
        mask = written.detach().cpu().bool().reshape(-1)
    if p[mask].any():
        rows = p[mask].any(dim=1).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{msg} rows that must be written still hold poison (first of them: {rows})")
    if not p[~mask].all():
        rows = (~p[~mask].all(dim=1)).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{msg} rows that must stay untouched were written (first, among untouched: {rows})")


# Share of FP8 values allowed one e4m3 step off the reference in ``assert_fp8_close``. Two
# round-to-nearest-even quantizers whose float32 inputs differ by a few ulps (another product
# order, a reciprocal instead of a division) disagree only on values within those ulps of a
# rounding midpoint: about 1e-5 of them; a truncating (round-toward-zero) quantizer is off on
# about half of them, one that rounds bf16 intermediates on about 3%.
FP8_MAX_OFF_FRACTION = 0.01


def assert_fp8_close(
    q: torch.Tensor, ref_q: torch.Tensor, msg: str = "", max_off_fraction: float = FP8_MAX_OFF_FRACTION
) -> None:
    """FP8 values against a reference quantization: every value within one e4m3 step (at the
    larger magnitude), no NaN where the reference has none, and at most ``max_off_fraction`` of
    the values (at least one value, for tiny tensors) one step off: rounding of values next to a
    midpoint. A truncating quantizer is off on about half of them and fails."""
    a, b = q.float().cpu(), ref_q.float().cpu()
    assert a.shape == b.shape, f"{msg} shape {tuple(a.shape)} vs {tuple(b.shape)}"
    nan = torch.isnan(a) & ~torch.isnan(b)
    assert not nan.any(), f"{msg} {int(nan.sum())} NaN in the fp8 output where the reference has none"
    both = ~(torch.isnan(a) | torch.isnan(b))
    a, b = a[both], b[both]
    m = torch.maximum(a.abs(), b.abs())
    step = torch.exp2(torch.floor(torch.log2(m.clamp_min(2.0**-6))) - 3)
    diff = (a - b).abs()
    bad = diff > step
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{msg} {int(bad.sum())} fp8 values off by more than one step; first: {a[i]} vs {b[i]}")
    off = int((diff > 0).sum())
    if off > max(1.0, max_off_fraction * a.numel()):
        raise AssertionError(
            f"{msg} {off} of {a.numel()} fp8 values ({off / a.numel():.1%}) one step off the reference, "
            f"more than {max_off_fraction:.1%}: a rounding mode other than round-to-nearest-even?"
        )
