"""The experimental Gluon grouped GEMM (``moekit.ops._triton.gg_gluon``): its argument errors and
its sm_90 compile on the CPU, its rows against a float32 reference on the GPU (Gluon has no
interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
for (G, N, K, block, nbuf, co, dp, ws) in json.loads(os.environ["CASES"]):
    bm, bn, bk = block
    x = torch.empty((4096, K), dtype=torch.bfloat16, device="meta")
    w = torch.empty((G * N, K), dtype=torch.bfloat16, device="meta")
    lay = lambda b: gl.NVMMASharedLayout.get_default_for(b, gl.bfloat16)
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk], lay([bm, bk]))
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk], lay([bn, bk]))
    sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "y_ptr": "*bf16", "rs_ptr": "*fp32",
           "m_sizes_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_ym": "i32"}
    consts = {"HAS_RS": True, "G_BLOCK": max(32, triton.next_power_of_2(G)), "NUM_BUF": nbuf}
    if not ws:
        consts.update(COALESCE=co, DEPTH=dp)
    consts["num_warps"] = 8
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 7, 9)}
    kernel = GG._gg_gluon_ws_kernel if ws else GG._gg_gluon_kernel
    c = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    st = re.search(r"STACK:(\d+)", res)
    out.append({"shared": int(c.metadata.shared), "stack": int(st.group(1)) if st else None,
                "wgmma": c.asm["ptx"].count("wgmma.mma_async"), "tma": c.asm["ptx"].count("cp.async.bulk.tensor"),
                "setmaxnreg": c.asm["ptx"].count("setmaxnreg")})
print("@@" + json.dumps(out))
"""

# (G, N, K, block, buffers, coalesced epilogue, MMA groups in flight, warp-specialized): the
# benchmark's tiles
CASES = [
    (128, 2048, 768, (128, 256, 64), 4, False, 0, False),
    (128, 2048, 768, (128, 256, 64), 4, False, 1, False),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, False),
    (256, 7168, 256, (128, 128, 64), 4, False, 1, False),
    (128, 2880, 2880, (128, 128, 64), 5, True, 1, False),
    (128, 2048, 768, (128, 256, 64), 3, True, 1, True),
    (256, 7168, 256, (128, 256, 64), 2, True, 1, True),
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
    kernel's partitions with their own register budgets."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's NVIDIA backend (ptxas) is not available")
    env = dict(os.environ, TRITON_INTERPRET="0", CASES=json.dumps(CASES))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE)], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    recs = json.loads(lines[-1][2:])
    assert len(recs) == len(CASES)
    for case, r in zip(CASES, recs):
        # (the warp-specialized kernel's store warps, at 48 registers, keep one loop value on the
        # stack where the table is 256 groups wide: one 4-byte load a tile)
        assert r["stack"] in (0, None) or (case[-1] and r["stack"] <= 16), (case, r)
        assert (r["setmaxnreg"] > 0) == case[-1], (case, r)  # the partitions' register budgets
        assert r["shared"] <= 227 * 1024, (case, r)
        assert r["wgmma"] > 0 and r["tma"] > 0, (case, r)


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
            ((128, 256, 64), 3, True, 1, True), ((128, 256, 64), 2, True, 1, True)]
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
    block, nbuf, co, dp, ws = cfg
    grouped_gemm_gluon(x, w, ms, rs, out=y, block=block, num_buf=nbuf, coalesce=co, depth=dp, ws=ws)
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
    for block, nbuf, co, dp, ws in [
        ((128, 256, 64), 4, False, 0, False),
        ((128, 256, 64), 3, True, 1, False),
        ((128, 256, 64), 3, True, 1, True),
    ]:
        got = grouped_gemm_gluon(x, w, ms, rs, block=block, num_buf=nbuf, coalesce=co, depth=dp, ws=ws)
        assert_close(got.float(), want.float(), tol=1e-2, msg=str(block))
