"""Programmatic dependent launch: every launched kernel waits before touching memory, the launcher
turns PDL on only where it may, and every kernel compiles for sm_90 with it on."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch

from moekit import settings
from moekit.ops import _common

triton = pytest.importorskip("triton")


def _kernel_modules() -> list[str]:
    """Every module of ``moekit.ops._triton`` (a new kernel file is covered without listing it)."""
    import pkgutil

    import moekit.ops._triton as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))


_MODULES = _kernel_modules()


def _launched_kernels() -> list[tuple[str, str]]:
    import importlib

    found = []
    for name in _MODULES:
        src = inspect.getsource(importlib.import_module(f"moekit.ops._triton.{name}"))
        found += [(name, k) for k in sorted(set(re.findall(r"launch\((_\w+)\)\[", src)))]
    return found


@pytest.mark.reference
def test_every_launched_kernel_waits_first():
    """Each kernel launched through ``launch`` declares ``USE_PDL`` and its first statement (after
    the docstring) is ``pdl_prologue(USE_PDL)``: nothing reads or writes global memory before the
    previous grid has finished."""
    import importlib

    kernels = _launched_kernels()
    assert len(kernels) >= 25, kernels
    for mod_name, k in kernels:
        fn = getattr(importlib.import_module(f"moekit.ops._triton.{mod_name}"), k)
        assert "USE_PDL" in fn.arg_names, f"{k} has no USE_PDL parameter"
        tree = ast.parse(inspect.getsource(fn.fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        assert ast.unparse(body[0]) == "pdl_prologue(USE_PDL)", f"{k} starts with {ast.unparse(body[0])!r}"


class _Wrapped:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((grid, a, kw))


@pytest.mark.reference
def test_launcher_passes_use_pdl_always(monkeypatch):
    w = _Wrapped()
    t = torch.zeros(2)
    monkeypatch.setattr(_common, "_pdl_ok", lambda args: True)
    _common._PdlLauncher(w, "_gather_scale_kernel")[(3,)](t, 1, X=2)
    _common._PdlLauncher(w, "_place_kernel")[(3,)](t, 1, X=2)  # listed: late trigger
    with settings.override(pdl_mode=2):
        _common._PdlLauncher(w, "_gather_scale_kernel")[(3,)](t, 1, X=2)
        _common._PdlLauncher(w, "_gg_tiled_kernel")[(3,)](t, 1, X=2)  # skipped by default
    monkeypatch.setattr(_common, "_pdl_ok", lambda args: False)
    _common._PdlLauncher(w, "_gather_scale_kernel")[(3,)](t, 1, X=2)
    assert [c[2] for c in w.calls] == [
        {"X": 2, "USE_PDL": 1, "launch_pdl": True},
        {"X": 2, "USE_PDL": 2, "launch_pdl": True},
        {"X": 2, "USE_PDL": 2, "launch_pdl": True},
        {"X": 2, "USE_PDL": 0},
        {"X": 2, "USE_PDL": 0},
    ]
    assert all(c[0] == (3,) for c in w.calls)


@pytest.mark.reference
def test_pdl_off_where_it_must_be(monkeypatch):
    """Never for CPU or meta tensors (the interpreter, tracing), never when disabled."""
    assert settings.get().pdl
    assert not _common._pdl_ok((torch.zeros(2),))
    assert not _common._pdl_ok((torch.empty(2, device="meta"),))
    assert not _common._pdl_ok((1, 2.0))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not _common._pdl_ok((torch.empty(2),))
    if torch.cuda.is_available():
        x = torch.zeros(2, device="cuda")
        assert not _common._pdl_ok((x,))  # eager launches: no PDL (its host cost outweighs it)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert _common._pdl_ok((x,)) == (torch.cuda.get_device_capability()[0] >= 9)
            with settings.override(pdl=False):
                assert not _common._pdl_ok((x,))


@pytest.mark.reference
def test_pdl_setting_validated():
    with pytest.raises(ValueError, match="MOEKIT_PDL"):
        settings.from_environ({"MOEKIT_PDL": "yes"})
    with pytest.raises(ValueError, match="MOEKIT_PDL_MODE"):
        settings.from_environ({"MOEKIT_PDL_MODE": "3"})
    assert settings.from_environ({"MOEKIT_PDL_MODE": "2"}).pdl_mode == 2
    assert settings.from_environ({"MOEKIT_PDL": "0"}).pdl is False
    assert settings.from_environ({"MOEKIT_PDL_SKIP": "a,b"}).pdl_skip == {"a", "b"}


@pytest.mark.reference
def test_pdl_kernels_compile_for_sm90():
    """One launch of every kernel kind, with ``USE_PDL`` and ``launch_pdl`` on as on an H200."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import activation as A, gather_scatter as G, grouped_gemm as GG
        from moekit.ops._triton import norm as N, quantize as Q, routing as R, shuffling as S
        bf, m, i32 = torch.bfloat16, "meta", torch.int32
        def e(*shape, dtype=bf):
            return torch.empty(*shape, dtype=dtype, device=m)
        A.silu_mul(e(2048, 2048), e(2048, 2048), e(1, dtype=i32))
        A.silu_mul_quant(e(2048, 2048), e(2048, 2048), e(1, dtype=torch.float32), None)
        pps, G._GATHER_STREAM_PROGRAMS_PER_SM = G._GATHER_STREAM_PROGRAMS_PER_SM, 0
        G.gather_scale_dense_tokens(e(4096, 5120), e(4096, dtype=i32), e(4096, dtype=i32), e(4096, 16), None)
        G._GATHER_STREAM_PROGRAMS_PER_SM = pps or 8
        G.gather_scale_dense_tokens(e(4096, 5120), e(4096, dtype=i32), e(4096, dtype=i32), e(4096, 16), None)  # stream
        G.gather_scale_quant_dense_tokens(e(4096, 5120), e(4096, dtype=i32), e(4096, dtype=i32), e(4096, 16))
        G.scatter_add_dense_tokens(e(2048, 5120), e(2048, 5120), e(2048, dtype=i32), None)  # locked
        G.scatter_add_dense_tokens(e(64, 5120), e(64, 5120), e(64, dtype=i32), None)  # atomics
        G.scatter_add_dense_tokens(e(2048, 5120), e(8192, 5120), e(8192, dtype=i32), None)  # buckets
        G.scatter_add_dense_tokens_deterministic(e(128, 5120), e(512, 5120), e(512, dtype=i32), None)  # scan
        G.scatter_add_padded_tokens(e(8, 4096, 5120), e(16, dtype=i32), e(4096, dtype=i32), e(4096, 5120))
        for M in (1, 64, 4096):  # GEMV, streaming, tiled
            GG.grouped_gemm(e(M, 5120), e(16 * 2048, 5120), e(16, dtype=i32))
        N.rms_norm(e(2048, 7168), e(7168), 1e-6)
        Q.quantize_fp8_row(e(2048, 5120))
        R.index_shuffling(e(1, 128), top_k=4)  # one program
        R.index_shuffling(e(16384, 128), top_k=4)  # blocks, place
        R.index_shuffling(e(16384, 128), top_k=4, force="blocks")
        S.combine_shuffling(e(4096, 5120), e(8, 16, dtype=i32), 0, 16, False)
        from moekit.ops._triton import route as RS, gg_swiglu as SW, gg_combine as CB, combine_rows as CR
        for T in (1, 256):  # one program; blocks + placement
            RS.route_and_shuffle(e(T, 128), None, 8, "softmax", True, None, None, 1.0, 0, 128, e(T, 2048))
            RS.shuffle_top_k(e(T, 8, dtype=torch.int64), e(T, 8), 128, 0, 128, e(T, 2048))
        for M in (8, 512, 16384):  # GEMV, streaming, tiled
            SW.grouped_gemm_swiglu(e(64, 2048), e(128 * 1536, 2048), e(128, dtype=i32), e(M, dtype=i32), None, None, None)
        f8 = torch.float8_e4m3fn
        SW.grouped_gemm_swiglu_quant(e(2048, 2048, dtype=f8), e(128 * 1536, 2048, dtype=f8), e(128, dtype=i32),
                                     e(16384, dtype=i32), None, e(2048, dtype=torch.float32), e(128 * 1536, dtype=torch.float32))
        CB.grouped_gemm_combine(e(8, 768), e(128 * 2048, 768), e(8, dtype=i32), e(8, dtype=i32), e(1, 2048), None, None)
        CR.combine_rows(e(64, 2048), e(512, 2048), e(512, dtype=i32))
        from moekit.ops._triton import decode as DC
        DC.moe_decode(e(1, 2048), e(1, 128), None, e(128 * 1536, 2048), e(128 * 2048, 768), None, None, e(1, 2048), 8,
                      "softmax", True, None, None, 1.0, False, False)
        """,
        ["moekit.ops._triton." + n for n in _MODULES],
        pdl=True,
    )
    assert_all_compiled(records, 30)
    launched = {k for _, k in _launched_kernels()}
    compiled = {r["kernel"] for r in records}
    for r in records:  # the driver turns PDL on for every kernel, the skipped ones included
        want = "2" if r["kernel"] in _common.PDL_LATE_TRIGGER else "1"
        assert r["launch_pdl"] and r["constants"]["USE_PDL"] == want, r
    missing = launched - compiled
    assert not missing, f"kernels not compiled with PDL here: {missing}"
