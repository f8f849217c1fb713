#!/usr/bin/env python3
"""The decode step from router logits: ``moe_decode``'s two launches against the sorted decode
pipeline, and their configuration alternatives: a tuning aid for ``moekit.ops._triton.decode``.

    python benchmarks/sweep_decode.py [--models qwen3-30b-a3b,deepseek-v3-tp8] [--tokens 1,2]
        [--dtype bf16,fp8] [--alts] [--alts-gemv] [--tiles B8x256x3,A4x512x4x4]

Per (model, T, dtype), µs per call (CUDA graphs, medians, 8 routings rotated so the experts'
weights do not sit in L2), the floor (the hit experts' weight bytes at 4.25 TB/s; past one token
the expected number hit by uniform random routing, ``E * (1 - (1 - k/E)^T)``):
- ``sorted``: ``moe_forward`` with ``decode_fused`` off (routing launch, gate/up GEMV on the
  sorted rows, the per-token combine; or the scatter-add GEMV below top-k 6); below top-k 6 also
  ``sorted_combine``: the same with the per-token combine (knob ``COMBINE_MIN_TOP_K`` pinned to 1);
- ``fused``: ``moe_decode`` with its default configurations; ``swiglu``: its first launch alone
  (routing + gate/up GEMV), so ``fused - swiglu`` is about the combine;
- with ``--alts``: one column per alternative of the combine, ``B bn x bf x s`` (columns, F tile,
  stages), timed twice (the list, then the list reversed, ``B ... #2``): the spread between the two
  passes is the call's noise;
- with ``--alts-gemv``: one column per alternative of the routing GEMV, ``A bn x bk x s x w x
  lazy`` (columns per program, K tile, stages, warps; ``True``: routing rounds only up to each
  program's own slot, the default; ``False``: the default tile with every program's routing run
  whole), the combine at its default; also timed twice (``A ... #2``);
- ``--tiles``: only the alternatives named (``B`` combine tiles ``BxFxS[xW]``, W warps, default
  4; ``A`` GEMV tiles ``BxKxSxW``, lazy routing), also timed twice: a shorter call than the whole
  lists;
- ``worst_rel`` / ``worst``: the alternatives' largest deviation from the sorted pipeline's output
  (max abs over max abs, the first routing): an alternative that computes something else shows;
- ``--sets N``: rotate N routings instead of 8 (1: the same experts every call);
- for FP8, ``sorted_old_gemv``: the sorted pipeline with the gate/up GEMV's 16-bit tile rule (knob
  ``SWIGLU_GEMV_FP8_WAVE`` off).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

SETS = 8


def _case(model: str, T: int, fp8: bool, seed: int = 0, n_sets: int = SETS) -> dict:
    from moekit.layers.functional import quantize_expert_weights
    from moekit.testing import MODEL_SHAPES

    s = MODEL_SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(s.E, 2 * s.F, s.D, generator=g, device="cuda") / s.D**0.5).bfloat16()
    w2 = (torch.randn(s.E, s.D, s.F, generator=g, device="cuda") / s.F**0.5).bfloat16()
    s13 = s2 = None
    if fp8:
        w13, s13 = quantize_expert_weights(w13)
        w2, s2 = quantize_expert_weights(w2)
    bias = torch.randn(s.E, generator=g, device="cuda") / 10 if s.n_group else None
    sets = [
        dict(x=torch.randn(T, s.D, generator=g, device="cuda").bfloat16(),
             logits=torch.randn(T, s.E, generator=g, device="cuda"))
        for _ in range(n_sets)
    ]  # fmt: skip
    return dict(s=s, w13=w13, w2=w2, s13=s13, s2=s2, bias=bias, sets=sets, fp8=fp8)


def _sorted(c: dict, st: dict):
    from moekit import settings
    from moekit.layers.functional import moe_forward

    s = c["s"]
    with settings.override(decode_fused="off"):
        return moe_forward(st["x"], None, c["w13"], c["w2"], s.routing_config, logits_TE=st["logits"],
                           e_score_correction_bias=c["bias"], w13_scale_e2F=c["s13"], w2_scale_eD=c["s2"])  # fmt: skip


def _sorted_us(c: dict, **knobs) -> float:
    """µs per call of the sorted decode pipeline over the case's routings, ``knobs`` pinned."""
    from moekit import settings
    from moekit.benchmarking import bench_us

    with settings.override(knobs=knobs):
        return bench_us([lambda st=st: _sorted(c, st) for st in c["sets"]], replays=10)


def _args(c: dict, st: dict):
    s = c["s"]
    D, F = s.D, s.F
    return (st["x"], st["logits"], c["bias"], c["w13"].reshape(-1, D), c["w2"].reshape(-1, F),
            None if c["s13"] is None else c["s13"].reshape(-1), None if c["s2"] is None else c["s2"].reshape(-1))  # fmt: skip


def _routing(s):
    return (s.top_k, s.score_func, s.renormalize, s.n_group, s.topk_group, s.routed_scaling_factor,
            s.apply_router_weight_on_input)  # fmt: skip


def _fused(c: dict, st: dict, out: torch.Tensor, a=None, b=None):
    from moekit.ops._triton.decode import moe_decode

    x, lg, bias, w13, w2, s13, s2 = _args(c, st)
    k, score, renorm, ng, tg, scale, on_in = _routing(c["s"])
    moe_decode(x, lg, bias, w13, w2, s13, s2, out, k, score, renorm, ng, tg, scale, on_in, False, a, b)
    return out


def _swiglu(c: dict, st: dict, a=None):
    from moekit.ops._triton.decode import decode_swiglu

    x, lg, bias, w13, _, s13, _ = _args(c, st)
    k, score, renorm, ng, tg, scale, on_in = _routing(c["s"])
    return decode_swiglu(x, lg, bias, w13, s13, c["s"].F, k, score, renorm, ng, tg, scale, on_in, a)


def _hits(E: int, k: int, T: int) -> float:
    """Experts hit by T tokens of uniform random top-k routing, expected (k at T=1)."""
    return E * (1.0 - (1.0 - k / E) ** T)


def _gemv_alternatives(fp8: bool) -> list:
    """Lazy-routing tiles around the defaults: FP8 tiles of 4096 and 8192 weights (~128 and ~200
    registers), bf16 tiles of 8 and 16 KB."""
    tiles = (
        ((16, 256, 5), (8, 512, 5), (8, 1024, 3), (4, 1024, 4), (16, 512, 3))
        if fp8
        else ((16, 256, 3), (8, 512, 3), (8, 1024, 3), (4, 512, 4), (8, 256, 5))
    )
    return [("A", (bn, bk, st, 4, True)) for bn, bk, st in tiles]


def _parse_tiles(spec: str) -> list:
    """``"B8x256x3,A4x512x4x4"`` -> ``[("B", (8, 256, 3)), ("A", (4, 512, 4, 4, True))]``."""
    out = []
    for item in (t.strip() for t in spec.split(",") if t.strip()):
        kind, dims = item[0].upper(), tuple(int(v) for v in item[1:].split("x"))
        if (kind, len(dims)) not in (("B", 3), ("B", 4), ("A", 4)):
            raise SystemExit(
                f"--tiles: {item!r} is neither B<bn>x<bf>x<stages>[x<warps>] nor A<bn>x<bk>x<stages>x<warps>"
            )
        out.append((kind, dims + (True,) if kind == "A" else dims))
    return out


def _combine_alternatives() -> list:
    """Session 17's tiles, then wider F tiles (FP8 rows are half the bytes of bf16 ones)."""
    return [("B", (bn, bf, st)) for bn, bf, st in
            ((16, 64, 3), (16, 128, 3), (8, 128, 4), (8, 64, 5), (4, 128, 4), (4, 64, 5), (2, 128, 5), (4, 256, 3),
             (8, 256, 3), (8, 256, 4), (4, 512, 3), (2, 512, 4), (16, 256, 2))]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--alts", action="store_true", help="time the combine's alternatives (two passes)")
    ap.add_argument("--alts-gemv", action="store_true", help="time the routing GEMV's alternatives")
    ap.add_argument("--tiles", default="", help="only these alternatives, e.g. B8x256x3,A4x512x4x4")
    ap.add_argument("--sets", type=int, default=SETS, help="routings rotated per timing (default 8)")
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh; no effect")
    a = ap.parse_args()
    tiles = _parse_tiles(a.tiles)
    if not torch.cuda.is_available():
        print("sweep_decode needs CUDA; nothing to do on this machine")
        return 0
    from moekit.benchmarking import bench_us, floor_us, markdown_table, save_rows
    from moekit.layers.experts import COMBINE_MIN_TOP_K
    from moekit.ops._common import num_sms
    from moekit.ops._triton.decode import decode_swiglu_config
    from moekit.ops._triton.gg_combine import combine_config

    rows = []
    for dt in a.dtype.split(","):
        fp8 = dt == "fp8"
        for m in a.models.split(","):
            for T in (int(t) for t in a.tokens.split(",")):
                c = _case(m, T, fp8, n_sets=a.sets)
                s = c["s"]
                M, elem = T * s.top_k, 1 if fp8 else 2
                sms = num_sms(torch.device("cuda"))
                kp = 1 << (s.top_k - 1).bit_length()
                row = {"model": m, "T": T, "dtype": dt,
                       "A": "x".join(map(str, decode_swiglu_config(M, s.F, s.D, elem, sms))),
                       "B": "x".join(map(str, combine_config(T, s.D, s.F, kp, elem, sms))),
                       "floor_us": round(floor_us(_hits(s.E, s.top_k, T) * 3 * s.D * s.F * elem), 1)}  # fmt: skip
                out = torch.empty(T, s.D, dtype=torch.bfloat16, device="cuda")
                want = _sorted(c, c["sets"][0])
                got = _fused(c, c["sets"][0], out)
                row["same_bits"] = bool(torch.equal(got, want))
                row["sorted_us"] = _sorted_us(c)
                row["fused_us"] = bench_us([lambda st=st: _fused(c, st, out) for st in c["sets"]], replays=10)
                row["swiglu_us"] = bench_us([lambda st=st: _swiglu(c, st) for st in c["sets"]], replays=10)
                if fp8:  # the sorted pipeline with the 16-bit rule's FP8 gate/up GEMV tiles
                    row["sorted_old_gemv"] = _sorted_us(c, SWIGLU_GEMV_FP8_WAVE=False)
                if s.top_k < COMBINE_MIN_TOP_K:
                    row["sorted_combine"] = _sorted_us(c, COMBINE_MIN_TOP_K=1)
                alts = []
                if a.alts:
                    alts += _combine_alternatives()
                if a.alts_gemv:
                    alts += [("A", decode_swiglu_config(M, s.F, s.D, elem, sms) + (False,))] + _gemv_alternatives(fp8)
                alts += tiles
                alts += [(f"{w}#2", cfg) for w, cfg in reversed(alts)]  # the second pass, reversed
                if alts:
                    for which, cfg in alts:
                        name = f"{which[0]} " + "x".join(map(str, cfg)) + which[1:]
                        A, B = (cfg, None) if which[0] == "A" else (None, cfg)  # "A#2": the second pass
                        try:
                            row[name] = bench_us([lambda st=st: _fused(c, st, out, A, B) for st in c["sets"]],
                                                 replays=10)  # fmt: skip
                            got = _fused(c, c["sets"][0], out, A, B).float()
                            rel = float((got - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
                            if rel > row.get("worst_rel", -1.0):
                                row["worst_rel"], row["worst"] = round(rel, 5), name
                        except Exception as exc:  # a configuration that does not fit: keep the others
                            row[name] = type(exc).__name__
                print(row, flush=True)
                rows.append(row)
                c.clear()
                torch.cuda.empty_cache()
    print(markdown_table(rows))
    save_rows("sweep_decode", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
