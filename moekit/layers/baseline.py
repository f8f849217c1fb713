"""``BaselineMoE``: the plain PyTorch MoE layer, the oracle that ``MetaShufflingMoE`` reproduces.

Router matmul -> ``moekit.reference`` routing -> rows sorted by expert -> per-expert GEMMs
(``torch._grouped_mm`` on CUDA in bf16) -> SwiGLU -> ``index_add_`` combine -> + shared expert. It
syncs with the host (per-expert sizes). FP8 row-wise weights run as fake-quantized float32 GEMMs
at the same quantization points as the moekit kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit.layers.base import MoEBase
from moekit.layers.experts import choose_path
from moekit.reference.quantize import DEFAULT_EPS, FUSED_EPS, quantize_rows
from moekit.reference.routing import routing_weights

__all__ = ["BaselineMoE"]


def _fake_quant_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, eps: float) -> torch.Tensor:
    """FP8 row-wise GEMM in plain PyTorch: quantize the rows of ``x``, then
    ``(xq @ wq.T) * x_scale * w_scale`` in float32, returned in bf16 (like the FP8 kernels)."""
    xq, xs = quantize_rows(x.float(), eps=eps)
    y = (xq.float() @ w.float().T) * xs.unsqueeze(-1) * w_scale.float().unsqueeze(0)
    return y.to(torch.bfloat16)


def _silu_mul_f32(h: torch.Tensor) -> torch.Tensor:
    F = h.shape[-1] // 2
    h = h.float()
    return torch.nn.functional.silu(h[:, :F]) * h[:, F:]


class BaselineMoE(MoEBase):
    """The plain PyTorch MoE layer (CPU and GPU): the semantics MetaShufflingMoE reproduces.

    ``forward(x)`` takes ``[T, D]`` or ``[B, S, D]`` in ``args.dtype`` and returns the same
    shape, on one rank (``ep_size == 1``). State, constructor and ``from_weights``: ``MoEBase``.
    """

    # Forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = self._flatten(x)
        if self.args.ep_size > 1:
            raise NotImplementedError("BaselineMoE runs on one rank (ep_size=1); use MetaShufflingMoE for EP")
        out = self._routed_baseline(x_TD, self.router_logits(x_TD))
        if self.shared_experts is not None:
            out = out + self._shared_baseline(x_TD).float()
        return out.to(self.args.dtype).reshape(x.shape)

    def _shared_baseline(self, x_TD: torch.Tensor) -> torch.Tensor:
        se = self.shared_experts
        if se.is_fp8_rowwise:
            h = _fake_quant_mm(x_TD, se.w13.data, se.w13_scale, DEFAULT_EPS)
            return _fake_quant_mm(_silu_mul_f32(h), se.w2.data, se.w2_scale, FUSED_EPS)
        h = x_TD @ se.w13.data.T
        z = _silu_mul_f32(h).to(x_TD.dtype)
        return z @ se.w2.data.T

    def _routed_baseline(self, x_TD: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
        """Routed experts' sum in float32 ``[T, D]``."""
        a = self.args
        T, D = x_TD.shape
        K, E = a.top_k, a.num_experts
        out = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
        if T == 0:
            return out
        weights_TK, ids_TK = routing_weights(
            logits_TE, K, a.score_func, a.renormalize, n_group=a.n_group, topk_group=a.topk_group,
            e_score_correction_bias=self.e_score_correction_bias_E, routed_scaling_factor=float(a.routed_scaling_factor),
        )  # fmt: skip
        flat_ids = ids_TK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert, (token, slot) ascending
        tok_N = order // K
        w_N = weights_TK.reshape(-1)[order]
        counts_E = torch.bincount(flat_ids, minlength=E)
        xs = x_TD[tok_N]
        if a.apply_router_weight_on_input:
            xs = xs.float() * w_N.unsqueeze(1)  # FP8 quantizes the scaled float32 rows directly
        re = self.routed_experts
        # MetaShufflingMoE's decode pipeline uses FP8 weights weight-only (16-bit activations).
        weight_only = re.is_fp8_rowwise and choose_path(T * K, E, fp8=True) == "decode"
        if not re.is_fp8_rowwise:
            xs = xs.to(x_TD.dtype)
        if weight_only:
            w13d, w2d = re.dequantized()
            h = self._per_expert(xs.float(), w13d.float(), None, counts_E, 0.0)
            z = _silu_mul_f32(h).to(torch.bfloat16).float()
            y = self._per_expert(z, w2d.float(), None, counts_E, 0.0).to(torch.bfloat16)
        elif re.is_fp8_rowwise:
            h = self._per_expert(xs, re.w13.data, re.w13_scale, counts_E, FUSED_EPS)
            y = self._per_expert(_silu_mul_f32(h), re.w2.data, re.w2_scale, counts_E, FUSED_EPS)
        else:
            h = self._per_expert(xs, re.w13.data, None, counts_E, 0.0)
            y = self._per_expert(_silu_mul_f32(h).to(x_TD.dtype), re.w2.data, None, counts_E, 0.0)
        y = y.float()
        if not a.apply_router_weight_on_input:
            y = y * w_N.unsqueeze(1)
        if a.deterministic:
            # Fixed summation order: back to [T, K, D], sum over the k slots.
            per_slot = torch.empty_like(y)
            per_slot[order] = y
            return per_slot.view(T, K, D).sum(dim=1)
        return out.index_add_(0, tok_N, y)

    @staticmethod
    def _per_expert(
        xs: torch.Tensor, w_eNK: torch.Tensor, w_scale: Optional[torch.Tensor], counts_E: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``y[rows of e] = xs[rows of e] @ w[e].T`` for rows grouped by expert."""
        if w_scale is None and xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            try:
                offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
                return torch._grouped_mm(xs, w_eNK.transpose(-2, -1), offs=offs)
            except (RuntimeError, TypeError, NotImplementedError) as exc:  # older GPU / layout
                from moekit.ops._common import warn_once

                warn_once("baseline-grouped-mm", f"BaselineMoE: torch._grouped_mm failed ({type(exc).__name__}: "
                          f"{str(exc)[:120]}); the baseline runs a Python loop over experts instead")  # fmt: skip
        out_dtype = torch.bfloat16 if w_scale is not None else xs.dtype
        y = torch.empty(xs.shape[0], w_eNK.shape[1], dtype=out_dtype, device=xs.device)
        start = 0
        for e, n in enumerate(counts_E.tolist()):  # host sync: this is the baseline
            if n:
                rows = xs[start : start + n]
                if w_scale is not None:
                    y[start : start + n] = _fake_quant_mm(rows, w_eNK[e], w_scale[e], eps)
                else:
                    y[start : start + n] = rows @ w_eNK[e].T
            start += n
        return y
