"""shuffle_top_k: the sorted row layout of a given top-k choice (Triton kernels in the interpreter
and on the GPU, the public op on the CPU) against ``moekit.reference.shuffle_top_k``.

Integer outputs must match exactly, the row weights bitwise (they are copied, in float32).
"""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops import shuffle_top_k

# (name, E, top_k)
SHAPES = [("qwen3", 128, 8), ("deepseek", 256, 8), ("gpt-oss", 128, 4), ("mixtral", 8, 2), ("scout", 16, 1),
          ("k16-E512", 512, 16), ("odd-E", 24, 5)]  # fmt: skip


def choice(T: int, E: int, k: int, seed: int, dup: float = 0.0, bad: float = 0.0, idx_dtype=torch.int64,
           w_dtype=torch.float32):  # fmt: skip
    """Distinct experts per token (a random permutation's first k), then a fraction ``dup`` of
    slots overwritten with the token's first expert (repeats) and ``bad`` with out-of-range ids
    (-1, E, 2**31 - 1 for int32, 2**40 for int64)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].clone()
    if dup and k > 1:
        m = torch.rand(T, k, generator=g) < dup
        m[:, 0] = False
        ids = torch.where(m, ids[:, :1].expand(T, k), ids)
    if bad:
        m = torch.rand(T, k, generator=g) < bad
        big = 2**31 - 1 if idx_dtype == torch.int32 else 2**40
        junk = torch.tensor([-1, E, big])[torch.randint(0, 3, (T, k), generator=g)]
        ids = torch.where(m, junk, ids)
    w = torch.rand(T, k, generator=g).to(w_dtype)
    return ids.to(idx_dtype), w


def check(got, want, msg=""):
    names = ("token_counts", "expert_indices", "token_indices", "row_weights", "selection_rows")
    for g, w, n in zip(got, want, names):
        g, w = g.cpu(), w.cpu()
        assert g.dtype == (torch.float32 if n == "row_weights" else torch.int32), f"{msg} {n} dtype {g.dtype}"
        assert torch.equal(g, w), f"{msg} {n}: {(g != w).sum().item()} mismatches\n{g}\n{w}"


def _kernel(ids, w, E, start=0, end=None, zero=None):
    from moekit.ops._triton import route as R

    return R.shuffle_top_k(ids, w, E, start, E if end is None else end, zero)


# ---------------------------------------------------------------------------- reference tier


@pytest.mark.reference
def test_reference_semantics():
    """Every slot in range is a row, sorted by (expert, token, slot); repeats get a row each; bad ids
    none."""
    ids = torch.tensor([[3, 1, 3], [0, 7, 1], [1, -1, 2]])
    w = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    counts, eidx, tidx, rw, srow = ref.shuffle_top_k(ids, w, 4)
    assert counts.tolist() == [1, 3, 1, 2, 3, 7]
    assert eidx.tolist() == [0, 1, 1, 1, 2, 3, 3, -1, -1]
    assert tidx.tolist() == [1, 0, 1, 2, 2, 0, 0, -1, -1]
    assert rw.tolist() == [1.0, 0.25, 3.0, 4.0, 6.0, 0.5, 0.125, 0.0, 0.0]
    assert srow.tolist() == [5, 1, 6, 0, -1, 2, 3, -1, 4]
    # an expert range: local ids, the rest no rows
    counts, eidx, tidx, rw, srow = ref.shuffle_top_k(ids, w, 4, expert_index_start=1, expert_index_end=3)
    assert counts.tolist() == [0, 3, 1, 0, 3, 4] and eidx.tolist()[:4] == [0, 0, 0, 1]
    assert srow.tolist() == [-1, 0, -1, -1, -1, 1, 2, -1, 3]


@pytest.mark.reference
@pytest.mark.parametrize("s", SHAPES[:4], ids=[s[0] for s in SHAPES[:4]])
def test_reference_matches_route_and_shuffle_on_its_choice(s):
    """On a repeat-free choice the layout is route_and_shuffle's (its weights and ids fed back)."""
    _, E, k = s
    logits = torch.randn(13, E, generator=torch.Generator().manual_seed(E))
    w, ids = ref.routing_weights(logits, k, "softmax", True)
    check(ref.shuffle_top_k(ids, w, E), ref.route_and_shuffle(logits, k, "softmax", True))


@pytest.mark.reference
def test_public_cpu_matches_reference_and_zeroes():
    ids, w = choice(11, 128, 8, seed=1, dup=0.2, bad=0.1)
    zero = torch.ones(11, 8)
    check(shuffle_top_k(ids, w, 128, zero_buffer=zero), ref.shuffle_top_k(ids, w, 128))
    assert (zero == 0).all()


@pytest.mark.reference
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(ids=torch.zeros(3, 2)), TypeError, "top_k_index"),
        (dict(ids=torch.zeros(6, dtype=torch.int64)), ValueError, "top_k_index"),
        (dict(w=torch.zeros(3, 3)), ValueError, "top_k_weights"),
        (dict(w=torch.zeros(3, 2, dtype=torch.int32)), TypeError, "top_k_weights"),
        (dict(E=0), ValueError, "num_experts"),
        (dict(E="8"), TypeError, "num_experts"),
        (dict(expert_index_start=5, expert_index_end=3), ValueError, "expert range"),
        (dict(zero_buffer=torch.zeros(4, 8)[:, ::2]), ValueError, "zero_buffer"),
    ],
)
def test_bad_arguments(kw, exc, match):
    kw = dict(kw)
    ids = kw.pop("ids", torch.zeros(3, 2, dtype=torch.int64))
    w = kw.pop("w", torch.zeros(3, 2))
    E = kw.pop("E", 8)
    with pytest.raises(exc, match=match):
        shuffle_top_k(ids, w, E, **kw)


@pytest.mark.reference
def test_opcheck_and_compile_cpu():
    ids, w = choice(6, 16, 3, seed=0, dup=0.3)
    torch.library.opcheck(torch.ops.moekit.shuffle_top_k.default, (ids, w, 16, 0, 16, torch.ones(6, 8)))
    torch._dynamo.reset()
    fn = torch.compile(lambda i, x: shuffle_top_k(i, x, 16), fullgraph=True)
    check(fn(ids, w), ref.shuffle_top_k(ids, w, 16))


@pytest.mark.reference
def test_plan_and_support():
    from moekit.ops._triton.route import _topk_rows_plan, topk_rows_supported

    assert _topk_rows_plan(1, 128, 8) == (1, False, 1, 1)
    assert _topk_rows_plan(64, 128, 8) == (16, False, 64, 1)  # four sub-tiles of 16 in one program
    assert _topk_rows_plan(65, 128, 8)[1:] == (True, 16, 5)
    assert _topk_rows_plan(16384, 128, 8)[1:] == (True, 64, 256)  # about TOPK_ROWS_TARGET blocks
    assert _topk_rows_plan(16384, 8, 2)[1:] == (True, 128, 128)  # blocks of one 128-token sub-tile at least
    with settings.override(knobs={"TOPK_ROWS_BLOCKS": 1024}):  # one sub-tile per block
        assert _topk_rows_plan(16384, 128, 8)[1:] == (True, 16, 1024)
    with settings.override(knobs={"TOPK_ROWS_BLOCKS": 64}):  # sessions 11-29
        assert _topk_rows_plan(16384, 128, 8)[1:] == (True, 256, 64)
    assert _topk_rows_plan(16384, 128, 8)[1:] == (True, 64, 256)  # the cached plan follows the knob
    assert topk_rows_supported(16384, 512, 16) and not topk_rows_supported(1, 513, 1)
    assert not topk_rows_supported(1, 16, 17) and not topk_rows_supported(0, 16, 2)
    assert not topk_rows_supported(2**20, 128, 8)  # 16384 tokens x 8 per block: past the packed rank


@pytest.mark.reference
def test_past_the_kernels_is_said_once(monkeypatch):
    import warnings

    from moekit.ops import _common
    from moekit.ops import routing as ops_routing

    monkeypatch.setattr(_common, "_WARNED", set())
    monkeypatch.setattr(ops_routing, "use_triton", lambda t: True)  # the CUDA branch, on CPU tensors
    ids, w = choice(3, 600, 2, seed=0)
    with pytest.warns(UserWarning, match="PyTorch reference serves them"):
        check(shuffle_top_k(ids, w, 600), ref.shuffle_top_k(ids, w, 600))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shuffle_top_k(ids, w, 600)


# ---------------------------------------------------------------------------- interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize("s", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_interp_matches_reference(s, T):
    _, E, k = s
    ids, w = choice(T, E, k, seed=T, dup=0.25, bad=0.1)
    zero = torch.full((T, 24), 7.0, dtype=torch.bfloat16)
    check(_kernel(ids, w, E, zero=zero), ref.shuffle_top_k(ids, w, E), f"{s[0]} T={T}")
    assert (zero == 0).all(), "zero_buffer not zeroed"


@pytest.mark.interpreter
@pytest.mark.parametrize("s", [SHAPES[0], SHAPES[3], SHAPES[5]], ids=["qwen3", "mixtral", "k16-E512"])
def test_interp_split_path(s):
    """Past four sub-tiles: blocks of tokens side by side, then the placing launch (the last
    block partial), with an expert range, repeats and bad ids."""
    from moekit.ops._triton.route import _topk_rows_plan

    _, E, k = s
    T = 4 * _topk_rows_plan(1 << 20, E, k)[0] + 3
    assert _topk_rows_plan(T, E, k)[1]
    ids, w = choice(T, E, k, seed=2, dup=0.2, bad=0.05, idx_dtype=torch.int32, w_dtype=torch.bfloat16)
    start, end = E // 8, E - 1
    want = ref.shuffle_top_k(ids, w, E, expert_index_start=start, expert_index_end=end)
    check(_kernel(ids, w, E, start, end), want, f"{s[0]} T={T}")


@pytest.mark.interpreter
def test_interp_split_path_many_blocks():
    """Knob ``TOPK_ROWS_BLOCKS``: blocks of one sub-tile each, their counts scanned by the
    column-scan launch (``FUSED_SCAN_MAX`` pinned low) rather than by the placing programs: the
    reference's layout, bit for bit."""
    from moekit.ops._triton.route import _topk_rows_plan

    E, k = 128, 8
    bt = _topk_rows_plan(1 << 20, E, k)[0]
    T = 5 * bt + 3
    ids, w = choice(T, E, k, seed=4, dup=0.2, bad=0.05)
    with settings.override(knobs={"TOPK_ROWS_BLOCKS": 1024, "FUSED_SCAN_MAX": 16}):
        assert _topk_rows_plan(T, E, k)[1:] == (True, bt, 6)
        got = _kernel(ids, w, E)
    check(got, ref.shuffle_top_k(ids, w, E), f"T={T}")


@pytest.mark.interpreter
def test_interp_strided_inputs_and_one_expert():
    """Column-major ids and weights; every token naming expert 77 in two slots."""
    ids, w = choice(40, 128, 8, seed=5)
    ids[:, 0] = 77
    ids[:, 3] = 77
    cm_ids, cm_w = ids.T.contiguous().T, w.T.contiguous().T
    got = _kernel(cm_ids, cm_w, 128)
    check(got, ref.shuffle_top_k(ids, w, 128))
    assert int(got[0][77]) == int((ids == 77).sum()) >= 80


@pytest.mark.interpreter
def test_interp_public_op_uses_kernel(monkeypatch):
    import moekit.ops.routing as ops_routing
    from moekit.ops._triton import route as R

    monkeypatch.setattr(ops_routing, "use_triton", lambda t: True)
    calls = []
    real = R.shuffle_top_k
    monkeypatch.setattr(R, "shuffle_top_k", lambda *a: calls.append(1) or real(*a))
    ids, w = choice(9, 64, 6, seed=3, dup=0.3)
    check(shuffle_top_k(ids, w, 64), ref.shuffle_top_k(ids, w, 64))
    assert calls == [1]


@pytest.mark.reference
def test_kernel_compiles_for_sm90():
    """Both launches, compiled on the CPU for sm_90 through ptxas."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import route as R
        m = "meta"
        for T, E, k, idt in ((1, 128, 8, torch.int64), (512, 128, 8, torch.int64), (300, 8, 2, torch.int64),
                             (7, 512, 16, torch.int32)):
            ids = torch.empty(T, k, dtype=idt, device=m)
            w = torch.empty(T, k, dtype=torch.bfloat16, device=m)
            R.shuffle_top_k(ids, w, E, 0, E, torch.empty(T, 2048, dtype=torch.bfloat16, device=m))
        """,
        ["moekit.ops._triton.route"],
        pdl=True,
    )
    assert_all_compiled(records, 5)  # T = 512 at E = 128 splits: two launches


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("s", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("T", [1, 4, 32, 64, 65, 512, 4096])
def test_gpu_matches_reference(s, T, cuda):
    _, E, k = s
    ids, w = choice(T, E, k, seed=T, dup=0.1, bad=0.05)
    zero = torch.full((T, 520), 3.0, dtype=torch.bfloat16, device=cuda)
    check(shuffle_top_k(ids.to(cuda), w.to(cuda), E, zero_buffer=zero), ref.shuffle_top_k(ids, w, E), f"{s[0]} T={T}")
    assert (zero == 0).all()
    ids32, wb = ids.int(), w.to(torch.bfloat16)
    check(shuffle_top_k(ids32.to(cuda), wb.to(cuda), E, expert_index_start=1, expert_index_end=E - 1),
          ref.shuffle_top_k(ids32, wb, E, expert_index_start=1, expert_index_end=E - 1), f"{s[0]} T={T} range")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 200])
def test_gpu_cuda_graph_replays_new_choice(T, cuda):
    ids, w = choice(T, 128, 8, seed=0)
    si, sw = ids.to(cuda), w.to(cuda)
    shuffle_top_k(si, sw, 128)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = shuffle_top_k(si, sw, 128)
    for seed in (1, 2, 3):
        ids, w = choice(T, 128, 8, seed=seed, dup=0.2)
        si.copy_(ids)
        sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        check(outs, ref.shuffle_top_k(ids, w, 128))
