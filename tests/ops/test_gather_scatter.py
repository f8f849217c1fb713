"""gather_scale_dense_tokens (+ quant), scatter_add_dense_tokens (atomic / deterministic),
scatter_add_padded_tokens: Triton kernels (interpreter and GPU) against moekit.reference."""

from __future__ import annotations

import re
from typing import Optional

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops import gather_scatter as ops
from moekit.reference.gather_scatter import row_mask
from moekit.testing import assert_close, assert_fp8_close, assert_poisoned, poison, tie_free_scores

FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _tri():
    from moekit.ops._triton import gather_scatter

    return gather_scatter


def routing(T, E, K, *, start=None, end=None, seed=0, column_major=False, dtype=torch.float32, device="cpu"):
    """(scores [T, E], counts [E + 2], expert_indices, token_indices) from the reference
    index_shuffling on tie-free scores: rows past the valid count hold -1."""
    s = tie_free_scores(T, E, dtype=dtype, seed=seed, column_major=column_major)
    counts, eidx, tidx = ref.index_shuffling(s, start, end, top_k=K)
    return s.to(device), counts.to(device), eidx.to(device), tidx.to(device)


def randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def vtc(n: Optional[int], device="cpu"):
    return None if n is None else torch.tensor([n], dtype=torch.int32, device=device)


def gather_written(tidx, eidx, valid, device="cpu"):
    return (row_mask(tidx.shape[0], valid, tidx.device) & (tidx >= 0) & (eidx >= 0)).to(device)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3fn values around |v| (2**-9 in the subnormal range)."""
    a = v.abs().float().clamp(min=2.0**-6)
    return torch.pow(2.0, torch.floor(torch.log2(a)) - 3)


def check_fp8(q, scale, rq, rscale, written):
    q, rq = q.float().cpu()[written.cpu()], rq.float().cpu()[written.cpu()]
    step = torch.maximum(e4m3_step(q), e4m3_step(rq))
    bad = (q - rq).abs() > step
    assert not bad.any(), f"{int(bad.sum())} fp8 values off by more than one e4m3 step"
    assert_fp8_close(q, rq)  # and only a few values one step off (round to nearest even)
    s, rs = scale.cpu()[written.cpu()], rscale.cpu()[written.cpu()]
    assert torch.all((s - rs).abs() <= 1e-6 * rs.abs()), "dequant scales differ by more than 1e-6 relative"


# Shapes for the interpreter (tiny; every T, E, K, D of the issue appears at least once).
INTERP_CASES = [
    # T, E, K, D
    (0, 6, 2, 8),
    (1, 1, 1, 8),
    (1, 16, 8, 24),
    (7, 6, 4, 24),
    (7, 257, 2, 8),
    (7, 16, 2, 2880),
    (128, 16, 1, 24),
    (128, 128, 8, 8),
]


def _valid_rows(T, K, mode):
    return None if mode is None else max(T * K - 3, 0) if mode == "short" else 0


# ----------------------------------------------------------------------------------------------
# interpreter tier: the private launchers on CPU tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,K,D", INTERP_CASES)
def test_gather_scale_interpreter(T, E, K, D):
    tri = _tri()
    # Expert range [1, E) leaves a -1 tail; column-major scores exercise the strided path.
    s, _, eidx, tidx = routing(T, E, K, start=min(1, E - 1), end=E, column_major=True, seed=T + E)
    for i, (dtype, mode) in enumerate([(torch.float16, None), (torch.bfloat16, "short"), (torch.float32, "zero")]):
        x = randn(T, D, dtype=dtype, seed=i)
        v = vtc(_valid_rows(T, K, mode))
        out = poison(torch.empty(T * K, D, dtype=dtype))
        tri.gather_scale_dense_tokens(x, tidx, eidx, s, v, out=out)
        want = ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        w = gather_written(tidx, eidx, v)
        if T:
            assert_poisoned(out, w)
        if dtype == torch.bfloat16:
            # The interpreter's float32 -> bf16 conversion does not round to nearest even.
            assert_close(out[w], want[w])
        else:
            assert torch.equal(out[w], want[w]), "gathered rows differ from the float32 reference"


@pytest.mark.interpreter
@pytest.mark.parametrize("whole_row", [0, 1], ids=["column_blocks", "whole_rows"])
def test_gather_scale_interpreter_both_tilings(pin_knobs, whole_row):
    """Column-block tiles and whole rows (the streamed kernel, head + masked tail: D = 2880 is
    2048 + 832 of a 1024 tail) give the same rows, and the same as the reference."""
    tri = _tri()
    pin_knobs(GATHER_WHOLE_ROW_MIN_ROWS_PER_SM=whole_row)
    T, E, K, D = 9, 16, 2, 2880
    assert tri._gather_tiles(T * K, D, torch.device("cpu"))[3] == (1 if whole_row else 3)
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, seed=5)
    x = randn(T, D, dtype=torch.float32, seed=5)
    v = vtc(T * K - 5)
    out = poison(torch.empty(T * K, D))
    tri.gather_scale_dense_tokens(x, tidx, eidx, s, v, out=out)
    w = gather_written(tidx, eidx, v)
    assert_poisoned(out, w)
    assert torch.equal(out[w], ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)[w])


@pytest.mark.interpreter
@pytest.mark.parametrize("D,valid", [(2880, 13), (8, 18), (5120, 0)])
def test_gather_scale_interpreter_stream(pin_knobs, D, valid):
    """The persistent pipelined whole-row gather (each program loops over several units: 18 rows
    on 4 programs), with a tail chunk (2880 = 2048 + a masked 1024), without one (8), and with
    nothing valid: the reference's rows, untouched rows still poisoned."""
    tri = _tri()
    pin_knobs(GATHER_WHOLE_ROW_MIN_ROWS_PER_SM=1, GATHER_STREAM_PROGRAMS_PER_SM=1)
    T, E, K = 9, 16, 2
    assert tri._gather_tiles(T * K, D, torch.device("cpu"))[3] == 1
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, seed=6)
    x = randn(T, D, dtype=torch.float32, seed=6)
    v = vtc(valid)
    out = poison(torch.empty(T * K, D))
    tri.gather_scale_dense_tokens(x, tidx, eidx, s, v, out=out)
    w = gather_written(tidx, eidx, v)
    assert_poisoned(out, w)
    assert torch.equal(out[w], ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)[w])


def _check_quant_launcher(x, tidx, eidx, s, partial: bool = False):
    """The FP8 gather's launcher into poisoned outputs, without and with ``scale_ub`` and a short
    valid count, against the reference; ``partial``: some but not all rows must be written."""
    tri = _tri()
    T, D = x.shape
    A = tidx.shape[0]
    for ub, mode in [(None, None), (torch.tensor([0.05]), "short")]:
        v = vtc(_valid_rows(T, A // max(T, 1), mode))
        q = poison(torch.empty(A, D, dtype=FP8))
        sc = poison(torch.empty(A))
        tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub, v, out=q, out_scale=sc)
        rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub, v)
        w = gather_written(tidx, eidx, v)
        if partial:
            assert 0 < int(w.sum()) < A
        assert_poisoned(q, w)
        assert_poisoned(sc, w)
        check_fp8(q, sc, rq, rs, w)


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,K,D", INTERP_CASES[1:6])
def test_gather_scale_quant_interpreter(T, E, K, D):
    s, _, eidx, tidx = routing(T, E, K, start=min(1, E - 1), end=E, seed=3 * T + E)
    _check_quant_launcher(randn(T, D, dtype=torch.bfloat16, seed=T), tidx, eidx, s)


@pytest.mark.interpreter
@pytest.mark.parametrize("D", [1024, 2048, 3072])
def test_gather_scale_quant_interpreter_unmasked(D):
    """One row per program in whole chunks (the unmasked path with its early return for dropped
    rows): an expert range's -1 tail and a short valid count leave their rows untouched."""
    T, E, K = 5, 6, 2
    block_r, block_d, n_chunks, one_pass, _ = _tri()._quant_tiles(T * K, D, torch.device("cpu"))
    assert one_pass and block_r == 1 and n_chunks * block_d == D
    s, _, eidx, tidx = routing(T, E, K, start=2, end=E, seed=D)
    _check_quant_launcher(randn(T, D, dtype=torch.bfloat16, seed=D), tidx, eidx, s, partial=True)


def _quant_into_poison_matches_reference(xb, tok, exp, s, w):
    """The FP8 gather's launcher into poisoned outputs: rows ``w`` written and the reference's (within
    one e4m3 step), the rest untouched. Returns the reference's ``(q, scale)``."""
    A, D = tok.shape[0], xb.shape[1]
    q, sc = poison(torch.empty(A, D, dtype=FP8)), poison(torch.empty(A))
    _tri().gather_scale_quant_dense_tokens(xb, tok, exp, s, out=q, out_scale=sc)
    rq, rs = ref.gather_scale_quant_dense_tokens(xb, tok, exp, s)
    assert_poisoned(q, w)
    assert_poisoned(sc, w)
    check_fp8(q, sc, rq, rs, w)
    return rq, rs


def _out_of_range_indices(T: int, E: int, idt: torch.dtype):
    """(token_indices, expert_indices, rows the kernels write): in-range rows mixed with a token
    past T (7 of 4, T itself, 2**32 + 1 or int32's max), negative ones and experts past E."""
    big = 2**32 + 1 if idt == torch.int64 else 2**31 - 1
    tok = torch.tensor([0, 7, T, big, -1, 1, 3, 2, 2, -(2**31), 1], dtype=idt)
    exp = torch.tensor([0, 0, 1, 0, 0, E, 2, -1, 1, 0, E - 1], dtype=idt)
    written = torch.tensor([True, False, False, False, False, False, True, False, True, False, True])
    return tok, exp, written


@pytest.mark.interpreter
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
@pytest.mark.parametrize("whole_row", [0, 1], ids=["column_blocks", "whole_rows"])
def test_gather_interpreter_out_of_range_indices_match_reference(pin_knobs, idt, whole_row):
    """Negative and out-of-range token / expert indices: the kernels skip those rows (they stay
    poisoned), and the reference (the CPU path of the public ops) leaves them zero instead of
    clamping the index to the last token / expert; written rows are bitwise the reference's
    (issue 16)."""
    tri = _tri()
    pin_knobs(GATHER_WHOLE_ROW_MIN_ROWS_PER_SM=whole_row, GATHER_STREAM_PROGRAMS_PER_SM=1)
    T, E, D = 4, 3, 16
    tok, exp, w = _out_of_range_indices(T, E, idt)
    A = tok.shape[0]
    assert bool(tri._gather_tiles(A, D, torch.device("cpu"))[5]) == bool(whole_row)  # streamed kernel or not
    x = randn(T, D, seed=21)
    s = randn(T, E, seed=22).abs() + 0.25
    out = poison(torch.empty(A, D))
    tri.gather_scale_dense_tokens(x, tok, exp, s, out=out)
    want = ref.gather_scale_dense_tokens(x, tok, exp, s)
    assert_poisoned(out, w)
    assert torch.equal(out[w], want[w])
    assert (want[~w] == 0).all(), "the reference wrote rows the kernel skips"
    assert torch.equal(ops.gather_scale_dense_tokens(x, tok, exp, s), want)

    xb = x.to(torch.bfloat16)
    rq, rs = _quant_into_poison_matches_reference(xb, tok, exp, s, w)
    assert (rq[~w].float() == 0).all() and (rs[~w] == 0).all()
    oq, osc = ops.gather_scale_quant_dense_tokens(xb, tok, exp, s)
    assert torch.equal(oq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(osc, rs)


@pytest.mark.interpreter
@pytest.mark.parametrize("whole_row", [0, 1], ids=["column_blocks", "whole_rows"])
def test_gather_interpreter_without_scores_copies_the_rows(pin_knobs, whole_row):
    """``scores=None`` (what the experts pipeline passes: no ones tensor to fill): the rows are
    copied, bitwise those of unit scores, skipped rows untouched; any expert index >= 0 is in range
    (nothing is indexed with it), negative ones and invalid tokens still skip. The FP8 gather
    quantizes the unscaled rows."""
    tri = _tri()
    pin_knobs(GATHER_WHOLE_ROW_MIN_ROWS_PER_SM=whole_row, GATHER_STREAM_PROGRAMS_PER_SM=1)
    T, E, D = 4, 3, 24
    tok, exp, _ = _out_of_range_indices(T, E, torch.int32)
    w = (tok >= 0) & (tok < T) & (exp >= 0)  # experts past E included
    A = tok.shape[0]
    x = randn(T, D, seed=23)
    ones = torch.ones(1, 1).expand(T, 2**20)  # unit scores wide enough for every expert index
    out = poison(torch.empty(A, D))
    tri.gather_scale_dense_tokens(x, tok, exp, None, out=out)
    assert_poisoned(out, w)
    assert torch.equal(out[w], ref.gather_scale_dense_tokens(x, tok, exp, ones)[w])
    assert torch.equal(out[w], x[tok[w].long()])
    assert torch.equal(
        ops.gather_scale_dense_tokens(x, tok, exp, None), ref.gather_scale_dense_tokens(x, tok, exp, None)
    )
    xb = x.to(torch.bfloat16)
    rq, rs = _quant_into_poison_matches_reference(xb, tok, exp, None, w)
    uq, us = ref.gather_scale_quant_dense_tokens(xb, tok, exp, ones)
    assert torch.equal(rq.view(torch.uint8), uq.view(torch.uint8)) and torch.equal(rs, us)


@pytest.mark.interpreter
def test_gather_interpreter_rows_of_non_power_of_two_width():
    """D = 1536 (1024 + 512): several rows per program must still be a power of two (it was 5 for
    the FP8 gather and the whole-row gather, which then failed to compile); D = 0 quantizes to
    empty rows with the eps scale, as the reference."""
    tri = _tri()
    cpu = torch.device("cpu")
    T, E, K, D = 64, 6, 1, 1536
    assert tri._quant_tiles(T * K, D, cpu)[0] == 4 and tri._gather_tiles(T * K, D, cpu)[0] == 4
    for D in range(8, 8200, 8):
        for rows in (64, 4096):
            for br in (tri._quant_tiles(rows, D, cpu)[0], tri._gather_tiles(rows, D, cpu)[0]):
                assert br & (br - 1) == 0, (D, rows, br)
    D = 1536
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, seed=11)
    x = randn(T, D, dtype=torch.bfloat16, seed=11)
    q, sc = tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    w = gather_written(tidx, eidx, None)
    check_fp8(q, sc, rq, rs, w)
    g = tri.gather_scale_dense_tokens(x, tidx, eidx, s)
    assert_close(g[w], ref.gather_scale_dense_tokens(x, tidx, eidx, s)[w])
    x0 = x[:, :0]
    q, sc = tri.gather_scale_quant_dense_tokens(x0, tidx, eidx, s)
    rq, rs = ref.gather_scale_quant_dense_tokens(x0, tidx, eidx, s)
    assert q.shape == (T * K, 0) and torch.equal(sc[w], rs[w])


def test_quant_chunk_widths():
    """Chunks are powers of two with the fewest masked lanes, at most 16 per row."""
    from moekit.ops._triton.gather_scatter import _quant_chunk

    assert _quant_chunk(5120) == 1024 and _quant_chunk(7168) == 1024 and _quant_chunk(8) == 8
    for D in range(8, 8193, 8):
        c = _quant_chunk(D)
        assert c & (c - 1) == 0 and -(-D // c) <= 16
        waste = -(-D // c) * c - D
        for c2 in (8, 16, 32, 64, 128, 256, 512, 1024):
            if -(-D // c2) <= 16:
                assert waste <= -(-D // c2) * c2 - D, (D, c, c2)


@pytest.mark.interpreter
def test_gather_scale_quant_interpreter_two_pass(pin_knobs):
    """Rows wider than the one-pass limit take the two-pass (amax, then quantize) path."""
    tri = _tri()
    pin_knobs(ONE_PASS_MAX_D=64)
    T, E, K, D = 5, 6, 2, 200
    assert not tri._quant_tiles(T * K, D, torch.device("cpu"))[3]  # two passes
    s, _, eidx, tidx = routing(T, E, K, seed=5)
    x = randn(T, D, dtype=torch.float16, seed=5)
    q, sc = tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s, torch.tensor([0.5]))
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, torch.tensor([0.5]))
    check_fp8(q, sc, rq, rs, gather_written(tidx, eidx, None))


@pytest.mark.interpreter
@pytest.mark.parametrize("one_pass", [True, False])
def test_gather_scale_quant_interpreter_nan_row(pin_knobs, one_pass):
    """A row holding a NaN quantizes to a NaN scale and NaN values on both paths, as the
    reference (torch.amax propagates it); the two-pass path's running max once dropped it."""
    tri = _tri()
    if not one_pass:
        pin_knobs(ONE_PASS_MAX_D=64)
    T, E, K, D = 6, 4, 1, 200
    assert tri._quant_tiles(T * K, D, torch.device("cpu"))[3] == one_pass
    s, _, eidx, tidx = routing(T, E, K, seed=12)
    x = randn(T, D, dtype=torch.bfloat16, seed=12)
    x[3, 150] = float("nan")  # in the second column block of the two-pass path
    q, sc = tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    w = gather_written(tidx, eidx, None)
    nan_rows = (tidx == 3) & w
    assert bool(nan_rows.any())
    assert torch.isnan(rs[nan_rows]).all() and torch.isnan(sc[nan_rows]).all()
    assert torch.isnan(q[nan_rows].float()).all()
    check_fp8(q, sc, rq, rs, w & ~nan_rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,K,D", INTERP_CASES)
def test_scatter_add_interpreter(T, E, K, D):
    """Atomic (fp32/fp16: the interpreter has no bf16 atomics) and deterministic (bf16 too)."""
    tri = _tri()
    _, _, _, tidx = routing(T, E, K, start=min(1, E - 1), end=E, seed=T * 7 + E)
    for i, (dtype, mode) in enumerate([(torch.float32, None), (torch.float16, "short"), (torch.bfloat16, "zero")]):
        out0 = randn(T, D, dtype=dtype, seed=i)
        rows = randn(T * K, D, dtype=dtype, seed=10 + i)
        v = vtc(_valid_rows(T, K, mode))
        want = out0.clone()
        ref.scatter_add_dense_tokens(want, rows, tidx, v)
        if dtype != torch.bfloat16:
            got = out0.clone()
            tri.scatter_add_dense_tokens(got, rows, tidx, v)
            assert_close(got, want, msg="atomic scatter-add")
        det = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(det, rows, tidx, v)
        assert_close(det, want, msg="deterministic scatter-add")
        det2 = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(det2, rows, tidx, v)
        assert torch.equal(det, det2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (tells -0.0 from +0.0, compares NaNs)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def det_indices(T, A, seed, hot=None, every=5, dtype=torch.int64):
    """Random token indices in [-1, T + 2): repeats, -1 and out-of-range (skipped) rows; token
    ``hot`` also takes every ``every``-th row (more rows than a bucket holds)."""
    g = torch.Generator().manual_seed(seed)
    tidx = torch.randint(-1, T + 2, (A,), generator=g, dtype=torch.int64)
    if hot is not None:
        tidx[::every] = hot
    return tidx.to(dtype)


def hit_tokens(tidx, T, v, device="cpu"):
    """[T] bool: tokens that receive at least one added row."""
    use = row_mask(tidx.shape[0], v, tidx.device) & (tidx >= 0) & (tidx < T)
    hit = torch.zeros(T, dtype=torch.bool, device=tidx.device)
    hit[tidx[use].long()] = True
    return hit.to(device)


def det_paths(tri, monkeypatch, out0, rows, tidx, v):
    """(scan result, bucket result, bucket result with the buckets shuffled): the scan path (one
    launch), the bucket path (forced), and the bucket path again with each token's slots in
    a random order and stale garbage past its count (as GPU atomics may leave them): the
    sum kernel must sort the slots and ignore what lies past the count."""
    scan = out0.clone()
    with settings.override(knobs={"SCAN_MAX_ROWS": 1 << 20}):
        tri.scatter_add_dense_tokens_deterministic(scan, rows, tidx, v)
    with monkeypatch.context() as mp, settings.override(knobs={"SCAN_MAX_ROWS": 0}):
        bucket = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(bucket, rows, tidx, v)
        build = tri._build_buckets

        def shuffled(*args):
            counts, buckets = build(*args)
            g = torch.Generator().manual_seed(1)
            cap = buckets.shape[1]
            for t in range(buckets.shape[0]):
                n = min(int(counts[t]), cap)
                buckets[t, :n] = buckets[t, :n][torch.randperm(n, generator=g)]
                buckets[t, n:] = torch.randint(0, rows.shape[0], (cap - n,), generator=g, dtype=torch.int32)
            return counts, buckets

        mp.setattr(tri, "_build_buckets", shuffled)
        shuf = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(shuf, rows, tidx, v)
    return scan, bucket, shuf


@pytest.mark.interpreter
@pytest.mark.parametrize("T,K,D,mode", [(9, 3, 16, None), (33, 4, 8, "short"), (17, 1, 8, None)])
def test_scatter_add_deterministic_interpreter_paths_agree(monkeypatch, T, K, D, mode):
    """Few rows take the one-launch scan; the bucket path (forced here) adds the same rows in the
    same order: identical bits. Indices repeat (up to K times per token, plus a token hit by
    many rows: more than its bucket holds), some are -1 or out of range."""
    tri = _tri()
    tidx = det_indices(T, T * K, seed=T, hot=2)
    rows = randn(T * K, D, dtype=torch.bfloat16, seed=T)
    out0 = randn(T, D, dtype=torch.bfloat16, seed=T + 1)
    v = vtc(_valid_rows(T, K, mode))
    want = out0.clone()
    ref.scatter_add_dense_tokens(want, rows, tidx, v)
    scan, bucket, shuf = det_paths(tri, monkeypatch, out0, rows, tidx, v)
    assert torch.equal(_bits(scan), _bits(bucket)), "scan and bucket paths differ"
    assert torch.equal(_bits(bucket), _bits(shuf)), "the bucket sum depends on the order of the slots"
    assert_close(scan, want)


# T, A, D, valid-count mode, hot token (None: none), dtype of the indices. CPU "machine" of 4
# SMs: D = 8 gives tiles of several tokens (overflow tokens next to bucketed ones) and an
# overflow scan of several chunks.
DET_CASES = [
    (1, 1, 8, None, None, torch.int32),
    (1, 40, 16, None, 0, torch.int64),  # every row on the only token
    (8, 40, 24, None, 3, torch.int32),  # one token over capacity, others below
    (8, 24, 8, "zero", None, torch.int64),
    (17, 17, 8, "short", None, torch.int32),
    (64, 200, 8, "short", 5, torch.int64),
    (6, 48, 1040, None, 4, torch.int32),  # two column blocks, the second mostly masked
]


@pytest.mark.interpreter
@pytest.mark.parametrize("T,A,D,mode,hot,idt", DET_CASES)
def test_scatter_add_deterministic_interpreter_bitwise(monkeypatch, T, A, D, mode, hot, idt):
    """Both deterministic paths (and the bucket path with shuffled buckets) against the float32
    reference: the same bits in fp32 and fp16 (the interpreter rounds float32 -> bf16 its own
    way: bf16 is compared between paths only). Tokens that receive no row stay poisoned; a
    second run gives the same bits."""
    tri = _tri()
    tidx = det_indices(T, A, seed=A + T, hot=hot, dtype=idt)
    v = vtc(None if mode is None else (A - 7 if mode == "short" else 0))
    hit = hit_tokens(tidx, T, v)
    for i, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16)):
        rows = randn(A, D, dtype=dtype, seed=i)
        out0 = randn(T, D, dtype=dtype, seed=10 + i)
        out0[~hit] = float("nan")
        want = out0.clone()
        ref.scatter_add_dense_tokens_deterministic(want, rows, tidx, v)
        scan, bucket, shuf = det_paths(tri, monkeypatch, out0, rows, tidx, v)
        for name, got in (("scan", scan), ("bucket", bucket), ("shuffled buckets", shuf)):
            assert_poisoned(got, hit, msg=name)
            assert torch.equal(_bits(got), _bits(scan)), f"{name} path differs from the scan path ({dtype})"
            if dtype != torch.bfloat16:
                assert torch.equal(_bits(got[hit]), _bits(want[hit])), f"{name} path is not the reference's bits"
            else:
                assert_close(got[hit], want[hit], msg=name)
    with settings.override(knobs={"SCAN_MAX_ROWS": 0}):
        again = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(again, rows, tidx, v)
    assert torch.equal(_bits(again), _bits(bucket)), "bucket path not reproducible"


@pytest.mark.interpreter
def test_scatter_add_deterministic_interpreter_buckets():
    """The bucket kernel: exact per-token counts (live rows with an index in [0, T)), each
    token's first ``cap`` slots hold distinct rows of that token (all of them when it has at
    most ``cap``)."""
    tri = _tri()
    T, A = 10, 60
    tidx = det_indices(T, A, seed=3, hot=7, every=3, dtype=torch.int32)
    v = vtc(A - 5)
    counts, buckets = tri._build_buckets(tidx, v, True, A, T)
    cap = buckets.shape[1]
    assert cap == tri._bucket_cap(A, T) and buckets.dtype == counts.dtype == torch.int32
    use = torch.arange(A) < A - 5
    for t in range(T):
        mine = torch.nonzero(use & (tidx == t)).flatten()
        assert int(counts[t]) == mine.numel()
        n = min(mine.numel(), cap)
        got = buckets[t, :n].long().sort().values
        if mine.numel() <= cap:
            assert torch.equal(got, mine)
        else:
            assert got.unique().numel() == n and bool(torch.isin(got, mine).all())
    assert int(counts[7]) > cap, "the hot token must overflow its bucket"


@pytest.mark.interpreter
def test_gather_scale_quant_interpreter_negative_scores():
    """The row amax is taken as max|x| * |score|: exact for negative scores too."""
    tri = _tri()
    T, E, K, D = 6, 4, 2, 40  # D = 32 + an 8-wide tail
    s, _, eidx, tidx = routing(T, E, K, seed=8)
    s = -s
    x = randn(T, D, dtype=torch.bfloat16, seed=8)
    q, sc = tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    w = gather_written(tidx, eidx, None)
    check_fp8(q, sc, rq, rs, w)
    assert torch.equal(sc[w], rs[w]), "dequant scales are not bitwise those of the reference"


@pytest.mark.interpreter
def test_scatter_add_interpreter_untouched_rows():
    """Tokens that receive no row keep their exact bits; int64 indices; a row-strided out."""
    tri = _tri()
    T, D = 9, 16
    tidx = torch.tensor([3, 1, -1, 3, 7, 3, -1, 1], dtype=torch.int64)
    big = randn(T, 2 * D, seed=1)
    out = big[:, :D]  # row stride 2D
    rows = randn(8, D, seed=2)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[[1, 3, 7]] = False
    before = out.clone()
    want = out.clone()
    ref.scatter_add_dense_tokens(want, rows, tidx)
    for fn in (tri.scatter_add_dense_tokens, tri.scatter_add_dense_tokens_deterministic):
        o = out.clone()
        fn(o, rows, tidx)
        assert torch.equal(o[untouched], before[untouched])
        assert_close(o, want)
    fn = tri.scatter_add_dense_tokens_deterministic
    fn(out, rows, tidx)  # in place through the strided view
    assert_close(out, want)
    assert torch.equal(big[:, D:], randn(T, 2 * D, seed=1)[:, D:])


@pytest.mark.interpreter
@pytest.mark.parametrize("EP,E,T,K,D", [(1, 6, 7, 2, 8), (2, 16, 7, 4, 24), (4, 16, 1, 1, 8), (8, 16, 9, 8, 40)])
def test_scatter_add_padded_interpreter(EP, E, T, K, D):
    tri = _tri()
    _, counts, _, tidx = routing(T, E, K, seed=EP + T)
    inp = randn(EP, T * K, D, seed=1)
    out0 = randn(T, D, seed=2)
    got, want = out0.clone(), out0.clone()
    tri.scatter_add_padded_tokens(inp, counts[:E], tidx, got)
    ref.scatter_add_padded_tokens(inp, counts[:E], tidx, want)
    assert_close(got, want)


# ----------------------------------------------------------------------------------------------
# reference tier: the public ops on CPU tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The CUDA launchers changed for the H200 (FP8 gather: one pass with a 1024 tail, masked tail,
    two passes; deterministic scatter: scan path, bucket path with 2 and 4 rows per step and
    several bucket capacities), compiled on the CPU for sm_90."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import gather_scatter as G
        bf, m, i32 = torch.bfloat16, "meta", torch.int32
        def e(*shape, dtype=bf):
            return torch.empty(*shape, dtype=dtype, device=m)
        for A, D in ((4096, 5120), (4096, 2880), (4096, 8), (64, 5120), (4096, 16384), (4096, 1536)):  # whole rows, tiles
            G.gather_scale_dense_tokens(e(A, D), e(A, dtype=i32), e(A, dtype=i32), e(A, 128), e(1, dtype=i32))
        # Default scatter-add: the bucket sum (top-4), locked (top-1, 5120 and 2880), atomics (top-1
        # rows past the one-pass budget), atomics reading ahead (few rows).
        G.scatter_add_dense_tokens(e(2048, 5120), e(8192, 5120), e(8192, dtype=i32), e(1, dtype=i32))
        G.scatter_add_dense_tokens(e(2048, 5120), e(2048, 5120), e(2048, dtype=i32), e(1, dtype=i32))
        G.scatter_add_dense_tokens(e(2048, 2880), e(2048, 2880), e(2048, dtype=i32), None)
        G.scatter_add_dense_tokens(e(2048, 16384), e(2048, 16384), e(2048, dtype=i32), None)
        G.scatter_add_dense_tokens(e(1, 5120), e(4, 5120), e(4, dtype=i32), None)
        for D in (5120, 7168, 16384, 2880, 1536):  # 1536: four rows per program (1024 + 512 wide)
            G.gather_scale_quant_dense_tokens(e(4096, D), e(4096, dtype=i32), e(4096, dtype=i32), e(4096, 128),
                                              e(1, dtype=torch.float32), e(1, dtype=i32))
        for A, D in ((4096, 5120), (64, 2880)):  # without scores (the experts pipeline's gathers)
            G.gather_scale_dense_tokens(e(A, D), e(A, dtype=i32), e(A, dtype=i32), None)
            G.gather_scale_quant_dense_tokens(e(A, D), e(A, dtype=i32), e(A, dtype=i32), None)
        # Deterministic scatter: the scan (two BLOCK_A buckets), then the bucket path: top-4 and
        # top-1 (4 and 2 rows per step), bucket capacities 4 to 256, no valid count, int64
        # indices, fp32 rows, small D (several tokens per tile).
        for A, T, D, dt, it, has_v in ((512, 128, 5120, bf, i32, True), (100, 64, 5120, bf, i32, False),
                                       (8192, 2048, 5120, bf, i32, True), (2048, 2048, 5120, bf, torch.int64, False),
                                       (16384, 2048, 7168, bf, i32, True), (65536, 512, 2880, bf, i32, True),
                                       (4096, 2048, 8, torch.float32, i32, False)):
            G.scatter_add_dense_tokens_deterministic(e(T, D, dtype=dt), e(A, D, dtype=dt), e(A, dtype=it),
                                                     e(1, dtype=i32) if has_v else None)
        """,
        ["moekit.ops._triton.gather_scatter"],
    )
    assert_all_compiled(records, 32)
    assert {r["constants"].get("HAS_SCORES") for r in records if "gather" in r["kernel"]} == {"True", "False"}
    # The one-pass FP8 gather holds a row of 5120 on 2 warps in 64 registers per lane (16 rows in
    # flight per SM; a float32 or masked row took 96: 10 rows), 7168 in at most 96.
    quant = {
        (r["constants"]["N_CHUNKS"], r["constants"]["UNMASKED"]): r
        for r in records
        if r["kernel"] == "_gather_scale_quant_kernel" and r["constants"]["ONE_PASS"] == "True"
    }
    assert set(quant) >= {("5", "True"), ("7", "True"), ("3", "False")}, set(quant)
    if quant[("5", "True")]["regs"] is not None:
        assert quant[("5", "True")]["num_warps"] == 2 and quant[("5", "True")]["regs"] <= 64, quant[("5", "True")]
        assert quant[("7", "True")]["regs"] <= 96, quant[("7", "True")]
    locked = [r for r in records if r["kernel"] == "_scatter_add_locked_kernel"]
    assert [(r["constants"]["N_CHUNKS"], r["num_warps"]) for r in locked] == [("5", 4), ("3", 2)], locked
    spec = {r["constants"].get("SPECULATE") for r in records if r["kernel"] == "_scatter_add_kernel"}
    assert spec == {"True", "False"}, spec
    caps = {r["constants"].get("CAP") for r in records if r["kernel"] == "_bucket_sum_kernel"}
    assert caps == {"4", "8", "16", "256"}, caps


@pytest.mark.reference
def test_gathers_without_scores_opcheck_and_compile():
    """``scores=None`` through the registered ops: schema, fake tensors, autograd registration and
    a ``fullgraph`` torch.compile of each gather."""
    x = randn(5, 16, seed=31)
    tok = torch.tensor([0, 1, 4, -1, 2], dtype=torch.int32)
    exp = torch.tensor([0, 3, 1, 0, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.moekit.gather_scale_dense_tokens.default, (x, tok, exp, None))
    torch.library.opcheck(torch.ops.moekit.gather_scale_quant_dense_tokens.default, (x.bfloat16(), tok, exp, None))
    f = torch.compile(lambda x, t, e: ops.gather_scale_dense_tokens(x, t, e, None), fullgraph=True)
    assert torch.equal(f(x, tok, exp), ops.gather_scale_dense_tokens(x, tok, exp, None))
    g = torch.compile(lambda x, t, e: ops.gather_scale_quant_dense_tokens(x, t, e, None), fullgraph=True)
    q, sc = g(x.bfloat16(), tok, exp)
    rq, rs = ops.gather_scale_quant_dense_tokens(x.bfloat16(), tok, exp, None)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rs)


@pytest.mark.reference
def test_default_scatter_dispatch_rule():
    """The default scatter-add takes the bucket sum only for top-k-like fan-ins (2 to 64 rows per
    token on average) past the one-launch scan's size; atomics otherwise."""
    pick = _tri()._prefer_bucket_sum
    assert pick(8192, 2048) and pick(65536, 16384) and pick(2048, 1024)
    assert not pick(2048, 2048)  # top-1
    assert not pick(1024, 256)  # small: the scan (or atomics) is one launch
    assert not pick(4096, 8)  # 512 rows per token: the overflow scan would serialize them
    assert pick(64 * 100, 100) and not pick(65 * 100, 100)
    locked = _tri()._prefer_locked
    assert locked(2048, 2048, 5120) and locked(16384, 16384, 7168) and locked(1024, 600, 8)
    assert not locked(1023, 2048, 5120)  # few rows: atomics
    assert not locked(4096, 2048, 5120)  # two rows per token: the bucket sum
    assert not locked(2048, 2048, 16384)  # rows past the one-pass register budget: atomics


@pytest.mark.reference
def test_token_locks_grow_and_keep_old_buffers(monkeypatch):
    """The lock buffer grows (doubling, at least 4096) and a replaced one stays referenced (a CUDA
    graph captured with it keeps using it); meta tensors stand in for a device."""
    tri = _tri()
    monkeypatch.setattr(tri, "_LOCKS", {})
    monkeypatch.setattr(tri, "_RETIRED_LOCKS", [])
    out = torch.empty(10, 8, device="meta")
    a = tri._token_locks(out, 10)
    assert a.numel() == 4096 and a.dtype == torch.int32
    assert tri._token_locks(out, 4000) is a
    b = tri._token_locks(out, 5000)
    assert b.numel() == 8192 and tri._RETIRED_LOCKS == [a]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert tri._token_locks(torch.empty(10, 8), 10) is None  # tracing: atomics


class _NoAtomics:
    def __getitem__(self, grid):
        raise AssertionError("the atomic scatter-add ran where the locked path was expected")


@pytest.mark.interpreter
@pytest.mark.parametrize("dup", [False, True], ids=["unique", "duplicates"])
@pytest.mark.parametrize("dtype,D", [(torch.float32, 2880), (torch.bfloat16, 24)])
def test_scatter_add_locked_interpreter(monkeypatch, pin_knobs, dup, dtype, D):
    """The locked read-add-write (top-1-like fan-ins): a permutation with a -1 tail and a short
    valid count, or tokens hit twice; untouched tokens keep their bits; every lock is free after."""
    tri = _tri()
    pin_knobs(LOCKED_MIN_ROWS=4)
    monkeypatch.setattr(tri, "_LOCKS", {})
    real_launch = tri.launch
    monkeypatch.setattr(tri, "launch", lambda k: _NoAtomics() if k is tri._scatter_add_kernel else real_launch(k))
    T = 11
    g = torch.Generator().manual_seed(D + dup)
    tidx = torch.randperm(T, generator=g)[:9].to(torch.int32)
    if dup:
        tidx[5:] = tidx[:4]  # four tokens receive two rows
    tidx[-1] = -1
    rows = randn(9, D, dtype=dtype, seed=1)
    out0 = randn(T, D, dtype=dtype, seed=2)
    for v in (None, vtc(6)):
        want = out0.clone()
        ref.scatter_add_dense_tokens(want, rows, tidx, v)
        got = out0.clone()
        tri.scatter_add_dense_tokens(got, rows, tidx, v)
        hit = torch.zeros(T, dtype=torch.bool)
        n = 9 if v is None else 6
        hit[tidx[:n][tidx[:n] >= 0].long()] = True
        assert torch.equal(got[~hit], out0[~hit])
        assert_close(got, want)
        assert not tri._LOCKS[("cpu", None)].any(), "a lock was left taken"


@pytest.mark.reference
def test_scatter_add_deterministic_too_many_rows():
    """Row indices travel as int32 in the buckets: 2**31 - 1 rows or more are refused (meta
    tensors: nothing is allocated or launched)."""
    tri = _tri()
    A = 2**31
    with pytest.raises(ValueError, match=re.escape("in_tokens must have fewer than 2**31 - 1 rows")):
        tri.scatter_add_dense_tokens_deterministic(
            torch.empty(4, 8, device="meta"),
            torch.empty(A, 8, device="meta"),
            torch.empty(A, dtype=torch.int32, device="meta"),
        )


@pytest.mark.reference
def test_public_ops_cpu_match_reference():
    T, E, K, D = 7, 6, 2, 16
    s, counts, eidx, tidx = routing(T, E, K, start=1, end=5, seed=1)
    x = randn(T, D, dtype=torch.bfloat16)
    v = vtc(9)
    got = ops.gather_scale_dense_tokens(x, tidx, eidx, s, v)
    assert got.dtype == torch.bfloat16 and got.shape == (T * K, D)
    assert torch.equal(got, ref.gather_scale_dense_tokens(x, tidx, eidx, s, v))
    q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, torch.tensor([0.1]), v)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, torch.tensor([0.1]), v)
    assert q.dtype == FP8 and torch.equal(q.float(), rq.float()) and torch.equal(sc, rs)

    out0, rows = randn(T, D), randn(T * K, D, seed=3)
    want = out0.clone()
    ref.scatter_add_dense_tokens(want, rows, tidx, v)
    for kw in ({}, {"deterministic": True}):
        o = out0.clone()
        assert ops.scatter_add_dense_tokens(o, rows, tidx, v, **kw) is o
        assert_close(o, want)
    o = out0.clone()
    assert ops.scatter_add_dense_tokens_deterministic(o, rows, tidx, v) is o
    assert_close(o, want)

    inp = randn(2, T * K, D, seed=4)
    o, w = out0.clone(), out0.clone()
    assert ops.scatter_add_padded_tokens(inp, counts[:E], tidx, o) is o
    ref.scatter_add_padded_tokens(inp, counts[:E], tidx, w)
    assert_close(o, w)


def _op_cases():
    T, E, K, D = 7, 6, 2, 16
    s, counts, eidx, tidx = routing(T, E, K, start=1, end=5, seed=2, column_major=True)
    x = randn(T, D, dtype=torch.bfloat16)
    return [
        ("gather_scale_dense_tokens", (x, tidx, eidx, s, vtc(9))),
        ("gather_scale_quant_dense_tokens", (x, tidx, eidx, s, torch.tensor([0.2]), vtc(11))),
        ("scatter_add_dense_tokens", (randn(T, D), randn(T * K, D, seed=1), tidx, vtc(5))),
        ("scatter_add_dense_tokens_deterministic", (randn(T, D), randn(T * K, D, seed=1), tidx, None)),
        ("scatter_add_padded_tokens", (randn(2, T * K, D, seed=2), counts[:E], tidx, randn(T, D))),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("name,args", _op_cases(), ids=[c[0] for c in _op_cases()])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.moekit, name).default, args)


@pytest.mark.reference
def test_torch_compile_fullgraph():
    T, E, K, D = 7, 6, 2, 16
    s, counts, eidx, tidx = routing(T, E, K, seed=4)
    x = randn(T, D)
    v = vtc(10)

    def f(x, tidx, eidx, s, v, out, rows, inp, counts):
        y = ops.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, None, v)
        ops.scatter_add_dense_tokens(out, rows, tidx, v)
        ops.scatter_add_dense_tokens(out, y, tidx, deterministic=True)
        ops.scatter_add_padded_tokens(inp, counts, tidx, out)
        return y, q, sc, out * 1

    args = (x, tidx, eidx, s, v, randn(T, D, seed=1), randn(T * K, D, seed=2), randn(2, T * K, D, seed=3), counts[:E])
    got = torch.compile(f, fullgraph=True, backend="inductor")(*[a.clone() if a is not None else a for a in args])
    want = f(*[a.clone() if a is not None else a for a in args])
    for g, w in zip(got, want):
        assert_close(g.float(), w.float(), tol=1e-5)


def _bad_calls():
    T, E, K, D = 4, 6, 2, 16
    s, counts, eidx, tidx = routing(T, E, K, seed=0)
    x = randn(T, D)
    out, rows = randn(T, D), randn(T * K, D)
    g = ops.gather_scale_dense_tokens
    q = ops.gather_scale_quant_dense_tokens
    sa = ops.scatter_add_dense_tokens
    sp = ops.scatter_add_padded_tokens
    return [
        ("x dtype", lambda: g(x.int(), tidx, eidx, s), TypeError, "x must have dtype"),
        ("x not 2-D", lambda: g(x[0], tidx, eidx, s), ValueError, "x must be 2-D"),
        ("x D % 8", lambda: g(randn(T, 12), tidx, eidx, s), ValueError, "multiple of 8"),
        ("x non-unit last stride", lambda: g(randn(D, T).T, tidx, eidx, s), ValueError, "x must have a unit stride"),
        ("x odd row stride", lambda: g(randn(T, 20)[:, :16], tidx, eidx, s), ValueError, "x must have strides"),
        ("token_indices dtype", lambda: g(x, tidx.float(), eidx, s), TypeError, "token_indices must have dtype"),
        ("expert_indices shape", lambda: g(x, tidx, eidx[:-1], s), ValueError, "expert_indices must have shape"),
        ("scores rows", lambda: g(x, tidx, eidx, s[:-1]), ValueError, "scores must have shape"),
        ("scores dtype", lambda: g(x, tidx, eidx, s.int()), TypeError, "scores must have dtype"),
        (
            "valid_token_count 2 elems",
            lambda: g(x, tidx, eidx, s, torch.tensor([1, 2])),
            ValueError,
            "valid_token_count",
        ),
        ("valid_token_count dtype", lambda: g(x, tidx, eidx, s, torch.tensor([1.0])), TypeError, "valid_token_count"),
        ("scale_ub dtype", lambda: q(x, tidx, eidx, s, torch.tensor([1], dtype=torch.float64)), TypeError, "scale_ub"),
        ("scale_ub numel", lambda: q(x, tidx, eidx, s, torch.ones(2)), ValueError, "scale_ub"),
        ("out_tokens dtype", lambda: sa(out.int(), rows, tidx), TypeError, "out_tokens must have dtype"),
        ("in_tokens columns", lambda: sa(out, randn(T * K, 24), tidx), ValueError, "out_tokens must have 24 columns"),
        ("in_tokens D % 8", lambda: sa(randn(T, 12), randn(T * K, 12), tidx), ValueError, "multiple of 8"),
        (
            "in_tokens non-contiguous",
            lambda: sa(out, randn(D, T * K).T, tidx),
            ValueError,
            "in_tokens must have a unit stride",
        ),
        ("token_indices length", lambda: sa(out, rows, tidx[:-1]), ValueError, "token_indices must have shape"),
        ("deterministic type", lambda: sa(out, rows, tidx, deterministic=1), TypeError, "deterministic must be a bool"),
        (
            "padded E % EP",
            lambda: sp(randn(4, T * K, D), counts[:E], tidx, out),
            ValueError,
            "multiple of in_tokens.shape[0]",
        ),
        ("padded in_tokens 2-D", lambda: sp(rows, counts[:E], tidx, out), ValueError, "in_tokens must be 3-D"),
        (
            "padded out dtype",
            lambda: sp(randn(2, T * K, D), counts[:E], tidx, out.half()),
            TypeError,
            "out_tokens must have dtype",
        ),
        (
            "padded token_indices",
            lambda: sp(randn(2, T * K, D), counts[:E], tidx[:3], out),
            ValueError,
            "token_indices must have shape",
        ),
        (
            "padded counts dtype",
            lambda: sp(randn(2, T * K, D), counts[:E].float(), tidx, out),
            TypeError,
            "token_counts must have dtype",
        ),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("case", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=re.escape(match)):
        call()


# ----------------------------------------------------------------------------------------------
# GPU tier
# ----------------------------------------------------------------------------------------------

GPU_CASES = [
    # T, E, K, D
    (1, 16, 1, 5120),
    (1, 257, 8, 7168),
    (7, 6, 4, 24),
    (7, 128, 2, 2880),
    (128, 16, 4, 5120),
    (128, 257, 8, 8),
    (4096, 16, 1, 5120),
    (4096, 128, 4, 7168),
    (4096, 128, 8, 2880),
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,D", GPU_CASES)
def test_gather_scale_gpu(T, E, K, D, cuda):
    tri = _tri()
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, column_major=True, seed=T, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=1)
    for v in (None, vtc(T * K // 2, cuda)):
        got = ops.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        want = ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        w = gather_written(tidx, eidx, v)
        assert torch.equal(got[w], want[w])
        out = poison(torch.empty(T * K, D, dtype=torch.bfloat16, device=cuda))
        tri.gather_scale_dense_tokens(x, tidx, eidx, s, v, out=out)
        assert_poisoned(out, w)
        assert torch.equal(out[w], want[w])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,D", GPU_CASES)
def test_gather_without_scores_gpu(T, E, K, D, cuda):
    """``scores=None``: the rows copied (the bf16 gather) and quantized unscaled (the FP8 one),
    the bits of unit scores."""
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, seed=T, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=2)
    ones = torch.ones(1, 1, device=cuda).expand(T, E)
    w = gather_written(tidx, eidx, None)
    got = ops.gather_scale_dense_tokens(x, tidx, eidx, None)
    assert torch.equal(got[w], ops.gather_scale_dense_tokens(x, tidx, eidx, ones)[w])
    assert torch.equal(got[w], x[tidx[w].long()])
    q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, None)
    uq, us = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, ones)
    assert torch.equal(q[w].view(torch.uint8), uq[w].view(torch.uint8)) and torch.equal(sc[w], us[w])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,D", GPU_CASES)
def test_gather_scale_stream_gpu(pin_knobs, T, E, K, D, cuda):
    """The persistent pipelined whole-row gather at every size (one program per SM: each loops
    over many units), with and without a valid count."""
    tri = _tri()
    pin_knobs(
        GATHER_WHOLE_ROW_MIN_ROWS_PER_SM=1, GATHER_WHOLE_ROW_MAX_ROWS_PER_SM=1 << 30, GATHER_STREAM_PROGRAMS_PER_SM=1
    )
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, column_major=True, seed=T, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=2)
    for v in (None, vtc(T * K // 2, cuda)):
        want = ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        w = gather_written(tidx, eidx, v)
        out = poison(torch.empty(T * K, D, dtype=torch.bfloat16, device=cuda))
        tri.gather_scale_dense_tokens(x, tidx, eidx, s, v, out=out)
        assert_poisoned(out, w)
        assert torch.equal(out[w], want[w])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,D", GPU_CASES)
def test_gather_scale_quant_gpu(T, E, K, D, cuda):
    tri = _tri()
    s, _, eidx, tidx = routing(T, E, K, start=1, end=E, seed=T + 1, dtype=torch.bfloat16, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=2)
    for ub, v in [(None, None), (torch.tensor([0.02], device=cuda), vtc(max(T * K - 5, 0), cuda))]:
        q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub, v)
        rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub, v)
        w = gather_written(tidx, eidx, v)
        check_fp8(q, sc, rq, rs, w)
        qp = poison(torch.empty(T * K, D, dtype=FP8, device=cuda))
        sp = poison(torch.empty(T * K, device=cuda))
        tri.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub, v, out=qp, out_scale=sp)
        assert_poisoned(qp, w)
        assert_poisoned(sp, w)


@pytest.mark.gpu
def test_gather_scale_quant_gpu_two_pass(cuda):
    T, E, K, D = 64, 16, 2, 16384  # wider than the one-pass limit
    s, _, eidx, tidx = routing(T, E, K, seed=9, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=9)
    q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    check_fp8(q, sc, rq, rs, gather_written(tidx, eidx, None))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [5120, 16384])  # one pass (unmasked), two passes
def test_gather_scale_quant_gpu_saturation_and_nan(D, cuda):
    """Without the explicit clamp (the conversion saturates): an element far past the row's
    scale_ub-capped amax saturates to +-448 as the reference's clamp does, and a row holding a NaN
    comes out NaN with a NaN scale, as the reference."""
    T, E, K = 64, 16, 1
    s, _, eidx, tidx = routing(T, E, K, seed=10, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=10)
    x[3, 7] = float("nan")
    x[5, 11], x[5, 12] = 1000.0, -1000.0
    ub = torch.tensor([0.05], device=cuda)
    q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub)
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, ub)
    w = gather_written(tidx, eidx, None, device=cuda)
    nan_rows = (tidx == 3) & w
    assert bool(nan_rows.any())
    assert torch.isnan(sc[nan_rows]).all() and torch.isnan(rs[nan_rows]).all()
    assert torch.isnan(q[nan_rows].float()).all() and torch.isnan(rq[nan_rows].float()).all()
    big = (tidx == 5) & w
    assert bool(big.any())
    assert (q[big].float()[:, 11:13].abs() == 448).all()
    check_fp8(q, sc, rq, rs, w & ~nan_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,D", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scatter_add_gpu(T, E, K, D, dtype, cuda):
    _, _, _, tidx = routing(T, E, K, start=1, end=E, seed=T + 2, device=cuda)
    out0 = randn(T, D, dtype=dtype, device=cuda, seed=3)
    rows = randn(T * K, D, dtype=dtype, device=cuda, seed=4)
    for v in (None, vtc(T * K // 3, cuda)):
        want = out0.clone()
        ref.scatter_add_dense_tokens(want, rows, tidx, v)
        got = ops.scatter_add_dense_tokens(out0.clone(), rows, tidx, v)
        assert_close(got, want, msg="atomic")
        det = ops.scatter_add_dense_tokens(out0.clone(), rows, tidx, v, deterministic=True)
        assert_close(det, want, msg="deterministic")
        assert not torch.isnan(det).any()
        for _ in range(3):
            again = ops.scatter_add_dense_tokens_deterministic(out0.clone(), rows, tidx, v)
            assert torch.equal(again, det), "deterministic scatter-add is not bitwise reproducible"


@pytest.mark.gpu
def test_scatter_add_locked_gpu(cuda):
    """Top-1 scatter-add through the token locks: tokens hit once, twice and 64 times (they
    serialize), a -1 tail and a short valid count; CUDA-graph replay with new data; locks free."""
    tri = _tri()
    T, A, D = 4096, 3000, 5120
    g = torch.Generator().manual_seed(5)
    tidx = torch.randperm(T, generator=g)[:A].to(torch.int32)
    tidx[1000:1500] = tidx[:500]
    tidx[2000:2064] = 7
    tidx[-10:] = -1
    tidx = tidx.to(cuda)
    assert tri._prefer_locked(A, T, D)
    rows = randn(A, D, dtype=torch.bfloat16, device=cuda, seed=6)
    out0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=7)
    for v in (None, vtc(2500, cuda)):
        want = out0.float().clone()
        ref.scatter_add_dense_tokens(want, rows.float(), tidx, v)
        got = ops.scatter_add_dense_tokens(out0.clone(), rows, tidx, v)
        assert_close(got.float(), want, dtype=torch.bfloat16, msg="locked")
    locks = tri._LOCKS[(out0.device.type, out0.device.index)]
    torch.cuda.synchronize()
    assert not locks.any(), "a lock was left taken"
    out = out0.clone()
    src = rows.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.scatter_add_dense_tokens(out, src, tidx)
    for seed in (8, 9):
        out.copy_(out0)
        src.copy_(randn(A, D, dtype=torch.bfloat16, device=cuda, seed=seed))
        graph.replay()
        want = out0.float().clone()
        ref.scatter_add_dense_tokens(want, src.float(), tidx)
        assert_close(out.float(), want, dtype=torch.bfloat16, msg="locked, graph replay")
    torch.cuda.synchronize()
    assert not locks.any()


@pytest.mark.gpu
@pytest.mark.parametrize("T,K", [(128, 4), (256, 4)])
def test_scatter_add_deterministic_gpu_paths_agree(T, K, cuda):
    """The one-launch scan (few rows) and the bucket path (forced) give the same bits, also
    with a token that receives more rows than its bucket holds."""
    tri = _tri()
    _, _, _, tidx = routing(T, 16, K, start=1, end=16, seed=T, device=cuda)
    for hot in (False, True):
        if hot:
            tidx[::3] = 5
        rows = randn(T * K, 5120, dtype=torch.bfloat16, device=cuda, seed=6)
        out0 = randn(T, 5120, dtype=torch.bfloat16, device=cuda, seed=7)
        v = vtc(T * K - 9, cuda)
        scan = out0.clone()
        tri.scatter_add_dense_tokens_deterministic(scan, rows, tidx, v)
        with settings.override(knobs={"SCAN_MAX_ROWS": 0}):
            bucket = out0.clone()
            tri.scatter_add_dense_tokens_deterministic(bucket, rows, tidx, v)
        assert torch.equal(_bits(scan), _bits(bucket))
        want = out0.to("cpu", copy=True)
        ref.scatter_add_dense_tokens_deterministic(want, rows.cpu(), tidx.cpu(), v.cpu())
        assert torch.equal(_bits(scan.cpu()), _bits(want)), "not the bits of the float32 reference"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,D,dtype",
    [
        (2048, 4, 5120, torch.bfloat16),
        (2048, 1, 5120, torch.bfloat16),
        (512, 8, 2880, torch.bfloat16),
        (300, 6, 7168, torch.float32),
        (4096, 2, 8, torch.float16),
        (64, 64, 1024, torch.bfloat16),
    ],
)
def test_scatter_add_deterministic_gpu_bitwise(T, K, D, dtype, cuda):
    """The bucket path at model shapes: bit for bit the float32 reference computed on the CPU
    (rows summed in ascending row order), for a top-k routing with a short valid count, for
    random indices (-1, out of range, tokens over their bucket's capacity) and for every row on
    one token; poisoned tokens that receive no row stay poisoned; repeated runs agree."""
    E = max(2 * K, 16)
    _, _, _, topk = routing(T, E, K, start=1, end=E, seed=T + K, device=cuda)
    one = torch.full((T * K,), T // 3, dtype=torch.int32, device=cuda)
    rows = randn(T * K, D, dtype=dtype, device=cuda, seed=1)
    for tidx, v in (
        (topk, vtc(T * K - 11, cuda)),
        (det_indices(T, T * K, seed=T, hot=7).to(cuda), None),
        (one, vtc(T * K // 2, cuda)),
    ):
        hit = hit_tokens(tidx, T, v, cuda)
        out0 = randn(T, D, dtype=dtype, device=cuda, seed=2)
        out0[~hit] = float("nan")
        want = out0.to("cpu", copy=True)
        ref.scatter_add_dense_tokens_deterministic(want, rows.cpu(), tidx.cpu(), None if v is None else v.cpu())
        got = ops.scatter_add_dense_tokens_deterministic(out0.clone(), rows, tidx, v)
        assert_poisoned(got, hit)
        h = hit.cpu()
        assert torch.equal(_bits(got.cpu()[h]), _bits(want[h])), "not the bits of the float32 reference"
        for _ in range(2):
            again = ops.scatter_add_dense_tokens_deterministic(out0.clone(), rows, tidx, v)
            assert torch.equal(_bits(again), _bits(got))


@pytest.mark.gpu
def test_cuda_graph_replay_deterministic_bucket_path(cuda):
    """The bucket path (memset, bucket kernel, sum) captured once, replayed with new indices (a
    token over capacity among them), a new valid count and new rows: the reference's bits."""
    T, K, D = 512, 4, 5120
    _, _, _, tidx = routing(T, 16, K, seed=3, device=cuda)
    v = vtc(T * K, cuda)
    rows = randn(T * K, D, dtype=torch.bfloat16, device=cuda, seed=3)
    out = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=4)
    g, _ = _capture(lambda: ops.scatter_add_dense_tokens_deterministic(out, rows, tidx, v))
    for seed, hot in ((5, None), (6, 9)):
        tidx.copy_(det_indices(T, T * K, seed=seed, hot=hot, every=4).to(cuda))
        v.fill_(T * K - 37 * seed)
        rows.copy_(randn(T * K, D, dtype=torch.bfloat16, device=cuda, seed=seed))
        o0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=seed + 10)
        out.copy_(o0)
        g.replay()
        torch.cuda.synchronize()
        want = o0.to("cpu", copy=True)
        ref.scatter_add_dense_tokens_deterministic(want, rows.cpu(), tidx.cpu(), v.cpu())
        assert torch.equal(_bits(out.cpu()), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 1024])
def test_scatter_add_gpu_untouched_tokens(T, cuda):
    """Tokens no row lands on keep their bits (poisoned out stays poisoned there); T = 1024
    takes the deterministic bucket path, T = 64 the scan."""
    D = 5120
    tidx = torch.randint(0, T // 2, (3 * T,), device=cuda, dtype=torch.int32)
    tidx[::5] = -1
    rows = randn(3 * T, D, dtype=torch.bfloat16, device=cuda)
    hit = torch.zeros(T, dtype=torch.bool, device=cuda)
    hit[tidx[tidx >= 0].long()] = True
    for det in (False, True):
        out = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=5)
        out[~hit] = float("nan")
        ops.scatter_add_dense_tokens(out, rows, tidx, deterministic=det)
        assert_poisoned(out, hit)


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2, 4, 8])
@pytest.mark.parametrize("T,K,D", [(1, 1, 5120), (128, 4, 2880), (4096, 1, 5120)])
def test_scatter_add_padded_gpu(EP, T, K, D, cuda):
    E = 16
    _, counts, _, tidx = routing(T, E, K, seed=EP, device=cuda)
    inp = randn(EP, T * K, D, dtype=torch.bfloat16, device=cuda, seed=6)
    out0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=7)
    want = out0.clone()
    ref.scatter_add_padded_tokens(inp, counts[:E], tidx, want)
    got = ops.scatter_add_padded_tokens(inp, counts[:E], tidx, out0.clone())
    assert_close(got, want)


def _capture(fn):
    """Warm ``fn`` up (compiles), then capture it in a CUDA graph. Returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()
    return g, res


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_data(cuda):
    T, E, K, D = 256, 16, 4, 2880
    s, _, eidx, tidx = routing(T, E, K, start=2, end=E, seed=1, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=1)
    v = vtc(T * K, cuda)
    out = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=2)
    rows = randn(T * K, D, dtype=torch.bfloat16, device=cuda, seed=3)
    out_det = out.clone()

    def step():
        y = ops.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, None, v)
        ops.scatter_add_dense_tokens(out, rows, tidx, v)
        ops.scatter_add_dense_tokens(out_det, rows, tidx, v, deterministic=True)
        return y, q, sc

    g, (y, q, sc) = _capture(step)
    # New data everywhere, in place.
    s2, _, e2, t2 = routing(T, E, K, start=0, end=E - 3, seed=7, device=cuda)
    s.copy_(s2)
    eidx.copy_(e2)
    tidx.copy_(t2)
    x.copy_(randn(T, D, dtype=torch.bfloat16, device=cuda, seed=8))
    v.fill_(T * K - 100)
    rows.copy_(randn(T * K, D, dtype=torch.bfloat16, device=cuda, seed=9))
    o0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=10)
    out.copy_(o0)
    out_det.copy_(o0)
    g.replay()
    torch.cuda.synchronize()
    w = gather_written(tidx, eidx, v)
    assert torch.equal(y[w], ref.gather_scale_dense_tokens(x, tidx, eidx, s, v)[w])
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s, None, v)
    check_fp8(q, sc, rq, rs, w)
    want = o0.clone()
    ref.scatter_add_dense_tokens(want, rows, tidx, v)
    assert_close(out, want)
    assert_close(out_det, want)


@pytest.mark.gpu
def test_cuda_graph_replay_padded(cuda):
    EP, E, T, K, D = 4, 16, 128, 2, 5120
    _, counts, _, tidx = routing(T, E, K, seed=1, device=cuda)
    c = counts[:E].clone()
    inp = randn(EP, T * K, D, dtype=torch.bfloat16, device=cuda, seed=1)
    out = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=2)
    g, _ = _capture(lambda: ops.scatter_add_padded_tokens(inp, c, tidx, out))
    _, counts2, _, t2 = routing(T, E, K, seed=5, device=cuda)
    c.copy_(counts2[:E])
    tidx.copy_(t2)
    inp.copy_(randn(EP, T * K, D, dtype=torch.bfloat16, device=cuda, seed=3))
    o0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=4)
    out.copy_(o0)
    g.replay()
    torch.cuda.synchronize()
    ref.scatter_add_padded_tokens(inp, c, tidx, o0)
    assert_close(out, o0)


@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(cuda):
    """The registered ops trace into Inductor graphs with their Triton kernels."""
    T, E, K, D = 64, 16, 2, 256
    s, counts, eidx, tidx = routing(T, E, K, start=1, end=E, seed=4, device=cuda)
    x = randn(T, D, dtype=torch.bfloat16, device=cuda)
    v = vtc(T * K - 7, cuda)

    def f(x, tidx, eidx, s, v, out, inp, counts):
        y = ops.gather_scale_dense_tokens(x, tidx, eidx, s, v)
        q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s, None, v)
        ops.scatter_add_dense_tokens(out, y, tidx, v, deterministic=True)
        ops.scatter_add_padded_tokens(inp, counts, tidx, out)
        return y, q.float(), sc, out * 1

    args = (
        x,
        tidx,
        eidx,
        s,
        v,
        randn(T, D, dtype=torch.bfloat16, device=cuda, seed=1),
        randn(2, T * K, D, dtype=torch.bfloat16, device=cuda, seed=3),
        counts[:E],
    )
    clone = lambda: [a.clone() for a in args]  # noqa: E731
    got = torch.compile(f, fullgraph=True)(*clone())
    want = f(*clone())
    w = gather_written(tidx, eidx, v)
    assert torch.equal(got[0][w], want[0][w])
    assert torch.equal(got[1][w], want[1][w]) and torch.equal(got[2][w], want[2][w])
    assert_close(got[3], want[3])


@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu_bucket_path(cuda):
    """The bucket path (a memset, the bucket kernel and the sum inside one registered op) and the
    default scatter-add's dispatch to it, traced by Inductor: the eager bits."""
    T, K, D = 512, 4, 512
    _, _, _, tidx = routing(T, 16, K, seed=6, device=cuda)
    rows = randn(T * K, D, dtype=torch.bfloat16, device=cuda, seed=2)
    v = vtc(T * K - 9, cuda)

    def f(out, rows, tidx, v):
        ops.scatter_add_dense_tokens(out, rows, tidx, v, deterministic=True)
        ops.scatter_add_dense_tokens(out, rows, tidx)  # default: dispatched to the bucket sum
        return out * 1

    out0 = randn(T, D, dtype=torch.bfloat16, device=cuda, seed=5)
    got = torch.compile(f, fullgraph=True)(out0.clone(), rows, tidx, v)
    want = f(out0.clone(), rows, tidx, v)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_offsets_past_2_pow_31_gpu(cuda):
    """Rows whose element offset exceeds 2**31 (x and out of about 4.3 GB each)."""
    D = 4096
    T = 2**31 // D + 64
    x = torch.empty(T, D, dtype=torch.bfloat16, device=cuda).normal_()
    s = torch.rand(T, 4, device=cuda) + 0.5
    tidx = torch.cat([torch.arange(T - 40, T, device=cuda), torch.arange(0, 8, device=cuda)]).int()
    eidx = (torch.arange(48, device=cuda) % 4).int()
    got = ops.gather_scale_dense_tokens(x, tidx, eidx, s)
    want = x[tidx.long()].float() * s[tidx.long(), eidx.long()].unsqueeze(1)
    assert torch.equal(got, want.to(torch.bfloat16))
    q, sc = ops.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    rq, rs = ref.quantize_fp8_row(want, eps=1e-12)
    check_fp8(q, sc, rq, rs, torch.ones(48, dtype=torch.bool))
    del x
    out = torch.zeros(T, D, dtype=torch.bfloat16, device=cuda)
    for det in (False, True):
        out[-40:].zero_()
        ops.scatter_add_dense_tokens(out, got, tidx, deterministic=det)
        assert torch.equal(out[-40:], got[:40])
    # The deterministic bucket path (forced: 48 rows would take the scan) on the same tokens.
    out[-40:].zero_()
    with settings.override(knobs={"SCAN_MAX_ROWS": 0}):
        ops.scatter_add_dense_tokens_deterministic(out, got, tidx)
    assert torch.equal(out[-40:], got[:40])
