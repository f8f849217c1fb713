"""moekit.settings: tuning knobs pinned with ``override(knobs=...)`` steer the launchers' plans for
the ``with`` block only (issue 17: tests pin choices without monkeypatching module globals)."""

from __future__ import annotations

import pytest
import torch

from moekit import settings

CPU = torch.device("cpu")


@pytest.mark.reference
def test_knob_is_seen_by_plans_and_restored():
    pytest.importorskip("triton")
    from moekit.ops._triton import gather_scatter as gs
    from moekit.ops._triton import quantize as q
    from moekit.ops._triton import route as R

    default_q, default_g = q.quantize_config(40, 4096, 2, CPU), gs._gather_tiles(18, 2880, CPU)
    assert default_q.stages == 1 and default_g[5] == 0  # one row block per program; column blocks
    assert R.kernel_supports(37, 16, 2, None) and R.split_plan(37, 16, 2)[:3] == (1, 1, 37)
    with settings.override(knobs={"PIPE_MIN_BYTES": 0, "SPLIT_MAX_BLOCKS": 36}) as s:
        assert s.knob("PIPE_MIN_BYTES", q.PIPE_MIN_BYTES) == 0
        assert q.quantize_config(40, 4096, 2, CPU).stages > 1  # the persistent kernel
        assert R.split_plan(37, 16, 2)[:3] == (1, 2, 19)  # past 36 blocks of one token: blocks of two
        with settings.override(knobs={"GATHER_WHOLE_ROW_MIN_ROWS_PER_SM": 1, "GATHER_STREAM_PROGRAMS_PER_SM": 1}):
            assert gs._gather_tiles(18, 2880, CPU)[5] == 1  # whole rows, streamed
            assert q.quantize_config(40, 4096, 2, CPU).stages > 1  # the outer pin still holds
        assert gs._gather_tiles(18, 2880, CPU) == default_g
    assert settings.get().knobs == {}
    assert q.quantize_config(40, 4096, 2, CPU) == default_q
    assert R.split_plan(37, 16, 2)[:3] == (1, 1, 37)


@pytest.mark.reference
def test_knob_override_runs_change_listeners():
    """Cached plans that read knobs clear themselves through ``on_change``: pinning and
    unpinning a knob both call the listeners."""
    calls = []
    fn = settings.on_change(lambda: calls.append(settings.get().knob("SCAN_CB", None)))
    try:
        with settings.override(knobs={"SCAN_CB": 16}):
            assert calls == [16]
        assert calls == [16, None]
    finally:
        settings._listeners.remove(fn)


@pytest.mark.reference
def test_pin_knobs_fixture(pin_knobs):
    pin_knobs(SCAN_CB=16)
    pin_knobs(UNROLL_MAX=0)
    assert settings.get().knobs == {"SCAN_CB": 16, "UNROLL_MAX": 0}


@pytest.mark.reference
def test_unknown_knob_is_refused():
    with pytest.raises(TypeError, match="unknown knob"):
        with settings.override(knobs={"SCAN_CBB": 1}):
            pass


@pytest.mark.reference
def test_every_knob_read_in_moekit_is_listed():
    """The names the launchers read with ``knob("NAME", ...)`` are exactly ``settings.KNOBS``."""
    import pathlib
    import re

    root = pathlib.Path(settings.__file__).parent
    read = set()
    for f in root.rglob("*.py"):
        read |= set(re.findall(r'knob\("([A-Z_0-9]+)"', f.read_text()))
    assert read == set(settings.KNOBS)


@pytest.mark.reference
def test_knobs_from_the_environment():
    """``MOEKIT_KNOBS``: ``NAME=value`` pairs (integers or true / false) pin knobs for a whole
    process (device A/B runs); malformed entries name the variable."""
    s = settings.from_environ({"MOEKIT_KNOBS": "FP8_STREAM_SWIGLU=true, SCAN_CB=64,PIPELINE=False"})
    assert s.knobs == {"FP8_STREAM_SWIGLU": True, "SCAN_CB": 64, "PIPELINE": False}
    assert settings.from_environ({"MOEKIT_KNOBS": ""}).knobs == {}
    assert settings.from_environ({}).knobs == {}
    with pytest.raises(ValueError, match="MOEKIT_KNOBS.*NAME one of"):
        settings.from_environ({"MOEKIT_KNOBS": "NOT_A_KNOB=1"})
    with pytest.raises(ValueError, match="MOEKIT_KNOBS.*NAME one of"):
        settings.from_environ({"MOEKIT_KNOBS": "SCAN_CB"})
    with pytest.raises(ValueError, match="MOEKIT_KNOBS: SCAN_CB takes an integer"):
        settings.from_environ({"MOEKIT_KNOBS": "SCAN_CB=1.5"})


@pytest.mark.reference
def test_parse_knobs_is_the_environment_form():
    """``parse_knobs``: the ``MOEKIT_KNOBS`` form as ``override(knobs=...)``'s dict (bench_layer's
    ``--alt-knobs``), with the same refusals."""
    assert settings.parse_knobs("DECODE_FUSED_MIN_TOP_K=4, COMBINE_FEW_4KB=false") == {
        "DECODE_FUSED_MIN_TOP_K": 4, "COMBINE_FEW_4KB": False}  # fmt: skip
    assert settings.parse_knobs("") == {}
    with pytest.raises(ValueError, match="NAME one of"):
        settings.parse_knobs("DECODE_FUSED_MIN_TOP_K")
    with pytest.raises(ValueError, match="COMBINE_FEW_4KB takes an integer or true / false, got 'maybe'"):
        settings.parse_knobs("COMBINE_FEW_4KB=maybe")


@pytest.mark.reference
def test_bench_warmup_from_the_environment():
    """``MOEKIT_BENCH_WARMUP_MS``: the GPU milliseconds ``bench_us`` replays a case before timing it
    (50 unset; 0 still replays once); a malformed or negative value names the variable."""
    assert settings.from_environ({}).bench_warmup_ms == 50
    assert settings.from_environ({"MOEKIT_BENCH_WARMUP_MS": "0"}).bench_warmup_ms == 0
    assert settings.from_environ({"MOEKIT_BENCH_WARMUP_MS": "200"}).bench_warmup_ms == 200
    for bad in ("-1", "fast", "2.5"):
        with pytest.raises(ValueError, match=f"MOEKIT_BENCH_WARMUP_MS must be an integer >= 0, got '{bad}'"):
            settings.from_environ({"MOEKIT_BENCH_WARMUP_MS": bad})
