"""Expert parallelism with deduplicated communication across the TP group
(``MoEArgs(dedup_comm=True)``, MSLK's ``dedup_comm``).

Four gloo ranks laid out as 2 "nodes" x 2 TP ranks: TP groups {0, 1} and {2, 3} (the TP ranks of
a node hold the same tokens and shard every expert's hidden dim), EP groups {0, 2} and {1, 3}.
Each rank returns a TP partial; the sum over a node's TP ranks (the caller's TP all-reduce) must
equal the single-process layer on that node's tokens, for the static and the dynamic EP paths,
with and without deduplication (the same shards, so both agree closely).
"""

from __future__ import annotations

import pytest
import torch

from moekit.layers import MetaShufflingMoE, MoEArgs
from moekit.testing import assert_close
from tests.comm._dist import run_distributed
from tests.layers.test_moe import CASES, PRECISIONS, _x

D, F = 64, 32
TP, NODES = 2, 2


def _full_args(case: str, prec: str, **kw) -> MoEArgs:
    precision, dtype, _, _ = PRECISIONS[prec]
    return MoEArgs(**{"dim": D, "hidden_dim": F, "precision": precision, "dtype": dtype, **CASES[case], **kw})


def _shard(full: MetaShufflingMoE, args: MoEArgs, j: int, **groups) -> MetaShufflingMoE:
    """TP shard ``j`` of ``full``'s weights (hidden dims split in ``TP``), this EP rank's experts."""
    w = full.reference_weights()
    Fh = F // TP
    f, up = slice(j * Fh, (j + 1) * Fh), slice(F + j * Fh, F + (j + 1) * Fh)
    kw = dict(router_DE=w["router_DE"], w13_e2FD=torch.cat([w["w13_e2FD"][:, f], w["w13_e2FD"][:, up]], dim=1),
              w2_eDF=w["w2_eDF"][:, :, f], e_score_correction_bias=w.get("e_score_correction_bias"))  # fmt: skip
    Fs = full.args.shared_hidden_dim
    if Fs:
        h = Fs // TP
        fs, sup = slice(j * h, (j + 1) * h), slice(Fs + j * h, Fs + (j + 1) * h)
        kw.update(shared_w13_2FD=torch.cat([w["shared_w13_2FD"][fs], w["shared_w13_2FD"][sup]]),
                  shared_w2_DF=w["shared_w2_DF"][:, fs])  # fmt: skip
    return MetaShufflingMoE.from_weights(args, **kw, **groups)


# (case, precision, tokens per node, ep_comm)
DEDUP_CASES = [
    ("llama4-k1", "fp32", (5, 5), "static"),
    ("deepseek-k8", "bf16", (4, 4), "static"),
    ("mixtral-k2", "fp8", (3, 3), "static"),
    ("deepseek-k8", "fp32", (6, 2), "dynamic"),
    ("llama4-k1", "fp8", (4, 0), "dynamic"),  # a node without tokens
    ("qwen-k8", "bf16", (1, 7), "dynamic"),
    ("mixtral-k2", "fp32", (5, 3), "dynamic"),
]


def _rank_outputs(rank: int, world: int, backend: str, cases: list) -> list:
    import torch.distributed as dist

    # Every process creates every group, in the same order.
    tp_groups = [dist.new_group([n * TP + j for j in range(TP)]) for n in range(NODES)]
    ep_groups = [dist.new_group([n * TP + j for n in range(NODES)]) for j in range(TP)]
    node, j = divmod(rank, TP)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    outs = []
    for i, (case, prec, Ts, ep_comm) in enumerate(cases):
        full = MetaShufflingMoE(_full_args(case, prec), seed=13, device=device)
        x_all = _x((sum(Ts), D), full.args.dtype, seed=i, device=device)
        x = x_all[sum(Ts[:node]) : sum(Ts[: node + 1])]
        got = {}
        for dedup in (False, True):
            args = _full_args(case, prec, ep_size=NODES, ep_rank=node, tp_size=TP, tp_rank=j, ep_comm=ep_comm,
                              dedup_comm=dedup)  # fmt: skip
            m = _shard(full, args, j, ep_group=ep_groups[j], tp_group=tp_groups[node] if dedup else None)
            got[dedup] = m(x).cpu()
        outs.append((got[False], got[True]))
    return outs


def _check(cases: list, backend: str, device: str) -> None:
    results = run_distributed(_rank_outputs, NODES * TP, backend, args=(backend, cases), timeout_s=300.0)
    for i, (case, prec, Ts, ep_comm) in enumerate(cases):
        _, dtype, tol_ref, tol_base = PRECISIONS[prec]
        full = MetaShufflingMoE(_full_args(case, prec), seed=13, device=device)
        x_all = _x((sum(Ts), D), dtype, seed=i, device=device)
        want = full(x_all).float().cpu()
        msg = f"case {i} {case}/{prec} {ep_comm} Ts={Ts}"
        for dedup in (False, True):
            nodes = []
            for n in range(NODES):
                parts = [results[n * TP + j][i][int(dedup)] for j in range(TP)]
                assert all(p.shape == (Ts[n], D) and p.dtype == dtype for p in parts), msg
                nodes.append(sum(p.float() for p in parts))  # the caller's TP all-reduce
            got = torch.cat(nodes)
            # FP8: each TP shard quantizes its own half of w2's rows (other scales than the full layer).
            assert_close(got, want, tol=tol_ref if prec == "fp8" else tol_base, msg=f"{msg} dedup={dedup}")
        for n in range(NODES):
            for j in range(TP):
                plain, dedup = results[n * TP + j][i]
                if Ts[n]:
                    # With dedup a TP rank holds only its column slice of the routed output.
                    c0 = j * (D // TP)
                    routed_cols = torch.zeros(D, dtype=torch.bool)
                    routed_cols[c0 : c0 + D // TP] = True
                    if not full.args.shared_hidden_dim:
                        assert torch.all(dedup[:, ~routed_cols] == 0), f"{msg}: columns outside rank {j}'s slice"
        dedup_sum = torch.cat([sum(results[n * TP + j][i][1].float() for j in range(TP)) for n in range(NODES)])
        plain_sum = torch.cat([sum(results[n * TP + j][i][0].float() for j in range(TP)) for n in range(NODES)])
        assert_close(dedup_sum, plain_sum, tol=tol_base, msg=f"{msg}: dedup vs plain")


@pytest.mark.reference
def test_dedup_comm_four_ranks_matches_single_process():
    _check(DEDUP_CASES, "gloo", "cpu")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_dedup_comm_nccl_four_gpus():
    if torch.cuda.device_count() < NODES * TP:
        pytest.skip(f"needs {NODES * TP} CUDA GPUs (EP {NODES} x TP {TP})")
    # fp32 GEMMs on the GPU may use TF32: the fp32 tolerance (1e-5) is the CPU's.
    _check([c for c in DEDUP_CASES if c[1] != "fp32"], "nccl", "cuda:0")


@pytest.mark.reference
def test_dedup_comm_validation():
    # dim // tp_size must be a multiple of 8.
    with pytest.raises(ValueError, match="dedup_comm needs dim // tp_size"):
        MoEArgs(dim=40, hidden_dim=32, num_experts=8, ep_size=2, tp_size=2, dedup_comm=True)
    with pytest.raises(TypeError, match="dedup_comm must be a bool"):
        MoEArgs(dim=64, hidden_dim=32, num_experts=8, dedup_comm=1)
    # Without EP or without TP the option has no effect (and needs no group).
    assert not MoEArgs(dim=64, hidden_dim=32, num_experts=8, tp_size=2, dedup_comm=True).uses_dedup_comm
    assert not MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, dedup_comm=True).uses_dedup_comm
    assert MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, tp_size=2, dedup_comm=True).uses_dedup_comm
    m = MetaShufflingMoE(MoEArgs(dim=64, hidden_dim=32, num_experts=8, tp_size=2, dedup_comm=True,
                                 dtype=torch.float32), seed=1)  # fmt: skip
    x = _x((3, 64), torch.float32)
    plain = MetaShufflingMoE(MoEArgs(dim=64, hidden_dim=32, num_experts=8, tp_size=2, dtype=torch.float32), seed=1)
    assert torch.equal(m(x), plain(x))


def _missing_tp_group(rank: int, world: int, backend: str) -> str:
    import torch.distributed as dist

    args = MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, ep_rank=rank, tp_size=2, dedup_comm=True,
                   dtype=torch.float32)  # fmt: skip
    try:
        MetaShufflingMoE(args, ep_group=dist.group.WORLD)
    except ValueError as e:
        msg = str(e)
    else:
        msg = "no error"
    wide = MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, ep_rank=rank, tp_size=4, dedup_comm=True,
                   dtype=torch.float32)  # fmt: skip
    try:  # a TP group of the wrong size
        MetaShufflingMoE(wide, ep_group=dist.group.WORLD, tp_group=dist.group.WORLD)
    except ValueError as e:
        msg += " | " + str(e)
    return msg


@pytest.mark.reference
def test_dedup_comm_needs_the_tp_group():
    for msg in run_distributed(_missing_tp_group, 2, "gloo", args=("gloo",), timeout_s=120.0):
        assert "tp_group is required" in msg and "tp_group must have size tp_size=4" in msg, msg
