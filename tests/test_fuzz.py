"""Property / fuzz tests of every public op in ``moekit.ops`` on the CPU (hypothesis).

For each op (``moekit.ops.__all__``, the ops ``moekit check`` covers) hypothesis draws shapes
(empty ones included), dtypes, layouts (padded rows, column-major, broadcast rows, storage
offsets) and index / count ranges (negative, past the end), and:

- ``test_op_matches_reference``: the op on the drawn (possibly non-contiguous) inputs matches
  ``moekit.reference`` on contiguous copies (bitwise for data movement, a dtype tolerance for
  GEMMs), and an independent formulation written here (loops / plain torch, no moekit code);
  output rows the contract says are untouched stay bitwise untouched;
- ``test_bad_input_is_refused``: one argument of a valid call is broken (kind, dtype, rank,
  size, layout, value) and the op must raise ``TypeError`` / ``ValueError`` whose message names
  that argument.

Reproducible (``derandomize=True``, no example database) and bounded: the file runs in well
under a minute on two cores.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moekit.ops as ops  # noqa: E402
from moekit import reference as ref  # noqa: E402
from moekit._check import covered_ops  # noqa: E402
from moekit.ops import quantize as _quantize_mod  # noqa: E402

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INDEX = (torch.int32, torch.int64)

_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=False,
               suppress_health_check=list(HealthCheck))  # fmt: skip
# $MOEKIT_FUZZ_SCALE=N multiplies the examples (a deeper local run; CI keeps 1).
_SCALE = max(1, int(os.environ.get("MOEKIT_FUZZ_SCALE", "1")))
VALID = hsettings(max_examples=50 * _SCALE, **_COMMON)
BAD = hsettings(max_examples=3 * _SCALE, **_COMMON)


# ----------------------------------------------------------------------------------------------
# Drawing tensors
# ----------------------------------------------------------------------------------------------

# Layouts: ("contig",), ("pad", p): the last dim padded by p then sliced (row stride D + p),
# ("colmajor",): 2-D, stored transposed, ("bcast",): leading dim of stride 0, ("offset",): a view
# starting one row into a larger buffer.
ROWS8 = [("contig",), ("pad", 8), ("pad", 16), ("bcast",), ("offset",)]  # row ops: row stride % 8 == 0
LASTDIM = ROWS8 + [("pad", 3), ("pad", 5)]  # unit last stride, any row stride
ANY = LASTDIM + [("colmajor",)]
OUT_ROWS8 = [("contig",), ("pad", 8), ("offset",)]  # written in place: no broadcast


def _values(shape, dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    v = torch.randn(shape, generator=g) * scale
    return v.to(dtype)


def with_layout(v: torch.Tensor, layout) -> torch.Tensor:
    """``v``'s values in ``layout`` (``bcast``: ``v``'s first row repeated)."""
    kind = layout[0]
    if kind == "pad" and v.dim() >= 1:
        big = torch.zeros(v.shape[:-1] + (v.shape[-1] + layout[1],), dtype=v.dtype)
        big[..., : v.shape[-1]] = v
        return big[..., : v.shape[-1]]
    if kind == "colmajor" and v.dim() == 2:
        return v.t().contiguous().t()
    if kind == "bcast" and v.dim() >= 2 and v.shape[0] >= 1:
        return v[:1].clone().expand(v.shape)
    if kind == "offset" and v.dim() >= 1:
        big = torch.zeros((v.shape[0] + 1,) + tuple(v.shape[1:]), dtype=v.dtype)
        big[1:] = v
        return big[1:]
    return v


def make(shape, dtype, layout=("contig",), *, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """A tensor of ``shape`` / ``dtype`` with random values in ``layout``."""
    g = torch.Generator().manual_seed(seed)
    return with_layout(_values(tuple(shape), dtype, g, scale), layout)


def index_tensor(n: int, lo: int, hi: int, dtype, seed: int) -> torch.Tensor:
    """``[n]`` integers uniform in ``[lo, hi]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).to(dtype)


def idx(draw, n: int, lo: int, hi: int) -> torch.Tensor:
    """Drawn ``[n]`` indices in ``[lo, hi]``: int32 / int64, contiguous or a strided view."""
    strided = draw(st.booleans())
    t = index_tensor(2 * n if strided else n, lo, hi, draw(st.sampled_from(INDEX)), seeds(draw))
    return t[::2] if strided else t


def counts_tensor(shape, lo: int, hi: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, tuple(shape), generator=g).to(dtype)


def draw_count(draw, n: int):
    """``None`` or a 1-element device count in ``[-1, n + 2]`` (int32 / int64)."""
    if draw(st.booleans()):
        return None
    v = draw(st.integers(-1, n + 2))
    return torch.tensor([v], dtype=draw(st.sampled_from(INDEX)))


def draw_range(draw, E: int):
    """``(start, end)``: ``None``s or ``0 <= start <= end <= E``."""
    if draw(st.booleans()):
        return None, None
    s = draw(st.integers(0, E))
    return s, draw(st.integers(s, E))


def seeds(draw) -> int:
    return draw(st.integers(0, 2**31 - 1))


def contig(v: Any) -> Any:
    return v.contiguous() if isinstance(v, torch.Tensor) else v


def clone_args(kw: dict) -> dict:
    """A copy whose tensors are contiguous clones (the reference's inputs). Ops computing
    transcendental functions (sigmoid, exp, rsqrt) or reductions take the same tensors instead:
    torch's CPU kernels round differently for strided and contiguous inputs."""
    return {k: (v.clone().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    t = t.reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (NaN payloads and signed zeros included), shape and dtype."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} vs {want.dtype}"
    assert torch.equal(bits(got), bits(want)), f"{what}: values differ"


_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str, dtype=None, scale: float = 1.0) -> None:
    rtol, atol = _TOL[dtype or got.dtype]
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol * scale, atol=atol * scale, msg=what)


def assert_fp8_near(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """Dequantized FP8 rows within half an e4m3 step of the float32 rows they quantize
    (3 mantissa bits: 2**-4 relative; subnormals: 2**-10 of the row scale)."""
    deq = q.float() * scale.unsqueeze(-1)
    err = (deq - rows.float()).abs()
    bound = rows.float().abs() * 2**-4 + scale.unsqueeze(-1) * 2**-9 + 1e-30
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3e}"


def ex_names(fn: Callable[[], Any], name: str) -> None:
    """``fn()`` raises TypeError / ValueError whose message names ``name``."""
    with pytest.raises((TypeError, ValueError)) as ei:
        fn()
    msg = str(ei.value)
    assert re.search(rf"(?<![\w]){re.escape(name)}(?!\w)", msg), f"error does not name {name!r}: {msg}"


# ----------------------------------------------------------------------------------------------
# Builders: draw a valid call (kwargs) of each op
# ----------------------------------------------------------------------------------------------


def b_index_shuffling(draw):
    T, E = draw(st.integers(0, 24)), draw(st.integers(1, 20))
    dtype = draw(st.sampled_from(FLOATS))
    s = make((T, E), torch.float32, seed=seeds(draw))
    if draw(st.booleans()):  # ties, signed zeros, infinities, NaN
        s = s.round().clamp(-1, 1)
        if T and draw(st.booleans()):
            s.view(-1)[:: max(1, s.numel() // 3)] = draw(st.sampled_from([float("nan"), float("inf"), -0.0]))
    s = with_layout(s.to(dtype), draw(st.sampled_from(ANY)))
    start, end = draw_range(draw, E)
    return dict(routing_scores=s, expert_index_start=start, expert_index_end=end,
                valid_token_count=draw_count(draw, T), top_k=draw(st.integers(1, E)))  # fmt: skip


def b_shuffle_top_k(draw):
    T = draw(st.integers(0, 16))
    K = draw(st.integers(1, 6))
    E = draw(st.integers(1, 24))
    ids = counts_tensor((T, K), -2, E + 1, draw(st.sampled_from(INDEX)), seeds(draw))  # repeats and bad ids
    layout = draw(st.sampled_from(["contig", "colmajor"]))
    if layout == "colmajor":
        ids = ids.T.contiguous().T
    w = make((T, K), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(ANY)), seed=seeds(draw))
    start, end = draw_range(draw, E)
    zb = make((3, 8), torch.float32, seed=1) if draw(st.booleans()) else None
    return dict(top_k_index=ids, top_k_weights=w, num_experts=E, expert_index_start=start, expert_index_end=end,
                zero_buffer=zb)  # fmt: skip


def b_route_and_shuffle(draw):
    T = draw(st.integers(0, 16))
    score_func = draw(st.sampled_from(["sigmoid", "softmax", "topk_softmax"]))
    grouped = score_func != "topk_softmax" and draw(st.booleans())
    if grouped:
        n_group = draw(st.sampled_from([2, 4]))
        per = draw(st.integers(2, 4))
        E = n_group * per
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * per))
    else:
        n_group = topk_group = None
        E = draw(st.integers(1, 24))
        top_k = draw(st.integers(1, E))
    logits = make((T, E), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(ANY)), seed=seeds(draw))
    bias = None
    if score_func != "topk_softmax" and draw(st.booleans()):
        bias = make((E,), draw(st.sampled_from(FLOATS)), seed=seeds(draw), scale=0.1)
    start, end = draw_range(draw, E)
    zb = make((3, 8), torch.float32, seed=1) if draw(st.booleans()) else None
    return dict(logits_TE=logits, top_k=top_k, score_func=score_func, renormalize=draw(st.booleans()),
                n_group=n_group, topk_group=topk_group, e_score_correction_bias=bias,
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), expert_index_start=start,
                expert_index_end=end, zero_buffer=zb)  # fmt: skip


def _gather_kwargs(draw):
    T, D, E, a = (
        draw(st.integers(0, 10)),
        draw(st.sampled_from([0, 8, 16, 40])),
        draw(st.integers(1, 6)),
        draw(st.integers(0, 24)),
    )
    x = make((T, D), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(ROWS8)), seed=seeds(draw))
    scores = make((T, E), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(ANY)), seed=seeds(draw))
    return dict(x=x, token_indices=idx(draw, a, -3, T + 2),
                expert_indices=idx(draw, a, -2, E + 1),
                scores=scores, valid_token_count=draw_count(draw, a))  # fmt: skip


def b_gather_scale_dense_tokens(draw):
    return _gather_kwargs(draw)


def b_gather_scale_quant_dense_tokens(draw):
    kw = _gather_kwargs(draw)
    kw["scale_ub"] = torch.tensor([draw(st.sampled_from([0.5, 3.0, 100.0]))]) if draw(st.booleans()) else None
    return kw


def _scatter_kwargs(draw):
    T, D, a = draw(st.integers(0, 10)), draw(st.sampled_from([0, 8, 24])), draw(st.integers(0, 30))
    out = make((T, D), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(OUT_ROWS8)), seed=seeds(draw))
    rows = make((a, D), draw(st.sampled_from(FLOATS)), draw(st.sampled_from(ROWS8)), seed=seeds(draw))
    return dict(out_tokens=out, in_tokens=rows,
                token_indices=idx(draw, a, -3, T + 2),
                valid_token_count=draw_count(draw, a))  # fmt: skip


def b_scatter_add_dense_tokens(draw):
    kw = _scatter_kwargs(draw)
    kw["deterministic"] = draw(st.booleans())
    return kw


def b_scatter_add_dense_tokens_deterministic(draw):
    return _scatter_kwargs(draw)


def b_scatter_add_padded_tokens(draw):
    EP = draw(st.integers(1, 3))
    E = EP * draw(st.integers(1, 3))
    T_K, T, D = draw(st.integers(0, 20)), draw(st.integers(0, 8)), draw(st.sampled_from([0, 8, 16]))
    dtype = draw(st.sampled_from(FLOATS))
    return dict(in_tokens=make((EP, T_K, D), dtype, draw(st.sampled_from([("contig",), ("pad", 8)])), seed=seeds(draw)),
                token_counts=counts_tensor((E,), 0, 5, draw(st.sampled_from(INDEX)), seeds(draw)),
                token_indices=idx(draw, T_K, -2, T + 1),
                out_tokens=make((T, D), dtype, draw(st.sampled_from(OUT_ROWS8)), seed=seeds(draw)))  # fmt: skip


def _shuffle_kwargs(draw):
    EP, E = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    is_padded = draw(st.booleans())
    per = draw(st.integers(0, 6))
    T = EP * per if is_padded else draw(st.integers(0, 20))
    cap = per if is_padded else T
    # Counts that fit: each rank's row sums <= its capacity (padded) / all counts sum <= T.
    g = torch.Generator().manual_seed(seeds(draw))
    c = torch.zeros(EP, E, dtype=torch.int64)
    budget = [cap] * EP if is_padded else [T]
    for r in range(EP):
        for e in range(E):
            b = budget[r if is_padded else 0]
            v = int(torch.randint(0, max(b, 0) + 1, (1,), generator=g)) if b > 0 else 0
            v = min(v, draw(st.integers(0, 4)))
            c[r, e] = v
            budget[r if is_padded else 0] -= v
    dtype = draw(st.sampled_from(FLOATS + (FP8,)))
    start, end = draw_range(draw, E)
    return dict(tokens=make((T, draw(st.sampled_from([0, 8, 16]))), dtype, draw(st.sampled_from(ROWS8)), seed=seeds(draw)),
                token_counts=c.to(draw(st.sampled_from(INDEX))), expert_start=start, expert_end=end,
                is_padded=is_padded)  # fmt: skip


def b_combine_shuffling(draw):
    return _shuffle_kwargs(draw)


def b_split_shuffling(draw):
    kw = _shuffle_kwargs(draw)
    kw["init_with_zeros"] = draw(st.booleans())
    return kw


def _m_sizes(draw, G: int, M: int):
    """Group sizes: summing to M, to less (a tail of uncomputed rows) or to more (rows past M)."""
    g = torch.Generator().manual_seed(seeds(draw))
    mode = draw(st.sampled_from(["exact", "under", "over"]))
    total = {"exact": M, "under": max(M - draw(st.integers(1, 4)), 0), "over": M + draw(st.integers(1, 4))}[mode]
    cuts = torch.sort(torch.randint(0, total + 1, (G - 1,), generator=g)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]))
    return sizes.to(draw(st.sampled_from(INDEX)))


def b_grouped_gemm(draw):
    G, N, K, M = (
        draw(st.integers(1, 4)),
        draw(st.sampled_from([8, 16])),
        draw(st.sampled_from([8, 24])),
        draw(st.integers(0, 20)),
    )
    dtype = draw(st.sampled_from(FLOATS))
    kw = dict(x=make((M, K), dtype, draw(st.sampled_from(ANY)), seed=seeds(draw)),
              w=make((G * N, K), dtype, draw(st.sampled_from(ANY)), seed=seeds(draw), scale=K**-0.5),
              m_sizes=_m_sizes(draw, G, M))  # fmt: skip
    if draw(st.booleans()):
        kw["bias"] = make(draw(st.sampled_from([(G, N), (G * N,)])), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    if draw(st.booleans()):
        kw["token_weights"] = make((M,), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    if draw(st.booleans()):
        T = draw(st.integers(0, 8))
        kw["_output_tensor"] = make((T, N), dtype, draw(st.sampled_from(OUT_ROWS8 + [("pad", 3)])), seed=seeds(draw))
        kw["_scatter_add_indices"] = idx(draw, M, -2, T + 1)
        kw["deterministic"] = draw(st.booleans())
    if dtype == torch.bfloat16 and draw(st.booleans()):  # weight-only FP8
        kw["w"] = kw["w"].float().to(FP8)
        kw["w_scale"] = torch.rand(G * N, generator=torch.Generator().manual_seed(seeds(draw))) + 0.5
    return kw


def _fp8_rows(draw, shape, layout=("contig",)):
    return make(shape, torch.float32, layout, seed=seeds(draw), scale=4.0).to(FP8)


def b_grouped_gemm_fp8_rowwise(draw):
    G, N, K, M = (
        draw(st.integers(1, 3)),
        draw(st.sampled_from([8, 16])),
        draw(st.sampled_from([8, 32])),
        draw(st.integers(0, 16)),
    )
    g = torch.Generator().manual_seed(seeds(draw))
    kw = dict(x=_fp8_rows(draw, (M, K), draw(st.sampled_from(LASTDIM))), w=_fp8_rows(draw, (G * N, K)),
              m_sizes=_m_sizes(draw, G, M), x_scale=torch.rand(M, generator=g) / 16,
              w_scale=torch.rand(G * N, generator=g) / 16)  # fmt: skip
    if draw(st.booleans()):
        kw["token_weights"] = make((M,), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    if draw(st.booleans()):
        T = draw(st.integers(0, 6))
        kw["_output_tensor"] = make((T, N), torch.bfloat16, seed=seeds(draw))
        kw["_scatter_add_indices"] = idx(draw, M, -2, T + 1)
        kw["deterministic"] = draw(st.booleans())
    return kw


def b_f8f8bf16_rowwise(draw):
    M, N, K = draw(st.integers(0, 12)), draw(st.sampled_from([8, 24])), draw(st.sampled_from([8, 32]))
    g = torch.Generator().manual_seed(seeds(draw))
    kw = dict(XQ=_fp8_rows(draw, (M, K), draw(st.sampled_from(LASTDIM))), WQ=_fp8_rows(draw, (N, K)),
              x_scale=torch.rand(M, generator=g) / 16, w_scale=torch.rand(N, generator=g) / 16)  # fmt: skip
    if draw(st.booleans()):
        kw["bias"] = make((N,), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    return kw


def b_grouped_gemm_swiglu(draw):
    G, F, K, R = (
        draw(st.integers(1, 3)),
        draw(st.sampled_from([8, 16])),
        draw(st.sampled_from([8, 24])),
        draw(st.integers(0, 10)),
    )
    variant = draw(st.sampled_from(["16bit", "fp8", "weight_only_fp8"]))
    dtype = draw(st.sampled_from(FLOATS)) if variant == "16bit" else torch.bfloat16
    g = torch.Generator().manual_seed(seeds(draw))
    kw = dict(x=make((R, K), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw)),
              w13=make((G * 2 * F, K), dtype, seed=seeds(draw), scale=K**-0.5))  # fmt: skip
    if variant != "16bit":
        kw["w13"] = (kw["w13"].float() * 8).to(FP8)
        kw["w_scale"] = torch.rand(G * 2 * F, generator=g) / 8
    if variant == "fp8":
        kw["x"] = _fp8_rows(draw, (R, K))
        kw["x_scale"] = torch.rand(R, generator=g) / 4
    M = R
    if draw(st.booleans()):
        M = draw(st.integers(0, 16))
        kw["gather_indices"] = idx(draw, M, -2, R + 1)
    kw["m_sizes"] = _m_sizes(draw, G, M)
    if draw(st.booleans()):
        kw["row_scales"] = make((M,), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    return kw


def b_grouped_gemm_combine(draw):
    G, N, F, M, T = (draw(st.integers(1, 4)), draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 24])),
                     draw(st.integers(0, 12)), draw(st.integers(0, 5)))  # fmt: skip
    K = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOATS))
    kw = dict(z=make((M, F), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw)),
              w=make((G * N, F), dtype, seed=seeds(draw), scale=F**-0.5),
              expert_indices=idx(draw, M, -1, G),
              selection_rows=idx(draw, T * K, -2, M + 1),
              out=make((T, N), dtype, seed=seeds(draw)))  # fmt: skip
    if draw(st.booleans()):
        kw["row_weights"] = make((M,), draw(st.sampled_from(FLOATS)), seed=seeds(draw))
    if dtype == torch.bfloat16 and draw(st.booleans()):
        kw["w"] = (kw["w"].float() * 8).to(FP8)
        kw["w_scale"] = torch.rand(G * N, generator=torch.Generator().manual_seed(seeds(draw))) / 8
    return kw


def b_moe_decode(draw):
    T, E, D, F = draw(st.integers(0, 3)), draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([8, 32])), \
        draw(st.sampled_from([8, 24]))  # fmt: skip
    score = draw(st.sampled_from(["softmax", "sigmoid", "topk_softmax"]))
    k = draw(st.integers(1, min(E, 4)))
    dtype = draw(st.sampled_from(FLOATS))
    kw = dict(x_TD=make((T, D), dtype, seed=seeds(draw)), logits_TE=make((T, E), draw(st.sampled_from(FLOATS)),
              seed=seeds(draw)), w13_e2FD=make((E, 2 * F, D), dtype, seed=seeds(draw), scale=D**-0.5),
              w2_eDF=make((E, D, F), dtype, seed=seeds(draw), scale=F**-0.5), out_TD=make((T, D), dtype, seed=seeds(draw)),
              top_k=k, score_func=score, renormalize=draw(st.booleans()), accumulate=draw(st.booleans()),
              apply_router_weight_on_input=draw(st.booleans()))  # fmt: skip
    if score == "sigmoid" and E >= 16 and draw(st.booleans()):
        kw.update(n_group=4, topk_group=draw(st.integers(1, 4)), routed_scaling_factor=2.5,
                  e_score_correction_bias=make((E,), torch.float32, seed=seeds(draw), scale=0.1))  # fmt: skip
        kw["top_k"] = min(k, kw["topk_group"] * (E // 4))
    if dtype == torch.bfloat16 and draw(st.booleans()):
        kw["w13_e2FD"] = (kw["w13_e2FD"].float() * 8).to(FP8)
        kw["w2_eDF"] = (kw["w2_eDF"].float() * 8).to(FP8)
        g = torch.Generator().manual_seed(seeds(draw))
        kw["w13_scale_e2F"] = torch.rand(E, 2 * F, generator=g) / 8
        kw["w2_scale_eD"] = torch.rand(E, D, generator=g) / 8
    return kw


def b_combine_rows(draw):
    T, K, M, D = draw(st.integers(0, 8)), draw(st.integers(1, 4)), draw(st.integers(0, 20)), draw(st.integers(1, 24))
    dtype = draw(st.sampled_from(FLOATS))
    return dict(out=make((T, D), dtype, draw(st.sampled_from([("contig",), ("pad", 8), ("pad", 3), ("offset",)])),
                         seed=seeds(draw)),
                rows=make((M, D), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw)),
                selection_rows=index_tensor(T * K, -2, M + 1, draw(st.sampled_from(INDEX)), seeds(draw)))  # fmt: skip


def _quant_input(draw):
    lead = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
    K = draw(st.integers(1, 40))
    shape = tuple(lead) + (K,)
    layout = draw(st.sampled_from(LASTDIM if len(shape) >= 2 else [("contig",), ("pad", 3), ("offset",)]))
    a = make(
        shape, draw(st.sampled_from(FLOATS)), layout, seed=seeds(draw), scale=draw(st.sampled_from([1e-4, 1.0, 300.0]))
    )
    kw = dict(a=a, scale_ub=torch.tensor([draw(st.sampled_from([0.01, 2.0]))]) if draw(st.booleans()) else None,
              zero_start_index_M=None, eps=draw(st.sampled_from([1 / 512, 1e-12, 0.5])))  # fmt: skip
    if len(shape) >= 2 and draw(st.booleans()):
        n = math.prod(shape[:-2])
        kw["zero_start_index_M"] = counts_tensor((n,), 0, shape[-2] + 1, draw(st.sampled_from(INDEX)), seeds(draw))
    return kw


def b_quantize_fp8_row(draw):
    kw = _quant_input(draw)
    kw["use_triton"] = draw(st.booleans())
    kw["output_device"] = draw(st.sampled_from([None, "cpu", torch.device("cpu")]))
    return kw


def b_triton_quantize_fp8_row(draw):
    kw = _quant_input(draw)
    kw["align_rows_to"] = draw(st.sampled_from([None, 1, 4, 16]))
    return kw


def _silu_kwargs(draw):
    T, F = draw(st.integers(0, 12)), draw(st.integers(1, 24))
    dtype = draw(st.sampled_from(FLOATS))
    if draw(st.booleans()):  # the two halves of one [T, 2F] GEMM output
        h = make((T, 2 * F), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw))
        x0, x1 = h[:, :F], h[:, F:]
    else:
        x0 = make((T, F), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw), scale=3.0)
        x1 = make((T, F), dtype, draw(st.sampled_from(LASTDIM)), seed=seeds(draw))
    return dict(x0=x0, x1=x1, valid_token_count=draw_count(draw, T))


def b_silu_mul(draw):
    return _silu_kwargs(draw)


def b_silu_mul_quant(draw):
    kw = _silu_kwargs(draw)
    kw["scale_ub"] = torch.tensor([draw(st.sampled_from([0.25, 50.0]))]) if draw(st.booleans()) else None
    return kw


def b_rms_norm(draw):
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    H = draw(st.integers(1, 40))
    shape = tuple(lead) + (H,)
    layouts = LASTDIM if len(shape) >= 2 else [("contig",), ("offset",)]
    kw = dict(x=make(shape, draw(st.sampled_from(FLOATS)), draw(st.sampled_from(layouts)), seed=seeds(draw)),
              gamma=make((H,), draw(st.sampled_from(FLOATS)), seed=seeds(draw)),
              eps=draw(st.sampled_from([1e-6, 0.0, 0.5, 1])), residual=None)  # fmt: skip
    if draw(st.booleans()):
        kw["residual"] = make(shape, draw(st.sampled_from(FLOATS)), draw(st.sampled_from(layouts)), seed=seeds(draw))
    return kw


BUILDERS: dict[str, Callable] = {name[2:]: fn for name, fn in globals().items() if name.startswith("b_")}


# ----------------------------------------------------------------------------------------------
# Independent formulations (loops / plain torch, no moekit code)
# ----------------------------------------------------------------------------------------------


def _count(vtc, n: int) -> int:
    return n if vtc is None else int(vtc.reshape(()))


def naive_gather(x, tok, exp, scores, vtc):
    """fp32 rows and the written mask."""
    T, E = scores.shape
    rows = torch.zeros(tok.shape[0], x.shape[1])
    written = torch.zeros(tok.shape[0], dtype=torch.bool)
    for r in range(min(tok.shape[0], max(_count(vtc, tok.shape[0]), 0))):
        t, e = int(tok[r]), int(exp[r])
        if 0 <= t < x.shape[0] and 0 <= e < E:
            rows[r] = x[t].float() * scores[t, e].float()
            written[r] = True
    return rows, written


def naive_scatter(out, rows, tok, n_valid) -> torch.Tensor:
    acc = torch.zeros(out.shape, dtype=torch.float64)
    for r in range(min(rows.shape[0], max(n_valid, 0))):
        t = int(tok[r])
        if 0 <= t < out.shape[0]:
            acc[t] += rows[r].double()
    return (out.double() + acc).to(out.dtype)


def naive_group_rows(m_sizes, M: int) -> list[int]:
    """Group of each of the M rows (G past the groups' total)."""
    groups, G = [], m_sizes.shape[0]
    for g in range(G):
        groups += [g] * max(int(m_sizes[g]), 0)
    return (groups + [G] * M)[:M]


def naive_quant(rows: torch.Tensor, eps: float, ub=None):
    amax = rows.float().abs().amax(dim=-1) if rows.shape[-1] else torch.zeros(rows.shape[:-1])
    amax = amax.clamp(min=eps)
    if ub is not None:
        amax = torch.minimum(amax, ub.reshape(()))
    return amax / 448.0


# ----------------------------------------------------------------------------------------------
# Checks of a valid call: the op vs the reference vs the naive formulation
# ----------------------------------------------------------------------------------------------


def c_index_shuffling(kw):
    counts, eidx, tidx = ops.index_shuffling(**kw)
    r = ref.index_shuffling(**clone_args(kw))
    for got, want, n in zip((counts, eidx, tidx), r, ("token_counts", "expert_indices", "token_indices")):
        assert_same(got, want, n)
    s, k = kw["routing_scores"].float(), kw["top_k"]
    T, E = s.shape
    start = kw["expert_index_start"] or 0
    end = E if kw["expert_index_end"] is None else kw["expert_index_end"]
    n_tok = min(max(_count(kw["valid_token_count"], T), 0), T)
    # top-k with ties to the lower index, NaN above +inf (a stable descending sort)
    sel = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    want_rows = sorted((int(e) - start, t) for t in range(n_tok) for e in sel[t] if start <= int(e) < end)
    V = len(want_rows)
    assert int(counts[E + 1]) == V and int(counts[E]) == T
    assert list(zip(eidx[:V].tolist(), tidx[:V].tolist())) == want_rows
    assert bool((eidx[V:] == -1).all()) and bool((tidx[V:] == -1).all())
    for e in range(E):
        assert int(counts[e]) == sum(1 for ee, _ in want_rows if ee + start == e)


def c_route_and_shuffle(kw):
    zb = kw["zero_buffer"]
    got = ops.route_and_shuffle(**kw)
    rk = dict(kw)
    rk.pop("zero_buffer")
    want = ref.route_and_shuffle(**rk)
    for g, w, n in zip(got, want, ("token_counts", "expert_indices", "token_indices", "row_weights", "selection_rows")):
        assert_same(g, w, n)
    if zb is not None:
        assert not bool(zb.any()), "zero_buffer not zeroed"
    counts, eidx, tidx, rw, srow = got
    T, E = kw["logits_TE"].shape
    K = kw["top_k"]
    V = int(counts[E + 1])
    # selection_rows is the inverse map of the sorted rows
    for t in range(T):
        for j in range(K):
            r = int(srow[t * K + j])
            if r >= 0:
                assert r < V and int(tidx[r]) == t
    assert int((srow >= 0).sum()) == V
    assert not bool(rw[V:].any())


def c_shuffle_top_k(kw):
    zb = kw["zero_buffer"]
    got = ops.shuffle_top_k(**kw)
    rk = dict(kw)
    rk.pop("zero_buffer")
    want = ref.shuffle_top_k(**rk)
    for g, w, n in zip(got, want, ("token_counts", "expert_indices", "token_indices", "row_weights", "selection_rows")):
        assert_same(g, w, n)
    if zb is not None:
        assert not bool(zb.any()), "zero_buffer not zeroed"
    # Naively: every slot whose id is in range is a row, sorted by (expert, token, slot).
    ids, w = kw["top_k_index"], kw["top_k_weights"].float()
    T, K = ids.shape
    E = kw["num_experts"]
    start = kw["expert_index_start"] or 0
    end = E if kw["expert_index_end"] is None else kw["expert_index_end"]
    slots = sorted((int(ids[t, j]), t, j) for t in range(T) for j in range(K) if start <= int(ids[t, j]) < end)
    counts, eidx, tidx, rw, srow = got
    V = len(slots)
    assert int(counts[E + 1]) == V and int(counts[E]) == T
    assert [(e - start, t) for e, t, _ in slots] == list(zip(eidx[:V].tolist(), tidx[:V].tolist()))
    assert [float(w[t, j]) for _, t, j in slots] == rw[:V].tolist()
    assert [srow[t * K + j].item() for _, t, j in slots] == list(range(V))
    assert int((srow >= 0).sum()) == V and bool((eidx[V:] == -1).all()) and not bool(rw[V:].any())


def c_gather_scale_dense_tokens(kw):
    got = ops.gather_scale_dense_tokens(**kw)
    assert_same(got, ref.gather_scale_dense_tokens(**clone_args(kw)), "out")
    rows, _ = naive_gather(kw["x"], kw["token_indices"], kw["expert_indices"], kw["scores"], kw["valid_token_count"])
    assert_same(got, rows.to(kw["x"].dtype), "out vs naive")


def c_gather_scale_quant_dense_tokens(kw):
    q, s = ops.gather_scale_quant_dense_tokens(**kw)
    rq, rs = ref.gather_scale_quant_dense_tokens(**clone_args(kw))
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    rows, written = naive_gather(
        kw["x"], kw["token_indices"], kw["expert_indices"], kw["scores"], kw["valid_token_count"]
    )
    want_scale = torch.where(written, naive_quant(rows, 1e-12, kw["scale_ub"]), 0.0)
    torch.testing.assert_close(s, want_scale, rtol=1e-6, atol=0)
    if kw["scale_ub"] is None:
        assert_fp8_near(q[written], s[written], rows[written], "dequantized rows")


def _scatter_check(fn, kw, deterministic: bool):
    out = kw["out_tokens"]
    before = out.clone()
    ret = fn(**kw)
    assert ret is out
    want = before.clone().contiguous()
    rk = clone_args(kw)
    rk.pop("deterministic", None)
    rk["out_tokens"] = want
    ref.scatter_add_dense_tokens(**rk)
    assert_same(out, want, "out_tokens")
    n_valid = _count(kw["valid_token_count"], kw["in_tokens"].shape[0])
    assert_near(out, naive_scatter(before, kw["in_tokens"], kw["token_indices"], n_valid), "out_tokens vs naive",
                scale=max(1, kw["in_tokens"].shape[0]) ** 0.5)  # fmt: skip
    hit = {int(t) for t in kw["token_indices"][: max(n_valid, 0)] if 0 <= int(t) < out.shape[0]}
    for t in range(out.shape[0]):
        if t not in hit:
            assert_same(out[t], before[t], f"untouched row {t}")


def c_scatter_add_dense_tokens(kw):
    _scatter_check(ops.scatter_add_dense_tokens, kw, kw["deterministic"])


def c_scatter_add_dense_tokens_deterministic(kw):
    _scatter_check(ops.scatter_add_dense_tokens_deterministic, kw, True)


def c_scatter_add_padded_tokens(kw):
    out = kw["out_tokens"]
    before = out.clone()
    assert ops.scatter_add_padded_tokens(**kw) is out
    rk = clone_args(kw)
    rk["out_tokens"] = before.clone()
    ref.scatter_add_padded_tokens(**rk)
    assert_same(out, rk["out_tokens"], "out_tokens")
    x, counts, tok = kw["in_tokens"], kw["token_counts"], kw["token_indices"]
    EP, T_K, _ = x.shape
    E = counts.shape[0]
    acc = torch.zeros(out.shape, dtype=torch.float64)
    o = 0
    for e in range(E):
        for _ in range(int(counts[e])):
            if o < T_K and 0 <= int(tok[o]) < out.shape[0]:
                acc[int(tok[o])] += x[e // (E // EP), o].double()
            o += 1
    assert_near(out, (before.double() + acc).to(out.dtype), "out_tokens vs naive", scale=4)


def _naive_segments(kw):
    """Expert-major rows as (source rank-major row) list, and per local expert totals."""
    c = kw["token_counts"].long()
    EP, E = c.shape
    T = kw["tokens"].shape[0]
    start = kw["expert_start"] or 0
    end = E if kw["expert_end"] is None else kw["expert_end"]
    base = []
    for r in range(EP):
        base.append(r * (T // EP) if kw["is_padded"] else int(c[:r].sum()))
    src = []
    for e in range(start, end):
        for r in range(EP):
            off = base[r] + int(c[r, :e].sum())
            src += list(range(off, off + int(c[r, e])))
    totals = [int(c[:, e].sum()) for e in range(start, end)]
    return src, totals


def c_combine_shuffling(kw):
    out, cnt = ops.combine_shuffling(**kw)
    want, wcnt = (
        ref.combine_shuffling(**clone_args(kw)) if kw["tokens"].dtype != FP8 else _ref_fp8(ref.combine_shuffling, kw)
    )
    assert_same(cnt, wcnt, "counts_out")
    src, totals = _naive_segments(kw)
    n = len(src)
    assert cnt.tolist() == totals + [n]
    assert_same(out[:n], want[:n], "tokens_out")
    if n:
        assert_same(out[:n], kw["tokens"][torch.tensor(src)], "tokens_out vs naive")


def _ref_fp8(fn, kw):
    rk = clone_args(kw)
    rk["tokens"] = rk["tokens"].view(torch.uint8)
    res = fn(**rk)
    if isinstance(res, tuple):
        return res[0].view(FP8), res[1]
    return res.view(FP8)


def c_split_shuffling(kw):
    out = ops.split_shuffling(**kw)
    fp8 = kw["tokens"].dtype == FP8
    want = _ref_fp8(ref.split_shuffling, kw) if fp8 else ref.split_shuffling(**clone_args(kw))
    src, _ = _naive_segments(kw)
    mapped = torch.zeros(kw["tokens"].shape[0], dtype=torch.bool)
    for j, s in enumerate(src):
        assert_same(out[s], kw["tokens"][j], f"row {s} vs naive")
        mapped[s] = True
    assert_same(out[mapped], want[mapped], "mapped rows")
    if kw["init_with_zeros"]:
        assert not bool(out[~mapped].float().any()), "unmapped rows not zeros"


def _naive_gemm_rows(x32, w32, groups, G, N, bias=None, w_scale=None):
    """fp32 y [M, N] (rows of group G: zeros) and the computed mask."""
    M = x32.shape[0]
    y = torch.zeros(M, N, dtype=torch.float64)
    done = torch.zeros(M, dtype=torch.bool)
    for i in range(M):
        g = groups[i]
        if g >= G:
            continue
        wg = w32[g * N : (g + 1) * N].double()
        if w_scale is not None:
            wg = wg * w_scale[g * N : (g + 1) * N].double().unsqueeze(1)
        y[i] = wg @ x32[i].double()
        if bias is not None:
            y[i] += bias.reshape(G, N)[g].double()
        done[i] = True
    return y, done


def _check_gemm_out(kw, got, y, done, out_dtype, what):
    tw = kw.get("token_weights")
    if tw is not None:
        y = y * tw.double().unsqueeze(1)
    out = kw.get("_output_tensor")
    K = kw["x"].shape[1]
    if out is None:
        assert_near(got[done], y[done].to(out_dtype), f"{what} rows", dtype=out_dtype, scale=K**0.5)
        return
    idx = kw["_scatter_add_indices"]
    M = kw["x"].shape[0]
    use = done & (idx.long() >= 0) & (idx.long() < out.shape[0])
    want = naive_scatter(kw["_before"], torch.where(use.unsqueeze(1), y, 0.0), torch.where(use, idx.long(), -1), M)
    assert_near(got, want, f"{what} scatter-added", dtype=out_dtype, scale=(K * max(M, 1)) ** 0.5)


def _gemm_ref_check(fn, rfn, kw, what):
    kw = dict(kw)
    out = kw.get("_output_tensor")
    if out is not None:
        kw["_before"] = out.clone()
    call = {k: v for k, v in kw.items() if k != "_before"}
    got = fn(**call)
    rk = clone_args(call)
    rk.pop("deterministic", None)
    if out is not None:
        rk["_output_tensor"] = kw["_before"].clone()
        assert got is out
    want = rfn(**rk)
    return kw, got, want


def c_grouped_gemm(kw):
    kw2, got, want = _gemm_ref_check(ops.grouped_gemm, ref.grouped_gemm, kw, "grouped_gemm")
    dtype = kw["x"].dtype
    K = kw["x"].shape[1]
    assert_near(got, want, "vs reference", dtype=dtype, scale=K**0.5)
    G = kw["m_sizes"].shape[0]
    N = kw["w"].shape[0] // G
    y, done = _naive_gemm_rows(kw["x"].float(), kw["w"].float(), naive_group_rows(kw["m_sizes"], kw["x"].shape[0]), G,
                               N, kw.get("bias"), kw.get("w_scale"))  # fmt: skip
    _check_gemm_out(kw2, got, y, done, dtype, "grouped_gemm")


def c_grouped_gemm_fp8_rowwise(kw):
    kw2, got, want = _gemm_ref_check(ops.grouped_gemm_fp8_rowwise, ref.grouped_gemm_fp8_rowwise, kw, "fp8")
    assert_near(got, want, "vs reference", dtype=torch.bfloat16)
    G = kw["m_sizes"].shape[0]
    N = kw["w"].shape[0] // G
    x32 = kw["x"].float() * kw["x_scale"].unsqueeze(1)
    y, done = _naive_gemm_rows(x32, kw["w"].float(), naive_group_rows(kw["m_sizes"], x32.shape[0]), G, N,
                               w_scale=kw["w_scale"])  # fmt: skip
    _check_gemm_out(kw2, got, y, done, torch.bfloat16, "grouped_gemm_fp8_rowwise")


def c_f8f8bf16_rowwise(kw):
    got = ops.f8f8bf16_rowwise(**kw)
    assert_near(got, ref.f8f8bf16_rowwise(**clone_args(kw)), "vs reference", dtype=torch.bfloat16)
    y = (kw["XQ"].double() @ kw["WQ"].double().T) * kw["x_scale"].double().unsqueeze(1) * kw["w_scale"].double()
    if kw.get("bias") is not None:
        y = y + kw["bias"].double()
    assert got.dtype == torch.bfloat16 and got.shape == y.shape
    assert_near(got, y, "vs naive", dtype=torch.bfloat16)


def c_grouped_gemm_swiglu(kw):
    got = ops.grouped_gemm_swiglu(**kw)
    want = ref.grouped_gemm_swiglu(**clone_args(kw))
    x = kw["x"]
    out_dtype = torch.bfloat16 if x.dtype == FP8 else x.dtype
    K = x.shape[1]
    assert_near(got, want, "vs reference", dtype=out_dtype, scale=K**0.5)
    G = kw["m_sizes"].shape[0]
    twoF = kw["w13"].shape[0] // G
    F = twoF // 2
    gi = kw.get("gather_indices")
    R = x.shape[0]
    src = list(range(R)) if gi is None else [int(v) for v in gi]
    x32 = x.float() * (kw["x_scale"].unsqueeze(1) if kw.get("x_scale") is not None else 1.0)
    rows = torch.stack([x32[s] if 0 <= s < R else torch.zeros(K) for s in src]) if src else torch.zeros(0, K)
    h, done = _naive_gemm_rows(rows, kw["w13"].float(), naive_group_rows(kw["m_sizes"], len(src)), G, twoF,
                               w_scale=kw.get("w_scale"))  # fmt: skip
    done &= torch.tensor([0 <= s < R for s in src], dtype=torch.bool)
    if kw.get("row_scales") is not None:
        h = h * kw["row_scales"].double().unsqueeze(1)
    z = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    assert got.shape == (len(src), F)
    assert_near(got[done], z[done].to(out_dtype), "vs naive", dtype=out_dtype, scale=K**0.5)


def c_moe_decode(kw):
    out = kw["out_TD"]
    before = out.clone()
    assert ops.moe_decode(**kw) is out
    rk = clone_args(kw)
    rk["out_TD"] = before.clone()
    ref.moe_decode(**rk)
    assert_near(out, rk["out_TD"], "vs reference", dtype=out.dtype, scale=(kw["top_k"] * kw["x_TD"].shape[1]) ** 0.5)


def c_grouped_gemm_combine(kw):
    out = kw["out"]
    before = out.clone()
    assert ops.grouped_gemm_combine(**kw) is out
    dtype, F = out.dtype, kw["z"].shape[1]
    if kw["z"].shape[0]:  # the reference indexes row_weights even without rows (IndexError at M = 0)
        rk = clone_args(kw)
        rk["out"] = before.clone()
        ref.grouped_gemm_combine(**rk)
        assert_near(out, rk["out"], "vs reference", dtype=dtype, scale=F**0.5)
    else:
        assert_same(out, before, "out with no rows")
    z, w, eidx, srow = kw["z"], kw["w"], kw["expert_indices"], kw["selection_rows"]
    T, N = out.shape
    G = w.shape[0] // N
    M = z.shape[0]
    acc = torch.zeros(T, N, dtype=torch.float64)
    if T:
        K = srow.shape[0] // T
        for t in range(T):
            for j in range(K):
                r = int(srow[t * K + j])
                if not 0 <= r < M or not 0 <= int(eidx[r]) < G:
                    continue
                e = int(eidx[r])
                we = w[e * N : (e + 1) * N].double()
                if kw.get("w_scale") is not None:
                    we = we * kw["w_scale"][e * N : (e + 1) * N].double().unsqueeze(1)
                y = we @ z[r].double()
                if kw.get("row_weights") is not None:
                    y = y * float(kw["row_weights"][r])
                acc[t] += y
    assert_near(out, (before.double() + acc).to(dtype), "vs naive", dtype=dtype, scale=F**0.5)


def c_combine_rows(kw):
    out = kw["out"]
    before = out.clone()
    assert ops.combine_rows(**kw) is out
    want = before.clone()
    ref.combine_rows(want, kw["rows"], kw["selection_rows"])
    assert_same(out, want, "out")
    T, D = out.shape
    M = kw["rows"].shape[0]
    srow = kw["selection_rows"]
    acc = torch.zeros(T, D, dtype=torch.float64)
    K = srow.shape[0] // T if T else 0
    for t in range(T):
        for j in range(K):
            r = int(srow[t * K + j])
            if 0 <= r < M:
                acc[t] += kw["rows"][r].double()
    assert_near(out, (before.double() + acc).to(out.dtype), "out vs naive", scale=2)


def _naive_quant_rows(kw, K_out: int):
    a = kw["a"].float()
    zs = kw.get("zero_start_index_M")
    if zs is not None:
        rows = a.reshape(math.prod(a.shape[:-2]), a.shape[-2], a.shape[-1]).clone()
        for gi, s in enumerate(zs.reshape(-1).tolist()):
            rows[gi, max(s, 0) :] = 0
        a = rows.reshape(a.shape)
    scale = naive_quant(a, kw["eps"], kw.get("scale_ub"))
    return a, scale


def c_quantize_fp8_row(kw):
    q, s = ops.quantize_fp8_row(**kw)
    want_q, want_s = _quantize_mod._reference(contig(kw["a"]).clone(), kw["scale_ub"], kw["zero_start_index_M"],
                                              kw["eps"], 1)  # fmt: skip
    assert_same(q, want_q, "a_fp8")
    assert_same(s, want_s, "a_scale")
    if kw["zero_start_index_M"] is None:
        rq, rs = ref.quantize_fp8_row(contig(kw["a"]).clone(), kw["scale_ub"], kw["eps"])
        assert_same(q, rq, "a_fp8 vs ref.quantize_fp8_row")
        assert_same(s, rs, "a_scale vs ref.quantize_fp8_row")
    rows, scale = _naive_quant_rows(kw, kw["a"].shape[-1])
    torch.testing.assert_close(s, scale, rtol=1e-6, atol=0)
    if kw["scale_ub"] is None:
        assert_fp8_near(q, s, rows, "dequantized")


def c_triton_quantize_fp8_row(kw):
    q, s = ops.triton_quantize_fp8_row(**kw)
    K = kw["a"].shape[-1]
    n = kw["align_rows_to"] or 1
    Kp = -(-K // n) * n
    assert q.shape == kw["a"].shape[:-1] + (Kp,)
    assert not bool(q[..., K:].float().any()), "padding columns not zeros"
    sub = dict(kw)
    sub.pop("align_rows_to")
    q1, s1 = ops.quantize_fp8_row(**sub)
    assert_same(q[..., :K], q1, "a_fp8 vs quantize_fp8_row")
    assert_same(s, s1, "a_scale vs quantize_fp8_row")


def _silu_naive(kw):
    a = kw["x0"].double()
    y = a * torch.sigmoid(a) * kw["x1"].double()
    n = min(max(_count(kw["valid_token_count"], y.shape[0]), 0), y.shape[0])
    return y, n


def c_silu_mul(kw):
    got = ops.silu_mul(**kw)
    assert_same(got, ref.silu_mul(**kw), "y")
    y, n = _silu_naive(kw)
    assert_near(got[:n], y[:n].to(got.dtype), "y vs naive")


def c_silu_mul_quant(kw):
    q, s = ops.silu_mul_quant(**kw)
    rq, rs = ref.silu_mul_quant(**kw)
    assert_same(q, rq, "y_fp8")
    assert_same(s, rs, "scale")
    y, n = _silu_naive(kw)
    torch.testing.assert_close(s[:n], naive_quant(y[:n].float(), 1e-12, kw["scale_ub"]), rtol=1e-5, atol=0)
    if kw["scale_ub"] is None:
        assert_fp8_near(q[:n], s[:n], y[:n].float(), "dequantized")


def c_rms_norm(kw):
    got = ops.rms_norm(**kw)
    want = ref.rms_norm(kw["x"], kw["gamma"], kw["eps"], True, kw["residual"]).to(kw["x"].dtype)
    assert_same(got, want, "y")
    assert got.is_contiguous()
    v = kw["x"].double() + (kw["residual"].double() if kw["residual"] is not None else 0)
    y = v * torch.rsqrt((v * v).mean(dim=-1, keepdim=True) + kw["eps"]) * kw["gamma"].double()
    finite = torch.isfinite(y)
    assert_near(got[finite], y[finite].to(got.dtype), "y vs naive", dtype=got.dtype, scale=2)


CHECKS: dict[str, Callable] = {name[2:]: fn for name, fn in globals().items() if name.startswith("c_")}


def test_every_public_op_is_fuzzed():
    assert set(ops.__all__) == set(BUILDERS) == set(CHECKS)
    assert covered_ops() <= set(BUILDERS)


@pytest.mark.parametrize("op", sorted(ops.__all__))
@VALID
@given(data=st.data())
def test_op_matches_reference(op, data):
    kw = BUILDERS[op](data.draw)
    CHECKS[op](kw)


# ----------------------------------------------------------------------------------------------
# Bad inputs: break one argument of a valid call
# ----------------------------------------------------------------------------------------------


def m_not_tensor(arg):
    return arg, lambda kw: {**kw, arg: [1.0, 2.0]}


def m_dtype(arg, dtype):
    return arg, lambda kw: {**kw, arg: kw[arg].to(dtype)}


def m_unsqueeze(arg):
    return arg, lambda kw: {**kw, arg: kw[arg].unsqueeze(0)}


def m_grow(arg, dim=0):
    def f(kw):
        t = kw[arg]
        extra = torch.zeros(t.shape[:dim] + (1,) + t.shape[dim + 1 :], dtype=t.dtype)
        return {**kw, arg: torch.cat([t, extra], dim=dim)}

    return arg, f


def m_set(arg, value, name=None):
    return name or arg, lambda kw: {**kw, arg: value(kw) if callable(value) else value}


def m_odd_rows(arg):
    """Row stride not a multiple of 8 (D + 1); needs 2+ rows."""

    def f(kw):
        t = kw[arg]
        hypothesis.assume(t.shape[-1] > 0)  # D = 0: no element is read, any stride is fine
        big = torch.zeros(t.shape[:-1] + (t.shape[-1] + 1,), dtype=t.dtype)
        big[..., : t.shape[-1]] = t
        return {**kw, arg: big[..., : t.shape[-1]]}

    return arg, needs_size(arg, -2, f)


def m_bcast(arg):
    """An in-place output whose rows alias (``expand``); needs 2+ rows."""
    return arg, needs_size(arg, -2, lambda kw: {**kw, arg: kw[arg][:1].expand(kw[arg].shape)})


def m_cols(arg, cols):
    """Last dim resized to ``cols``."""
    return arg, lambda kw: {**kw, arg: torch.zeros(kw[arg].shape[:-1] + (cols,), dtype=kw[arg].dtype)}


def m_strided_last(arg):
    """A non-unit last stride; needs a last dim of 2+."""

    def f(kw):
        t = kw[arg]
        big = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
        return {**kw, arg: big[..., ::2]}

    return arg, needs_size(arg, -1, f)


def needs_size(arg: str, dim: int, mutate):
    """The mutation, applicable when ``kw[arg].shape[dim] > 1`` (else the drawn call is skipped)."""

    def f(kw):
        hypothesis.assume(isinstance(kw.get(arg), torch.Tensor) and kw[arg].dim() >= -dim
                          and kw[arg].shape[dim] > 1)  # fmt: skip
        return mutate(kw)

    return f


_GATHER_BAD = [
    m_not_tensor("x"), m_dtype("x", torch.int32), m_dtype("x", torch.float64), m_unsqueeze("x"), m_cols("x", 12),
    m_odd_rows("x"), m_strided_last("x"),
    m_not_tensor("token_indices"), m_dtype("token_indices", torch.float32), m_dtype("token_indices", torch.int16),
    m_unsqueeze("token_indices"),
    m_dtype("expert_indices", torch.float32), m_grow("expert_indices"),
    m_not_tensor("scores"), m_dtype("scores", torch.int64), m_grow("scores"), m_unsqueeze("scores"),
    m_set("scores", lambda kw: torch.zeros(kw["x"].shape[0], 0)),
    m_set("valid_token_count", torch.tensor([1.0])), m_set("valid_token_count", torch.tensor([1, 2])),
    m_set("valid_token_count", 3),
]  # fmt: skip
_SCATTER_BAD = [
    m_not_tensor("out_tokens"), m_dtype("out_tokens", torch.int32), m_unsqueeze("out_tokens"), m_odd_rows("out_tokens"),
    m_bcast("out_tokens"),
    m_set("out_tokens", lambda kw: torch.zeros(kw["out_tokens"].shape[0], kw["out_tokens"].shape[1] + 8)),
    m_not_tensor("in_tokens"), m_dtype("in_tokens", torch.int32), m_odd_rows("in_tokens"), m_strided_last("in_tokens"),
    m_cols("in_tokens", 12),
    m_dtype("token_indices", torch.float32), m_grow("token_indices"), m_unsqueeze("token_indices"),
    m_set("valid_token_count", torch.tensor([[1, 2]])),
]  # fmt: skip
_SHUFFLE_BAD = [
    m_not_tensor("tokens"), m_dtype("tokens", torch.int32), m_unsqueeze("tokens"), m_cols("tokens", 12),
    m_odd_rows("tokens"), m_strided_last("tokens"),
    m_not_tensor("token_counts"), m_dtype("token_counts", torch.float32), m_set("token_counts", lambda kw: kw["token_counts"][0]),
    m_set("token_counts", lambda kw: torch.zeros(0, 3, dtype=torch.int32)),
    m_set("token_counts", lambda kw: torch.full_like(kw["token_counts"], -1)),
    m_set("token_counts", lambda kw: torch.full_like(kw["token_counts"], kw["tokens"].shape[0] + 1)),
    m_set("expert_start", lambda kw: kw["token_counts"].shape[1] + 1), m_set("expert_start", -1),
    m_set("expert_end", lambda kw: kw["token_counts"].shape[1] + 1), m_set("expert_start", 1.0),
    m_set("is_padded", 1),
]  # fmt: skip
_GEMM_BAD = [
    m_not_tensor("x"), m_dtype("x", torch.int32), m_unsqueeze("x"), m_cols("x", 12),
    m_not_tensor("w"), m_unsqueeze("w"), m_set("w", lambda kw: kw["w"][:-1]),
    m_set("w", lambda kw: torch.zeros(kw["w"].shape[0], kw["x"].shape[1] + 8, dtype=kw["w"].dtype)),
    m_not_tensor("m_sizes"), m_dtype("m_sizes", torch.float32), m_set("m_sizes", torch.zeros(0, dtype=torch.int32)),
    m_unsqueeze("m_sizes"),
    m_set("bias", lambda kw: torch.zeros(3)), m_set("bias", lambda kw: torch.zeros(kw["w"].shape[0]).int()),
    m_set("token_weights", lambda kw: torch.zeros(kw["x"].shape[0] + 1)),
    m_set("token_weights", lambda kw: torch.zeros(kw["x"].shape[0], dtype=torch.int32)),
]  # fmt: skip


BAD_CASES: dict[str, tuple[Callable, list]] = {
    "index_shuffling": (
        b_index_shuffling,
        [
            m_not_tensor("routing_scores"),
            m_dtype("routing_scores", torch.int32),
            m_unsqueeze("routing_scores"),
            m_set("routing_scores", lambda kw: kw["routing_scores"].reshape(-1)),
            m_set("routing_scores", lambda kw: torch.zeros(kw["routing_scores"].shape[0], 0)),
            m_set("top_k", 0),
            m_set("top_k", lambda kw: kw["routing_scores"].shape[1] + 1),
            m_set("top_k", 1.0),
            m_set("top_k", True),
            m_set("expert_index_start", -1),
            m_set("expert_index_end", lambda kw: kw["routing_scores"].shape[1] + 1),
            m_set("expert_index_start", 1.5),
            m_set("valid_token_count", torch.tensor([1.0])),
            m_set("valid_token_count", torch.tensor([1, 2])),
            m_set("valid_token_count", 4),
        ],
    ),  # fmt: skip
    "route_and_shuffle": (
        b_route_and_shuffle,
        [
            m_not_tensor("logits_TE"),
            m_dtype("logits_TE", torch.int64),
            m_unsqueeze("logits_TE"),
            m_set("top_k", 0),
            m_set("top_k", lambda kw: kw["logits_TE"].shape[1] + 1),
            m_set("top_k", 2.0),
            m_set("score_func", "relu"),
            m_set("renormalize", 1),
            m_set("routed_scaling_factor", float("nan")),
            m_set("routed_scaling_factor", "1"),
            m_set("n_group", lambda kw: kw["logits_TE"].shape[1] + 1),  # alone, or not dividing E
            m_set("e_score_correction_bias", lambda kw: torch.zeros(kw["logits_TE"].shape[1] + 1)),
            m_set("zero_buffer", torch.zeros(4, 8)[:, ::2]),
            m_set("zero_buffer", [0.0]),
            m_set("expert_index_start", lambda kw: kw["logits_TE"].shape[1] + 1),
        ],
    ),  # fmt: skip
    "shuffle_top_k": (
        b_shuffle_top_k,
        [
            m_not_tensor("top_k_index"),
            m_dtype("top_k_index", torch.float32),
            m_unsqueeze("top_k_index"),
            m_not_tensor("top_k_weights"),
            m_dtype("top_k_weights", torch.int32),
            m_grow("top_k_weights"),
            m_set("num_experts", 0),
            m_set("num_experts", 2.0),
            m_set("num_experts", True),
            m_set("expert_index_start", -1),
            m_set("expert_index_end", lambda kw: kw["num_experts"] + 1),
            m_set("zero_buffer", torch.zeros(4, 8)[:, ::2]),
            m_set("zero_buffer", [0.0]),
        ],
    ),  # fmt: skip
    "gather_scale_dense_tokens": (b_gather_scale_dense_tokens, _GATHER_BAD),
    "gather_scale_quant_dense_tokens": (
        b_gather_scale_quant_dense_tokens,
        _GATHER_BAD
        + [
            m_set("scale_ub", torch.tensor([1.0], dtype=torch.float64)),
            m_set("scale_ub", torch.tensor([1.0, 2.0])),
            m_set("scale_ub", 1.0),
        ],
    ),  # fmt: skip
    "scatter_add_dense_tokens": (b_scatter_add_dense_tokens, _SCATTER_BAD + [m_set("deterministic", 1)]),
    "scatter_add_dense_tokens_deterministic": (b_scatter_add_dense_tokens_deterministic, _SCATTER_BAD),
    "scatter_add_padded_tokens": (
        b_scatter_add_padded_tokens,
        [
            m_not_tensor("in_tokens"),
            m_dtype("in_tokens", torch.int32),
            m_set("in_tokens", lambda kw: kw["in_tokens"][0]),
            m_set("in_tokens", lambda kw: kw["in_tokens"][:0]),
            m_cols("in_tokens", 12),
            m_odd_rows("in_tokens"),
            m_not_tensor("token_counts"),
            m_dtype("token_counts", torch.float32),
            m_unsqueeze("token_counts"),
            m_set(
                "token_counts",
                lambda kw: (
                    torch.zeros(kw["in_tokens"].shape[0] * 2 + 1, dtype=torch.int32)
                    if kw["in_tokens"].shape[0] > 1
                    else torch.zeros(0, 2, dtype=torch.int32)
                ),
            ),
            m_dtype("token_indices", torch.float32),
            m_grow("token_indices"),
            m_set(
                "out_tokens",
                lambda kw: kw["out_tokens"].to(
                    torch.float32 if kw["out_tokens"].dtype != torch.float32 else torch.bfloat16
                ),
            ),
            m_cols("out_tokens", 32),
            m_unsqueeze("out_tokens"),
            m_bcast("out_tokens"),
        ],
    ),  # fmt: skip
    "combine_shuffling": (b_combine_shuffling, _SHUFFLE_BAD),
    "split_shuffling": (b_split_shuffling, _SHUFFLE_BAD + [m_set("init_with_zeros", 0)]),
    "grouped_gemm": (
        lambda draw: _plain_gemm(draw),
        _GEMM_BAD
        + [
            m_dtype("w", torch.float64),
            m_set("_output_tensor", lambda kw: torch.zeros(2, kw["w"].shape[0] // kw["m_sizes"].shape[0] + 8)),
            m_set("_scatter_add_indices", lambda kw: torch.zeros(kw["x"].shape[0])),
            m_set("w_scale", lambda kw: torch.ones(kw["w"].shape[0]), name="w"),
            m_bcast("_output_tensor"),
        ],
    ),  # fmt: skip
    "grouped_gemm_fp8_rowwise": (
        b_grouped_gemm_fp8_rowwise,
        [
            m_not_tensor("x"),
            m_dtype("x", torch.bfloat16),
            m_cols("x", 12),
            m_dtype("w", torch.bfloat16),
            m_dtype("m_sizes", torch.float32),
            m_set("m_sizes", torch.zeros(0, dtype=torch.int64)),
            m_grow("x_scale"),
            m_dtype("x_scale", torch.bfloat16),
            m_not_tensor("x_scale"),
            m_grow("w_scale"),
            m_dtype("w_scale", torch.float64),
            m_set("token_weights", lambda kw: torch.zeros(kw["x"].shape[0] + 2)),
        ],
    ),  # fmt: skip
    "f8f8bf16_rowwise": (
        b_f8f8bf16_rowwise,
        [
            m_not_tensor("XQ"),
            m_dtype("XQ", torch.bfloat16),
            m_unsqueeze("XQ"),
            m_cols("XQ", 12),
            m_dtype("WQ", torch.float32),
            m_cols("WQ", 16),
            m_set("WQ", lambda kw: torch.zeros(12, kw["XQ"].shape[1]).to(FP8)),
            m_grow("x_scale"),
            m_dtype("x_scale", torch.bfloat16),
            m_grow("w_scale"),
            m_not_tensor("w_scale"),
            m_set("bias", lambda kw: torch.zeros(kw["WQ"].shape[0] + 1)),
            m_set("bias", lambda kw: torch.zeros(kw["WQ"].shape[0]).int()),
        ],
    ),  # fmt: skip
    "grouped_gemm_swiglu": (
        b_grouped_gemm_swiglu,
        [
            m_not_tensor("x"),
            m_dtype("x", torch.int32),
            m_unsqueeze("x"),
            m_set("w13", lambda kw: kw["w13"][:-1]),
            m_not_tensor("w13"),
            m_dtype("m_sizes", torch.float32),
            m_set("m_sizes", torch.zeros(0, dtype=torch.int32)),
            m_set("gather_indices", lambda kw: torch.zeros(3)),
            m_set("gather_indices", lambda kw: torch.zeros(2, 2, dtype=torch.int32)),
            m_set(
                "row_scales",
                lambda kw: torch.zeros(
                    (kw["gather_indices"].shape[0] if kw.get("gather_indices") is not None else kw["x"].shape[0]) + 1
                ),
            ),
            m_set("w_scale", lambda kw: torch.ones(3, dtype=torch.float64)),
        ],
    ),  # fmt: skip
    "moe_decode": (
        b_moe_decode,
        [
            m_not_tensor("x_TD"),
            m_dtype("x_TD", torch.int32),
            m_unsqueeze("x_TD"),
            m_not_tensor("logits_TE"),
            m_dtype("logits_TE", torch.int32),
            m_grow("logits_TE"),
            m_dtype("out_TD", torch.int32),
            m_grow("out_TD"),
            m_set("w2_eDF", lambda kw: kw["w2_eDF"][:, :, :-1].contiguous()),
            m_set("w13_e2FD", lambda kw: kw["w13_e2FD"][:, 1:].contiguous()),
            m_set("top_k", 0),
            m_set("top_k", lambda kw: kw["logits_TE"].shape[1] + 1),
            m_set("score_func", "relu"),
        ],
    ),  # fmt: skip
    "grouped_gemm_combine": (
        b_grouped_gemm_combine,
        [
            m_not_tensor("z"),
            m_dtype("z", torch.int32),
            m_strided_last("z"),
            m_unsqueeze("z"),
            m_not_tensor("out"),
            m_dtype("out", torch.int32),
            m_strided_last("out"),
            m_bcast("out"),
            m_set("w", lambda kw: kw["w"][:, :-1].contiguous()),
            m_not_tensor("w"),
            m_dtype("expert_indices", torch.float32),
            m_grow("expert_indices"),
            m_dtype("selection_rows", torch.float32),
            m_unsqueeze("selection_rows"),
            m_set("row_weights", lambda kw: torch.zeros(kw["z"].shape[0] + 1)),
        ],
    ),  # fmt: skip
    "combine_rows": (
        b_combine_rows,
        [
            m_not_tensor("out"),
            m_dtype("out", torch.int32),
            m_strided_last("out"),
            m_unsqueeze("out"),
            m_not_tensor("rows"),
            m_set(
                "rows",
                lambda kw: kw["rows"].to(torch.float32 if kw["rows"].dtype != torch.float32 else torch.float16),
                name="out",
            ),
            m_cols("rows", 25),
            m_strided_last("rows"),
            m_dtype("selection_rows", torch.float32),
            m_unsqueeze("selection_rows"),
            m_set(
                "selection_rows", lambda kw: torch.zeros(2 * kw["selection_rows"].shape[0] + 1, dtype=torch.int32)[::2]
            ),
            (
                "selection_rows",
                needs_size(
                    "out",
                    -2,
                    lambda kw: {  # not T * K entries (T >= 2)
                        **kw,
                        "selection_rows": torch.zeros(kw["out"].shape[0] * 3 + 1, dtype=torch.int32),
                    },
                ),
            ),
        ],
    ),  # fmt: skip
    "quantize_fp8_row": (
        b_quantize_fp8_row,
        [
            m_not_tensor("a"),
            m_dtype("a", torch.int32),
            m_dtype("a", torch.float64),
            m_set("a", torch.tensor(1.0)),
            m_strided_last("a"),
            m_set("scale_ub", torch.tensor([1.0, 2.0])),
            m_set("scale_ub", torch.tensor([1.0], dtype=torch.bfloat16)),
            m_set("zero_start_index_M", torch.zeros(0, 1, dtype=torch.float32)),
            m_set("eps", 0.0),
            m_set("eps", -1.0),
            m_set("eps", "0.1"),
            m_set("eps", float("inf")),
            m_set("use_triton", 1),
            m_set("output_device", "nodevice"),
        ],
    ),  # fmt: skip
    "triton_quantize_fp8_row": (
        b_triton_quantize_fp8_row,
        [
            m_not_tensor("a"),
            m_dtype("a", torch.int32),
            m_strided_last("a"),
            m_set("a", torch.tensor(1.0)),
            m_set("align_rows_to", 0),
            m_set("align_rows_to", 2.0),
            m_set("eps", 0.0),
            m_set("scale_ub", torch.tensor([[1.0, 2.0]])),
        ],
    ),  # fmt: skip
    "silu_mul": (
        b_silu_mul,
        [
            m_not_tensor("x0"),
            m_dtype("x0", torch.int32),
            m_strided_last("x0"),
            m_unsqueeze("x0"),
            m_not_tensor("x1"),
            m_dtype("x1", torch.float64),
            m_strided_last("x1"),
            m_grow("x1", 0),
            m_grow("x1", 1),
            m_set("valid_token_count", torch.tensor([0.5])),
        ],
    ),  # fmt: skip
    "silu_mul_quant": (
        b_silu_mul_quant,
        [
            m_dtype("x0", torch.int32),
            m_strided_last("x0"),
            m_grow("x1", 1),
            m_set("valid_token_count", torch.tensor([1, 1])),
            m_set("scale_ub", torch.tensor([1.0], dtype=torch.float16)),
            m_set("scale_ub", 2.0),
        ],
    ),  # fmt: skip
    "rms_norm": (
        b_rms_norm,
        [
            m_not_tensor("x"),
            m_dtype("x", torch.int32),
            m_strided_last("x"),
            m_set("x", torch.tensor(1.0)),
            m_not_tensor("gamma"),
            m_grow("gamma"),
            m_dtype("gamma", torch.float64),
            m_unsqueeze("gamma"),
            m_set("residual", lambda kw: torch.zeros(kw["x"].shape[:-1] + (kw["x"].shape[-1] + 1,))),
            m_set("residual", lambda kw: torch.zeros(kw["x"].shape, dtype=torch.int32)),
            m_set("eps", -1e-6),
            m_set("eps", float("nan")),
            m_set("eps", True),
            m_set("eps", "1e-6"),
        ],
    ),  # fmt: skip
}


def _plain_gemm(draw):
    """grouped_gemm without the weight-only FP8 variant (the mutations change x / w dtypes)."""
    kw = b_grouped_gemm(draw)
    if kw.get("w_scale") is not None:
        kw.pop("w_scale")
        kw["w"] = kw["w"].float().to(kw["x"].dtype)
    return kw


_BAD_PARAMS = [(op, i) for op in sorted(BAD_CASES) for i in range(len(BAD_CASES[op][1]))]


def test_every_public_op_has_bad_inputs():
    assert set(BAD_CASES) == set(ops.__all__)


@pytest.mark.parametrize("op,case", _BAD_PARAMS, ids=[f"{op}-{BAD_CASES[op][1][i][0]}-{i}" for op, i in _BAD_PARAMS])
@BAD
@given(data=st.data())
def test_bad_input_is_refused(op, case, data):
    build, cases = BAD_CASES[op]
    name, mutate = cases[case]
    kw = build(data.draw)
    fn = getattr(ops, op)
    fn(**clone_args(kw))  # the unbroken call is accepted
    bad = mutate(dict(kw))
    ex_names(lambda: fn(**bad), name)
