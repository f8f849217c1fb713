"""Compile the Lamport tail kernel with the real Triton compiler + ptxas for sm_90 (H200) on a
machine without a GPU, and report its resources. Run as a script (not under TRITON_INTERPRET):

    python -m tests.comm._compile_sm90     # prints one line per config; exit 1 on a problem
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekit.comm import _triton_tail as T
from moekit.ops._common import cdiv

CONFIGS = [
    # R, L, H, kwargs
    (2, 3584, 7168, {}),
    (2, 3584, 7168, dict(top_k=16, fp32=True)),
    (8, 7168, 7168, dict(two=True, fp32=True)),
    (2, 7168, 0, dict(shared=False, res=True, two=True, gather_f32=True)),
    (4, 16384, 0, dict(shared=False, res=True)),
    (2, 0, 2880, dict(routed=False)),
]


def compile_config(
    R, L, H, top_k=0, routed=True, shared=True, fp32=False, two=False, res=False, gather_f32=None, max_m=512
):
    lay = T.TailLayout(
        0,
        R,
        L if routed else 0,
        H if shared else 0,
        max_m,
        top_k,
        routed,
        shared,
        fp32,
        1 if two else 1 << 30,
        gather_f32,
    )
    blk = T.choose_blocks(lay)
    S = lay.shard_dim
    ch = L // R if two else 0
    npr = (R * cdiv(ch, blk.block_p) if two else cdiv(L, blk.block_p)) if routed else 0
    nch = cdiv(ch, blk.block_p) if two else 0
    nj = cdiv(S, blk.block_s) if shared else 0
    const = dict(
        R=R,
        L=max(L, 1),
        H=max(H, 1),
        S=max(S, 1),
        FOOT=lay.foot,
        BUF=lay.buffer_elems,
        RT0=lay.rt0,
        USED=lay.used(two),
        CH=max(ch, 1),
        NPR=max(npr, 1),
        NCH=max(nch, 1),
        NJ=max(nj, 1),
        SH_OUT_STRIDE=max(H, 1),
        TOP_K=top_k if routed else 0,
        KG=blk.kg,
        ROUTED=routed,
        SHARED=shared,
        TWO_SHOT=two,
        FP32_INTERNAL=fp32,
        GATHER_F32=lay.gathers_f32,
        HAS_RES=res,
        HOST_ERR=True,
        USE_TIMER=True,
        EMULATE=False,
        BLOCK_L=blk.block_l,
        BLOCK_P=blk.block_p,
        BLOCK_S=blk.block_s,
        BLOCK_C=blk.block_c,
    )
    sig = dict(
        lat_ptr="*bf16",
        wts_ptr="*bf16",
        idx_ptr="*i32",
        res_ptr="*bf16",
        gamma_ptr="*bf16",
        lat_out_ptr="*bf16",
        sh_ptr="*bf16",
        sh_out_ptr="*bf16",
        ws16_ptr="*i16",
        ws32_ptr="*i32",
        peers_ptr="*i64",
        flags_ptr="*i32",
        err_ptr="*i32",
        m="i32",
        rank="i32",
        gemm_rows="i32",
        eps="fp32",
        timeout_ns="i64",
        max_spins="i32",
    )
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(13)}
    src = ASTSource(fn=T._tail_kernel, signature=sig, constexprs=const, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": blk.num_warps})
    ptx = ck.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "local_bytes": int(local.group(1)) if local else -1,
        "globaltimer": "%globaltimer" in ptx,
        "acq_rel_atomic": "atom.global.gpu.acq_rel" in ptx,
        "vector_volatile_loads": "ld.volatile.global.v4" in ptx or "ld.volatile.global.v2" in ptx,
        "scalar_16bit_global_stores": bool(re.search(r"st\.global\.b16", ptx)),
        "warps": blk.num_warps,
    }


def main() -> int:
    bad = 0
    for R, L, H, kw in CONFIGS:
        info = compile_config(R, L, H, **kw)
        fits = 0 < info["regs"] * info["warps"] * 32 <= 65536  # one program per SM at least
        ok = (
            info["local_bytes"] == 0
            and fits
            and info["globaltimer"]
            and info["acq_rel_atomic"]
            and info["vector_volatile_loads"]
            and not info["scalar_16bit_global_stores"]
        )
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} R={R} L={L} H={H} {kw}: {info}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
