"""The experimental Gluon grouped GEMM (``moekit.ops._triton.gg_gluon``): its argument errors and
its sm_90 compile on the CPU, its rows against a float32 reference on the GPU (Gluon has no
interpreter)."""

from __future__ import annotations


import pytest
import torch

from moekit.testing import assert_close

_COMPILE = r"""
import json, os, re, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
import moekit.ops._triton.gg_gluon as GG

out = []
for (G, N, K, block, nbuf, co, dp, ws, dt, hv, *sc) in json.loads(os.environ["CASES"]):
    bm, bn, bk = block
    tdt, gdt = (torch.float8_e4m3fn, gl.float8e4nv) if dt == "fp8" else (torch.bfloat16, gl.bfloat16)
    x = torch.empty((4096, K), dtype=tdt, device="meta")
    w = torch.empty((G * N, K), dtype=tdt, device="meta")
    lay = lambda b: gl.NVMMASharedLayout.get_default_for(b, gdt)
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk], lay([bm, bk]))
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk], lay([bn, bk]))
    kernel = GG._gg_gluon_ws_kernel if ws else GG._gg_gluon_kernel
    sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "y_ptr": "*bf16", "rs_ptr": "*fp32"}
    if ws:
        sig.update(xs_ptr="*fp32", ws_ptr="*fp32", idx_ptr="*i32")
    sig.update(m_sizes_ptr="*i32", M="i32", N="i32", K="i32", G="i32", stride_ym="i32")
    consts = {"HAS_RS": True, "G_BLOCK": max(32, triton.next_power_of_2(G)), "NUM_BUF": nbuf}
    consts.update(HALVES=hv, SCATTER=bool(sc and sc[0])) if ws else consts.update(COALESCE=co, DEPTH=dp)
    consts["num_warps"] = 4 if hv else 8
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("N", "K", "stride_ym")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    c = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout.splitlines()
    st = re.search(r"STACK:(\d+)", res)
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:  # ptxas says when it serializes the wgmma (too few registers)
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        info = subprocess.run([os.path.join(os.path.dirname(tool), "ptxas"), "-arch=sm_90a", "-v", src, "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True).stderr
    out.append({"shared": int(c.metadata.shared), "stack": int(st.group(1)) if st else None,
                "loop_spills": sass_loop_spills(sass), "serialized": "C7512" in info,
                "adds": {op: sum(op + ".E.ADD" in ln for ln in sass) for op in ("ATOMG", "REDG")},
                "redg_bf16x8": sum("REDG.E.ADD.BF16x8" in ln for ln in sass),
                "wgmma": ptx.count("wgmma.mma_async"), "fp8_wgmma": ptx.count(".e4m3.e4m3"),
                "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg")})
print("@@" + json.dumps(out))
"""

# (G, N, K, block, buffers, coalesced epilogue, MMA groups in flight, warp-specialized, dtype, one
# partition per 64-row half): the benchmark's tiles
CASES = [
    (128, 2048, 768, (128, 256, 64), 4, False, 0, False, "bf16", False),
    (128, 2048, 768, (128, 256, 64), 4, False, 1, False, "bf16", False),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, False, "bf16", False),
    (256, 7168, 256, (128, 128, 64), 4, False, 1, False, "bf16", False),
    (128, 2880, 2880, (128, 128, 64), 5, True, 1, False, "bf16", False),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, True, "bf16", False),
    (256, 7168, 256, (128, 256, 64), 2, True, 1, True, "bf16", False),
    (128, 2048, 768, (128, 256, 128), 3, True, 1, True, "fp8", False),
    (256, 512, 7168, (128, 256, 128), 3, True, 1, True, "fp8", False),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, True, "bf16", True),
    (128, 2048, 768, (128, 256, 128), 3, True, 1, True, "fp8", True),
    (128, 2048, 768, (128, 256, 32), 6, True, 1, True, "bf16", True),
    # (the rows added at their token indices: the layer's down projection summed into its tokens)
    (128, 2048, 768, (128, 256, 128), 3, True, 1, True, "fp8", False, True),
    (256, 7168, 256, (128, 256, 128), 3, True, 1, True, "fp8", True, True),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, True, "bf16", False, True),
]


@pytest.mark.reference
def test_errors_name_what_was_expected():
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon

    ms = torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        grouped_gemm_gluon(torch.zeros(4, 16), torch.zeros(8, 16), ms)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        grouped_gemm_gluon(torch.zeros(4, 16).bfloat16(), torch.zeros(8, 16).half(), ms)
    with pytest.raises(ValueError, match=r"\[G \* N, K\]"):
        grouped_gemm_gluon(torch.zeros(4, 16).bfloat16(), torch.zeros(7, 16).bfloat16(), ms)
    with pytest.raises(ValueError, match=r"\[G \* N, K\]"):
        grouped_gemm_gluon(torch.zeros(4, 16).bfloat16(), torch.zeros(8, 32).bfloat16(), ms)


@pytest.mark.reference
def test_kernel_compiles_for_sm90_without_spills():
    """Every benchmarked tile compiles through ptxas for sm_90 with no stack, within one block's
    227 KB of shared memory, its MMAs as wgmma and its loads as TMA copies; the warp-specialized
    kernel's partitions with their own register budgets; its scatter-add as ``REDG.E.ADD.BF16x8``."""
    from tests.ops._sm90 import run_compile_script

    recs = run_compile_script(_COMPILE, CASES)
    for case, r in zip(CASES, recs):
        # (the warp-specialized kernel keeps a few tile-loop scalars on the stack, the store warps
        # at 48 registers and the MMA partitions with FP8's column scales: a few 4-byte loads and
        # stores a tile, none in the MMA loops)
        assert r["stack"] in (0, None) or (case[7] and r["stack"] <= 128), (case, r)
        assert r["loop_spills"] == 0, (case, r)
        assert not r["serialized"], (case, r)
        assert (r["setmaxnreg"] > 0) == case[7], (case, r)  # the partitions' register budgets
        assert (r["fp8_wgmma"] > 0) == (case[8] == "fp8"), (case, r)
        assert r["shared"] <= 227 * 1024, (case, r)
        assert r["wgmma"] > 0 and r["tma"] > 0, (case, r)
        # rows added at their indices: fire-and-forget 16-byte bf16 reductions, none read back
        scatter = len(case) > 10 and case[10]
        assert (r["adds"]["REDG"] > 0) == scatter and r["adds"]["ATOMG"] == 0, (case, r)
        assert not scatter or r["redg_bf16x8"] == r["adds"]["REDG"], (case, r)


def _reference(x, w, ms, rs):
    G = ms.shape[0]
    N = w.shape[0] // G
    out = torch.zeros(x.shape[0], N)
    r0 = 0
    for g, n in enumerate(ms.tolist()):
        out[r0 : r0 + n] = x[r0 : r0 + n].float() @ w[g * N : (g + 1) * N].float().t()
        r0 += n
    if rs is not None:
        out *= rs.float()[:, None]
    return out, r0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg", [((128, 256, 64), 4, False, 0, False), ((128, 256, 64), 4, False, 1, False),
            ((128, 256, 64), 3, True, 1, False), ((128, 128, 64), 5, True, 1, False),
            ((128, 256, 64), 3, True, 1, True), ((128, 256, 64), 2, True, 1, True),
            ((128, 256, 64), 3, True, 1, True, True), ((128, 256, 32), 6, True, 1, True, True)]
)  # fmt: skip
@pytest.mark.parametrize("scaled", [True, False])
def test_gpu_matches_reference(dtype, cfg, scaled):
    """Ragged groups (empty ones, a group over several row tiles, the last tile of a group ending
    mid-tile), N and K not multiples of the tile (200 and 200: the weights' next group and
    zero-filled K), rows past the groups left untouched."""
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon

    torch.manual_seed(0)
    G, N, K = 6, 200, 200
    ms = torch.tensor([0, 300, 5, 0, 129, 64], dtype=torch.int32, device="cuda")
    M = int(ms.sum()) + 7
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = (torch.randn(G * N, K, device="cuda") / K**0.5).to(dtype)
    rs = torch.rand(M, device="cuda") + 0.5 if scaled else None
    y = torch.full((M, N), 7.0, device="cuda", dtype=dtype)
    block, nbuf, co, dp, ws, *hv = cfg  # (hv: one MMA partition per 64-row half, groups of 5 and 64 rows)
    grouped_gemm_gluon(x, w, ms, rs, out=y, block=block, num_buf=nbuf, coalesce=co, depth=dp, ws=ws, halves=bool(hv))
    want, used = _reference(x.cpu(), w.cpu(), ms.cpu(), None if rs is None else rs.cpu())
    assert_close(y[:used].float().cpu(), want[:used], tol=2e-2, msg=str(cfg))
    assert (y[used:] == 7.0).all()


@pytest.mark.gpu
def test_gpu_many_tiles_per_program_match_the_triton_kernel():
    """Qwen3-30B's down projection at T=2048 (16384 rows over 128 experts): every program walks
    several tiles, each across the pipeline of the one before; the rows match the library's
    Triton grouped GEMM within bf16 rounding; the warp-specialized kernel too, its partitions
    walking the same tiles (a TMA warp, the MMA warpgroups, the store warps)."""
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon
    from moekit.ops._triton.grouped_gemm import grouped_gemm
    from moekit.testing.data import random_m_sizes

    G, N, K, M = 128, 2048, 768, 16384
    ms = random_m_sizes(M, G, 8, device="cuda", seed=1)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(G * N, K, device="cuda") / K**0.5).bfloat16()
    rs = torch.rand(M, device="cuda") + 0.5
    want = grouped_gemm(x, w, ms, token_weights=rs)
    for block, nbuf, co, dp, ws, hv in [
        ((128, 256, 64), 4, False, 0, False, False),
        ((128, 256, 64), 3, True, 1, False, False),
        ((128, 256, 64), 3, True, 1, True, False),
        ((128, 256, 64), 3, True, 1, True, True),
    ]:
        got = grouped_gemm_gluon(x, w, ms, rs, block=block, num_buf=nbuf, coalesce=co, depth=dp, ws=ws, halves=hv)
        assert_close(got.float(), want.float(), tol=1e-2, msg=str(block))


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [True, False])
def test_gpu_fp8_matches_the_triton_kernel(scaled):
    """FP8 e4m3 rows and weights with row-wise scales (the warp-specialized kernel): Qwen3-30B's
    down projection at T=2048 and a ragged small case (N and K off the tile, empty groups) against
    the library's FP8 grouped GEMM on the same quantized operands."""
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon
    from moekit.ops._triton.grouped_gemm import grouped_gemm
    from moekit.reference.quantize import quantize_fp8_row
    from moekit.testing.data import random_m_sizes

    for G, N, K, ms in [
        (128, 2048, 768, random_m_sizes(16384, 128, 8, seed=2)),
        (6, 200, 272, torch.tensor([0, 300, 5, 0, 129, 64], dtype=torch.int32)),
    ]:
        M = int(ms.sum())
        xq, xs = quantize_fp8_row(torch.randn(M, K))
        wq, wsc = quantize_fp8_row(torch.randn(G * N, K) / K**0.5)
        xq, xs, wq, wsc, ms = (t.cuda() for t in (xq, xs, wq, wsc, ms))
        rs = torch.rand(M, device="cuda") + 0.5 if scaled else None
        want = grouped_gemm(xq, wq, ms, x_scale=xs, w_scale=wsc, token_weights=rs)
        for hv in (False, True):
            got = grouped_gemm_gluon(xq, wq, ms, rs, x_scale=xs, w_scale=wsc, halves=hv)
            assert got.dtype == torch.bfloat16
            assert_close(got.float(), want.float(), tol=2e-2, msg=f"G={G} N={N} K={K} halves={hv}")


@pytest.mark.reference
def test_fp8_errors_name_what_was_expected():
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon

    ms = torch.tensor([2, 2], dtype=torch.int32)
    x8 = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    w8 = torch.zeros(8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="FP8"):
        grouped_gemm_gluon(x8, torch.zeros(8, 16).bfloat16(), ms)
    with pytest.raises(ValueError, match="x_scale"):
        grouped_gemm_gluon(x8, w8, ms)
    with pytest.raises(ValueError, match="ws=True"):
        grouped_gemm_gluon(x8, w8, ms, x_scale=torch.ones(4), w_scale=torch.ones(8), ws=False)
    with pytest.raises(ValueError, match="halves"):
        grouped_gemm_gluon(x8, w8, ms, x_scale=torch.ones(4), w_scale=torch.ones(8), halves=True, block=(64, 256, 128))
    with pytest.raises(ValueError, match=r"x_scale must be \[4\]"):
        grouped_gemm_gluon(x8, w8, ms, x_scale=torch.ones(3), w_scale=torch.ones(8))


@pytest.mark.reference
def test_layer_takes_the_gluon_rows_only_where_asked_and_able(monkeypatch):
    """``experts._gluon_rows``: None with the knob off, and on CPU tensors with it on (the Triton
    or CPU path runs); the knob's default resolved per dtype and Triton release."""
    from moekit import settings
    from moekit.layers import experts

    z = torch.zeros(8, 32).bfloat16()
    w = torch.zeros(2 * 16, 32).bfloat16()
    ms = torch.tensor([4, 4], dtype=torch.int32)
    assert experts._gluon_rows(z, w, ms, None) is None
    with settings.override(knobs={"GLUON_DOWN": True}):
        assert experts._gluon_rows(z, w, ms, None) is None
    # the default: FP8 rows only, and only on the Triton release the kernel was validated with
    assert experts._gluon_mode(False) == 0
    assert experts._gluon_mode(True) == (1 if experts._gluon_triton() else 0)
    assert experts._gluon_mode(True, 2048) == experts._gluon_mode(True, 7168) == experts._gluon_mode(True)
    assert experts._gluon_mode(True, 2880) == 0  # (gpt-oss-120b: the last 256-column tile a quarter full)
    for knob, want in ((0, 0), (1, 1), (2, 2)):
        with settings.override(knobs={"GLUON_DOWN": knob}):
            assert experts._gluon_mode(True) == want and experts._gluon_mode(False) == want
    experts._gluon_triton.cache_clear()
    try:
        monkeypatch.setattr(experts, "_GLUON_TRITON", "0.0.")
        assert experts._gluon_mode(True) == 0
    finally:
        monkeypatch.undo()
        experts._gluon_triton.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_layer_with_the_gluon_down_rows(fp8):
    """``moe_forward`` with knob ``GLUON_DOWN`` (the stored down rows through the warp-specialized
    Gluon kernel; rows stored from 1 routed row here) against the same layer without it, and the
    float32 reference (``moe_decode``'s: the dense layer from logits, any T)."""
    from moekit import settings
    from moekit.layers.functional import moe_forward

    x, logits, w13, w2, kw, cfg = layer_case(512, fp8)
    # (one override per run: nested ones merge their knobs into the outer ones)
    with settings.override(decode_fused="off", knobs={"DOWN_SUM_MIN_ROWS": 1, "GLUON_DOWN": 0}):
        base = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    with settings.override(decode_fused="off", knobs={"DOWN_SUM_MIN_ROWS": 1, "GLUON_DOWN": 1}):
        got = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    with settings.override(decode_fused="off", knobs={"DOWN_SUM_MIN_ROWS": 1}):  # the default: Gluon rows for FP8 only
        dflt = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    assert torch.equal(dflt, got if fp8 else base)
    assert_close(got.float(), base.float(), tol=1e-2, msg=f"fp8={fp8}")
    want = layer_reference(x, logits, w13, w2, kw)
    assert_close(got.cpu().float(), want.float(), tol=6e-2 if fp8 else 3e-2, msg=f"fp8={fp8}")


def layer_case(T: int, fp8: bool, E: int = 16, D: int = 512, F: int = 256, k: int = 8):
    """A small layer on the GPU for the Gluon paths' layer tests (seeded): ``(x, logits, w13, w2,
    kw, cfg)``, ``kw`` the FP8 weights' scales for ``moe_forward`` (empty for bf16)."""
    from moekit.layers.functional import RoutingConfig, quantize_expert_weights

    torch.manual_seed(0)
    x = torch.randn(T, D, device="cuda").bfloat16()
    logits = torch.randn(T, E, device="cuda")
    w13 = (torch.randn(E, 2 * F, D, device="cuda") / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device="cuda") / F**0.5).bfloat16()
    kw = {}
    if fp8:
        w13, s13 = quantize_expert_weights(w13)
        w2, s2 = quantize_expert_weights(w2)
        kw = dict(w13_scale_e2F=s13, w2_scale_eD=s2)
    cfg = RoutingConfig(top_k=k, score_func="softmax", renormalize=True, apply_router_weight_on_input=False)
    return x, logits, w13, w2, kw, cfg


def layer_reference(x, logits, w13, w2, kw, k: int = 8):
    """The float32 reference of ``layer_case``'s layer (``moe_decode``'s: the dense layer from
    logits, any T), on the CPU."""
    from moekit import reference as ref

    return ref.moe_decode(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), torch.zeros(x.shape).bfloat16(), top_k=k,
                          score_func="softmax", renormalize=True, **{n: v.cpu() for n, v in kw.items()})  # fmt: skip


@pytest.mark.reference
def test_scatter_errors_name_what_was_expected():
    """``scatter_indices`` needs the warp-specialized kernel, an ``out [T, N]`` in the rows' output
    dtype and int32 indices, one per row."""
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon

    ms = torch.tensor([2, 2], dtype=torch.int32)
    x, w = torch.zeros(4, 16).bfloat16(), torch.zeros(8, 16).bfloat16()
    idx = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="ws=True"):
        grouped_gemm_gluon(x, w, ms, out=torch.zeros(3, 4).bfloat16(), scatter_indices=idx, ws=False)
    with pytest.raises(ValueError, match=r"out \[T, 4\] torch.bfloat16.*got None"):
        grouped_gemm_gluon(x, w, ms, scatter_indices=idx)
    with pytest.raises(ValueError, match=r"out \[T, 4\] torch.bfloat16.*got \(3, 4\) torch.float32"):
        grouped_gemm_gluon(x, w, ms, out=torch.zeros(3, 4), scatter_indices=idx)
    with pytest.raises(ValueError, match=r"int32 \[4\], got torch.int64 \(4,\)"):
        grouped_gemm_gluon(x, w, ms, out=torch.zeros(3, 4).bfloat16(), scatter_indices=idx.long())
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"out \[T, 4\] torch.bfloat16"):  # FP8 rows add into bf16
        grouped_gemm_gluon(x8, w8, ms, out=torch.zeros(3, 4).half(), scatter_indices=idx, x_scale=torch.ones(4),
                           w_scale=torch.ones(8))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("halves", [False, True])
def test_gpu_scatter_matches_the_triton_kernel(fp8, halves):
    """The store warps' scatter-add: Qwen3-30B's down projection at T=1024 (128 experts, ragged
    groups, every program over several tiles, router weights on the rows) and a small ragged case
    (N and K off the tile, empty groups, dropped rows: index -1) added into a non-zero ``out``,
    against the library's Triton scatter-add on the same operands."""
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon
    from moekit.ops._triton.grouped_gemm import grouped_gemm
    from moekit.reference.quantize import quantize_fp8_row
    from moekit.testing.data import random_m_sizes

    torch.manual_seed(3)
    for G, N, K, T, ms in [
        (128, 2048, 768, 1024, random_m_sizes(8192, 128, 8, seed=5)),
        (6, 200, 272, 150, torch.tensor([0, 300, 5, 0, 129, 64], dtype=torch.int32)),
    ]:
        M = int(ms.sum())
        x = torch.randn(M, K)
        w = torch.randn(G * N, K) / K**0.5
        idx = torch.randint(0, T, (M,), dtype=torch.int32)
        idx[::7] = -1
        rs = torch.rand(M) + 0.5
        if fp8:
            (x, xs), (w, wsc) = quantize_fp8_row(x), quantize_fp8_row(w)
            scales = dict(x_scale=xs.cuda(), w_scale=wsc.cuda())
        else:
            x, w, scales = x.bfloat16(), w.bfloat16(), {}
        x, w, ms, idx, rs = (t.cuda() for t in (x, w, ms, idx, rs))
        out0 = torch.randn(T, N, device="cuda").bfloat16()
        want = out0.clone()
        grouped_gemm(x, w, ms, token_weights=rs, out=want, scatter_indices=idx, **scales)
        got = out0.clone()
        res = grouped_gemm_gluon(x, w, ms, rs, out=got, scatter_indices=idx, halves=halves, **scales)
        assert res is got
        assert_close(got.float(), want.float(), tol=2e-2, msg=f"G={G} N={N} K={K} halves={halves}")
