"""The experimental Gluon gate/up GEMM with its SwiGLU epilogue (``gg_gluon_swiglu``): sm_90
compile through ptxas on CPU (no wgmma serialized, cp.async rows and TMA weights), argument
errors, and on a Hopper GPU the rows against the library's Triton ``grouped_gemm_swiglu``."""

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
import moekit.ops._triton.gg_gluon_swiglu as S

out = []
nv = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for (G, F, K, block, nbuf, dt, pair) in json.loads(os.environ["CASES"]):
    bm, bn, bk = block
    tdt, gdt, xp = ((torch.float8_e4m3fn, gl.float8e4nv, "*fp8e4nv") if dt == "fp8"
                    else (torch.bfloat16, gl.bfloat16, "*bf16"))
    w = torch.empty((G * 2 * F, K), dtype=tdt, device="meta")
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk],
                          gl.NVMMASharedLayout.get_default_for([bn, bk], gdt))
    sig = {"x_ptr": xp, "w_desc": mangle_type(wd), "z_ptr": "*bf16", "gather_ptr": "*i32", "xs_ptr": "*fp32",
           "ws_ptr": "*fp32", "rs_ptr": "*fp32", "m_sizes_ptr": "*i32", "M": "i32", "F": "i32", "K": "i32",
           "G": "i32", "T_IN": "i32", "stride_xm": "i32", "stride_zm": "i32", "FLAGS": "i32"}
    consts = {"G_BLOCK": max(32, triton.next_power_of_2(G)), "BLOCK_M": bm, "BLOCK_K": bk, "NUM_BUF": nbuf,
              "PAIR": pair, "num_warps": 4}
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("F", "K", "stride_xm", "stride_zm")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    c = triton.compile(GluonASTSource(S._gg_swiglu_gluon_kernel, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        info = subprocess.run([os.path.join(nv, "ptxas"), "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.o")],
                              capture_output=True, text=True).stderr
    out.append({"shared": int(c.metadata.shared), "serialized": "C7512" in info or "serialized" in info,
                "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
                "cp_async": ptx.count("cp.async.cg.shared") + ptx.count("cp.async.ca.shared"),
                "noinc": ptx.count("cp.async.mbarrier.arrive.noinc")})
print("@@" + json.dumps(out))
"""

# (G, F, K, block, buffers, dtype, one N = 2 BN MMA a step): Qwen3-30B's and DeepSeek-V3 TP8's
# gate/up, bf16 and FP8
CASES = [
    (128, 768, 2048, (128, 128, 64), 3, "bf16", False),
    (128, 768, 2048, (128, 128, 32), 7, "bf16", False),
    (256, 256, 7168, (128, 128, 64), 3, "bf16", False),
    (128, 768, 2048, (128, 128, 128), 3, "fp8", False),
    (128, 768, 2048, (128, 128, 64), 3, "bf16", True),
    (256, 256, 7168, (128, 128, 64), 3, "bf16", True),
    (128, 768, 2048, (128, 128, 128), 3, "fp8", True),
    (128, 768, 2048, (128, 128, 64), 4, "bf16", True),
    (128, 768, 2048, (128, 128, 128), 4, "fp8", True),
]


@pytest.mark.reference
def test_kernel_compiles_for_sm90_with_its_mmas_pipelined():
    """Every benchmarked tile compiles through ptxas for sm_90 within one block's 227 KB of
    shared memory, its wgmma not serialized (ptxas says so when the MMA partitions lack the
    registers), rows through cp.async with counted arrivals on the stage barriers, weights
    through TMA."""
    from tests.ops._sm90 import run_compile_script

    recs = run_compile_script(_COMPILE, CASES)
    for case, r in zip(CASES, recs):
        assert not r["serialized"], (case, r)
        assert r["shared"] <= 227 * 1024, (case, r)
        assert r["wgmma"] > 0 and r["tma"] > 0 and r["cp_async"] > 0 and r["noinc"] > 0, (case, r)


@pytest.mark.reference
def test_errors_name_what_was_expected():
    from moekit.ops._triton.gg_gluon_swiglu import grouped_gemm_swiglu_gluon

    ms = torch.tensor([2, 2], dtype=torch.int32)
    x = torch.zeros(4, 16).bfloat16()
    with pytest.raises(TypeError, match="bf16 or fp16"):
        grouped_gemm_swiglu_gluon(torch.zeros(4, 16), torch.zeros(8, 16), ms)
    with pytest.raises(ValueError, match=r"\[G, 2F, K\]"):
        grouped_gemm_swiglu_gluon(x, torch.zeros(6, 16).bfloat16(), ms)
    with pytest.raises(TypeError, match="int32"):
        grouped_gemm_swiglu_gluon(x, torch.zeros(8, 16).bfloat16(), ms, gather=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="128-row"):
        grouped_gemm_swiglu_gluon(x, torch.zeros(8, 16).bfloat16(), ms, block=(64, 128, 64))
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_scale"):
        grouped_gemm_swiglu_gluon(x8, torch.zeros(8, 16).to(torch.float8_e4m3fn), ms)


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("gathered", [True, False])
def test_gpu_matches_the_triton_kernel(fp8, gathered):
    """Rows read by index (or in place) through the warp-specialized Gluon SwiGLU kernel against
    the library's Triton ``grouped_gemm_swiglu`` on the same operands: Qwen3-30B's gate/up at
    T=2048 (16384 rows over 128 experts) and a ragged case (F and K off the tile, empty groups,
    a group of 5 rows: one MMA half idle), rows past the groups untouched; also 128 x 128 x 32
    tiles with seven stages, and one N = 256 MMA a step split into gate and up (``pair``)."""
    _hopper()
    from moekit.ops._triton.gg_gluon_swiglu import grouped_gemm_swiglu_gluon
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu
    from moekit.reference.quantize import quantize_fp8_row
    from moekit.testing.data import random_m_sizes

    torch.manual_seed(0)
    for G, F, K, T, ms in [
        (128, 768, 2048, 2048, random_m_sizes(16384, 128, 8, seed=3)),
        (6, 200, 272, 300, torch.tensor([0, 300, 5, 0, 129, 64], dtype=torch.int32)),
    ]:
        M = int(ms.sum())
        ms = ms.cuda()
        x = torch.randn(T if gathered else M, K)
        w = torch.randn(G * 2 * F, K) / K**0.5
        xs = wsc = None
        if fp8:
            x, xs = quantize_fp8_row(x)
            w, wsc = quantize_fp8_row(w)
            xs, wsc = xs.cuda(), wsc.cuda()
        else:
            x, w = x.bfloat16(), w.bfloat16()
        x, w = x.cuda(), w.cuda()
        gather = torch.randint(0, T, (M,), dtype=torch.int32, device="cuda") if gathered else None
        rs = torch.rand(M + 7, device="cuda") + 0.5
        want = grouped_gemm_swiglu(x, w, ms, gather, rs, xs, wsc)
        for block, nbuf, pair in [(None, 3, False), ((128, 128, 64 if fp8 else 32), 7, False), (None, 3, True)]:
            z = torch.full((M + 7, F), 7.0, device="cuda", dtype=torch.bfloat16)
            grouped_gemm_swiglu_gluon(x, w, ms, gather, rs, out=z, x_scale=xs, w_scale=wsc, block=block, num_buf=nbuf,
                                      pair=pair)  # fmt: skip
            assert_close(z[:M].float(), want[:M].float(), tol=2e-2, msg=f"G={G} F={F} K={K} block={block} pair={pair}")
            assert (z[M:] == 7.0).all()


@pytest.mark.reference
def test_layer_takes_the_gluon_swiglu_only_where_asked_and_able():
    """``experts._gluon_swiglu``: None with knob ``GLUON_SWIGLU`` off (the default) and on CPU
    tensors with it on (the Triton or CPU path runs)."""
    from moekit import settings
    from moekit.layers import experts

    x = torch.zeros(8, 32).bfloat16()
    w = torch.zeros(2 * 2 * 16, 32).bfloat16()
    ms = torch.tensor([4, 4], dtype=torch.int32)
    ids = torch.arange(8, dtype=torch.int32)
    assert experts.GLUON_SWIGLU == 0
    assert experts._gluon_swiglu(x, w, ms, ids, None) is None
    for mode in (1, 2, 3):
        with settings.override(knobs={"GLUON_SWIGLU": mode}):
            assert experts._gluon_swiglu(x, w, ms, ids, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_layer_with_the_gluon_swiglu(fp8, monkeypatch):
    """``moe_forward`` with knob ``GLUON_SWIGLU`` 1 / 2 / 3 (the gate/up GEMM and SwiGLU through
    the Gluon kernel: two MMAs a step, one N = 256 MMA, that with four stages) against the same
    layer on the Triton kernel and the float32 reference; the Gluon kernel must have run."""
    _hopper()
    from moekit import settings
    from moekit.layers.functional import moe_forward
    import moekit.ops._triton.gg_gluon_swiglu as S
    from tests.ops.test_gg_gluon import layer_case, layer_reference

    calls = []
    real = S.grouped_gemm_swiglu_gluon

    def spy(*a, **kw):
        calls.append((kw.get("pair"), kw.get("num_buf")))
        return real(*a, **kw)

    monkeypatch.setattr(S, "grouped_gemm_swiglu_gluon", spy)
    x, logits, w13, w2, kw, cfg = layer_case(2048, fp8)
    with settings.override(decode_fused="off", knobs={"GLUON_SWIGLU": 0}):
        base = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    assert not calls
    want = layer_reference(x, logits, w13, w2, kw)
    for mode, form in ((1, (False, 3)), (2, (True, 3)), (3, (True, 4))):
        calls.clear()
        with settings.override(decode_fused="off", knobs={"GLUON_SWIGLU": mode}):
            got = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
        assert calls == [form], (mode, calls)
        assert_close(got.float(), base.float(), tol=1e-2, msg=f"fp8={fp8} mode={mode}")
        assert_close(got.cpu().float(), want.float(), tol=6e-2 if fp8 else 3e-2, msg=f"fp8={fp8} mode={mode}")
