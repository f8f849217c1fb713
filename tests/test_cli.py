import json
import subprocess
import sys

import pytest

from moekit.cli import build_parser, main

pytestmark = pytest.mark.reference


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("env", "bench", "check"):
        assert cmd in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage" in capsys.readouterr().out


def test_env_reports_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("torch", "triton", "ops_backend", "gpus", "comm backend"):
        assert key in out


def test_bench_default_cpu_config(tmp_path, capsys):
    path = tmp_path / "rows.json"
    assert main(["bench", "--quick", "--tokens", "1,5", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["T"] for r in rows] == [1, 5]
    assert all(r["moekit_us"] > 0 for r in rows)
    assert "| model |" in capsys.readouterr().out


def test_bench_rejects_unknown_model(capsys):
    assert main(["bench", "--model", "nope"]) == 2


def test_check_passes_on_cpu(capsys):
    assert main(["check", "--device", "cpu"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "moekit.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench" in r.stdout


def test_parser_defaults():
    a = build_parser().parse_args(["bench"])
    assert a.dtype == "bf16" and a.model is None
    assert a.hf is None and a.plot is None and a.from_ is None and not a.strict
    # --hf options default to None: hfbench fills them in from the size and the device.
    assert all(getattr(a, k) is None for k in ("layers", "prompt_len", "batch", "new_tokens", "reps", "size",
                                               "vocab", "baseline", "seed"))  # fmt: skip


def test_parser_hf_and_plot_options():
    a = build_parser().parse_args(["bench", "--hf", "qwen3-moe,mixtral", "--layers", "3", "--prompt-len", "128",
                                   "--batch", "2", "--new-tokens", "8", "--size", "tiny", "--strict"])  # fmt: skip
    assert (a.hf, a.layers, a.prompt_len, a.batch, a.new_tokens, a.size, a.strict) == (
        "qwen3-moe,mixtral", 3, 128, 2, 8, "tiny", True)  # fmt: skip
    a = build_parser().parse_args(["bench", "--plot", "o.png", "--from", "a.json", "b.json"])
    assert a.plot == "o.png" and a.from_ == ["a.json", "b.json"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--size", "huge"])


def test_bench_layer_rows_of_several_models(tmp_path, capsys):
    path = tmp_path / "rows.json"
    assert main(["bench", "--model", "tiny,tiny", "--quick", "--tokens", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["model"], r["T"]) for r in rows] == [("tiny", 1), ("tiny", 1)]


def test_hf_options_need_hf(capsys):
    assert main(["bench", "--model", "tiny", "--layers", "3"]) == 2
    assert "--layers only apply to --hf runs" in capsys.readouterr().out
    assert main(["bench", "--hf", "mixtral", "--tokens", "1,2"]) == 2
    assert "--tokens: layer benchmark options, not for --hf" in capsys.readouterr().out
    assert main(["bench", "--hf", "mixtral", "--dtype", "fp8"]) == 2


def test_bench_torch_baseline_matches_reference():
    """The plain-PyTorch pipeline that moekit bench compares against computes the same layer."""
    import torch

    from moekit import reference as ref
    from moekit.layer_bench import routing_config, torch_pipeline
    from moekit.testing import MODEL_SHAPES, assert_close, random_expert_weights

    s = MODEL_SHAPES["tiny"]
    w = random_expert_weights(s, dtype=torch.float32, seed=3)
    # Seeded: bf16 router logits against float32 ones can flip a near-tie choice (an unseeded draw
    # once did, rel error 9.6e-2, depending on what earlier tests left in the global generator).
    x = torch.randn(11, s.D, generator=torch.Generator().manual_seed(11))
    got = torch_pipeline(x.bfloat16(), {k: v.bfloat16() for k, v in w.items()}, routing_config(s))
    want = ref.moe_forward(
        x.bfloat16().float(),
        w["router_DE"].bfloat16().float(),
        w["w13_e2FD"].bfloat16().float(),
        w["w2_eDF"].bfloat16().float(),
        top_k=s.top_k,
        score_func=s.score_func,
        renormalize=s.renormalize,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
        shared_w13_2FD=w["shared_w13_2FD"].bfloat16().float(),
        shared_w2_DF=w["shared_w2_DF"].bfloat16().float(),
    )
    assert_close(got.float(), want, tol=3e-2)


def test_check_covers_every_public_op():
    """``moekit check`` said it checked every op and checked four (issue 16): one check per name
    in ``moekit.ops.__all__``. triton_quantize_fp8_row is quantize_fp8_row's kernel under MSLK's
    signature, with its own ``align_rows_to`` padding: checked too, so no name is left out."""
    from moekit import _check, ops

    names = [name for name, _ in _check.CHECKS]
    assert len(names) == len(set(names)), "an op checked twice"
    assert set(names) == set(ops.__all__)


def test_check_prints_one_ok_line_per_op_fast(capsys):
    import re
    import time

    from moekit import ops

    t0 = time.perf_counter()
    assert main(["check", "--device", "cpu"]) == 0
    assert time.perf_counter() - t0 < 20
    out = capsys.readouterr().out
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) +(OK|FAIL) ", out, re.M)}
    assert set(lines) == set(ops.__all__), out
    assert set(lines.values()) == {"OK"}, out
    assert re.search(r"^  grouped_gemm +OK +rel err \d\.\de[+-]\d\d ", out, re.M), out


def test_check_fails_loudly(monkeypatch, capsys):
    """A failing op: its FAIL line, the others still run, and a non-zero exit."""
    from moekit import _check

    def wrong(device):
        raise AssertionError("relative error 1.0e+00 > tolerance 1.0e-05")

    checks = [(n, wrong if n == "rms_norm" else fn) for n, fn in _check.CHECKS]
    monkeypatch.setattr(_check, "CHECKS", checks)
    assert main(["check", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "rms_norm" in out and "FAIL  AssertionError: relative error 1.0e+00" in out
    assert out.count(" OK ") == len(checks) - 1
    assert "1 check(s) failed: rms_norm" in out
