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


def test_bench_torch_baseline_matches_reference():
    """The plain-PyTorch pipeline that moekit bench compares against computes the same layer."""
    import torch

    from moekit import reference as ref
    from moekit._bench import routing_config, torch_pipeline
    from moekit.testing import MODEL_SHAPES, assert_close, random_expert_weights

    s = MODEL_SHAPES["tiny"]
    w = random_expert_weights(s, dtype=torch.float32, seed=3)
    x = torch.randn(11, s.D)
    got = torch_pipeline(x.bfloat16(), {k: v.bfloat16() for k, v in w.items()}, routing_config(s))
    want = ref.moe_forward(
        x.bfloat16().float(), w["router_DE"].bfloat16().float(), w["w13_e2FD"].bfloat16().float(),
        w["w2_eDF"].bfloat16().float(), top_k=s.top_k, score_func=s.score_func, renormalize=s.renormalize,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
        shared_w13_2FD=w["shared_w13_2FD"].bfloat16().float(), shared_w2_DF=w["shared_w2_DF"].bfloat16().float(),
    )
    assert_close(got.float(), want, tol=3e-2)
