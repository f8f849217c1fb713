"""Eager calls skip the dispatcher only where it would do nothing else (``moekit.ops._common.call_op``):
the same results both ways, and every case that needs the registered op still gets it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moekit.ops as ops
from moekit import settings
from moekit.ops._common import call_op, direct_ok
from moekit.ops.activation import _silu_mul_op

pytestmark = pytest.mark.reference


def _inputs():
    g = torch.Generator().manual_seed(0)
    T, E, D, F, k = 6, 8, 32, 16, 2
    x = torch.randn(T, D, generator=g)
    scores = torch.randn(T, E, generator=g)
    w13 = torch.randn(E * 2 * F, D, generator=g) / 8
    w2 = torch.randn(E * D, F, generator=g) / 8
    return x, scores, w13, w2, k, E, F


def _pipeline(x, scores, w13, w2, k, E, F):
    counts, eidx, tidx = ops.index_shuffling(scores, top_k=k)
    w = torch.ones(x.shape[0], E)
    xg = ops.gather_scale_dense_tokens(x, tidx, eidx, w)
    h = ops.grouped_gemm(xg, w13, counts[:E])
    z = ops.silu_mul(h[:, :F], h[:, F:])
    out = torch.zeros_like(x)
    ops.grouped_gemm(z, w2, counts[:E], _output_tensor=out, _scatter_add_indices=tidx)
    return counts, eidx, tidx, out


def test_direct_and_dispatched_calls_agree():
    args = _inputs()
    with settings.override(eager_direct=True):
        direct = _pipeline(*args)
    with settings.override(eager_direct=False):
        dispatched = _pipeline(*args)
    for a, b in zip(direct, dispatched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_direct_path_is_taken_for_plain_eager_calls(monkeypatch):
    x = torch.randn(4, 8)
    calls = []
    real = _silu_mul_op._init_fn
    monkeypatch.setattr(_silu_mul_op, "_init_fn", lambda *a: calls.append(1) or real(*a))
    ops.silu_mul(x[:, :4], x[:, 4:])
    assert calls == [1]
    with settings.override(eager_direct=False):
        ops.silu_mul(x[:, :4], x[:, 4:])
    assert calls == [1]  # MOEKIT_EAGER_DIRECT=0: through torch.ops.moekit (the registered op)


def test_direct_ok_refuses_what_the_dispatcher_must_see():
    x = torch.randn(4, 8)
    assert direct_ok((x, None, 3), {})
    assert direct_ok(([x, x],), {"y": x})
    p = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    assert direct_ok((p,), {})
    g = torch.randn(2, requires_grad=True)
    assert not direct_ok((g,), {})  # autograd would see it
    with torch.no_grad():
        assert direct_ok((g,), {})
    assert not direct_ok(([x, g],), {})
    with FakeTensorMode() as mode:
        f = mode.from_tensor(x)
        assert not direct_ok((f,), {})  # a dispatch mode is active
    with torch.device("cpu"):
        assert not direct_ok((x,), {})  # a torch function mode (the device context) is active
    with settings.override(eager_direct=False):
        assert not direct_ok((x,), {})


def test_fake_tensors_still_get_shapes():
    x = torch.randn(4, 8)
    with FakeTensorMode() as mode:
        f = mode.from_tensor(x)
        y = call_op(_silu_mul_op, f[:, :4], f[:, 4:], None)
    assert tuple(y.shape) == (4, 4)


def test_compiled_call_matches_eager():
    x = torch.randn(4, 8)
    fn = torch.compile(lambda t: ops.silu_mul(t[:, :4], t[:, 4:]), fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(x), ops.silu_mul(x[:, :4], x[:, 4:]), rtol=0, atol=0)


def _traced_tags(fn, *args) -> list:
    """The ``cache_tag`` of every moekit op in the graph Dynamo traces from ``fn(*args)``."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=record)(*args)
    (gm,) = graphs
    return [n.kwargs.get("cache_tag") for n in gm.graph.nodes if n.op == "call_function" and "moekit" in str(n.target)]


def test_compiled_graphs_carry_moekit_state():
    """torch.compile's AOTAutograd cache keys a graph by what Dynamo traced, and moekit's launchers
    decide their kernels from state it never saw (settings, knobs, tuned tables, moekit's code, the
    GPU): each traced op carries a digest of that state (``compile_cache_tag``), so a changed state
    is a changed graph, never a cached one compiled under another. Eager calls pass none."""
    from moekit.ops._triton import gg_config

    x = torch.randn(4, 8)

    def fn(t):
        return ops.silu_mul(t[:, :4], t[:, 4:])

    base = _traced_tags(fn, x)
    assert len(base) == 1 and base[0].startswith("moekit-"), base
    assert _traced_tags(fn, x) == base  # the same state: the same graph, a cache hit
    with settings.override(knobs={"GG_DEVICE_TMA": 1}):
        knob = _traced_tags(fn, x)
    with settings.override(gg_tma=False):
        other = _traced_tags(fn, x)
    gg_config.use_table(None)  # a tuned table installed (here the default one again)
    table = _traced_tags(fn, x)
    assert len({base[0], knob[0], other[0], table[0]}) == 4, (base, knob, other, table)
    assert "cache_tag" in str(torch.ops.moekit.silu_mul.default._schema)
    torch._dynamo.reset()


def test_private_launchers_launch_directly_outside_a_trace():
    """A private launcher called outside a trace (benchmarks, sweeps) launches its kernel itself,
    not through ``wrap_triton``'s higher-order op, which files every call's non-tensor arguments
    (TMA descriptors and the tensors they hold among them) in a process-wide side table for good.
    Under a trace (a dispatch mode: fake tensors, make_fx, export) the wrapper is used."""
    from torch._library.triton import set_wrap_triton_enabled

    from moekit.ops._common import _DIRECT, _tracing, launch
    from moekit.ops._triton.gg_swiglu import _swiglu_tiled_kernel

    assert not _tracing()
    with set_wrap_triton_enabled(True):
        first = launch(_swiglu_tiled_kernel)
        assert first is launch(_swiglu_tiled_kernel) is _DIRECT[_swiglu_tiled_kernel]
        with FakeTensorMode():
            assert _tracing()
            traced = launch(_swiglu_tiled_kernel)
        assert traced is not first  # a fresh wrapper of wrap_triton's kernel (its PDL launcher)
