"""``moekit bench --hf`` and the CPU default job (``moekit.hfbench``), and ``--plot``
(``moekit.benchplot``): tiny random transformers models on the CPU, synthetic rows."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.integrations.moe")

from moekit import benchplot, hfbench  # noqa: E402
from moekit.cli import main  # noqa: E402

pytestmark = pytest.mark.reference

CPU = torch.device("cpu")
TINY = dict(size="tiny", layers=1, vocab=128, batch=2, prompt_len=8, new_tokens=4, reps=1, device=CPU,
            dtype=torch.float32, seed=0)  # fmt: skip


def test_arch_names_and_aliases():
    assert hfbench.resolve_arch("Qwen3_MoE") == "qwen3-moe"
    assert hfbench.resolve_arch("deepseek_v3") == "deepseek-v3"
    assert hfbench.parse_archs("mixtral, llama4,mixtral") == ["mixtral", "llama4"]
    assert hfbench.parse_archs("all") == list(hfbench.ARCHS)
    assert set(hfbench.ARCHS) == {"qwen3-moe", "mixtral", "deepseek-v3", "gpt-oss", "llama4"}
    with pytest.raises(ValueError, match="unknown architecture 'olmoe'.*qwen3-moe, mixtral, deepseek-v3, gpt-oss"):
        hfbench.resolve_arch("olmoe")


def test_unknown_arch_is_a_clear_cli_error(capsys):
    assert main(["bench", "--hf", "nope"]) == 2
    out = capsys.readouterr().out
    assert "unknown architecture 'nope'" in out
    for name in hfbench.ARCHS:
        assert name in out


@pytest.mark.parametrize("arch", list(hfbench.ARCHS))
def test_full_size_configs(arch):
    """The full-size configs carry the released models' expert shapes; every layer is an MoE layer."""
    cfg = hfbench.build_config(arch, size="full", layers=2, vocab=1000)
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == 1000
    want = {"qwen3-moe": (2048, 128, 8), "mixtral": (4096, 8, 2), "deepseek-v3": (7168, 256, 8),
            "gpt-oss": (2880, 128, 4), "llama4": (5120, 16, 1)}[arch]  # fmt: skip
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts
    assert (cfg.hidden_size, E, cfg.num_experts_per_tok) == want
    if arch == "deepseek-v3":
        assert cfg.first_k_dense_replace == 0


def test_tiny_model_generates_same_tokens_as_eager():
    """The CPU job: moekit against transformers' eager experts, float32, tokens identical."""
    row = hfbench.run_arch("qwen3-moe", baseline="eager", **TINY)
    assert row["baseline"] == "eager" and row["tokens"] == "identical", row
    assert row["prompt_err"] < 1e-5 and row["decode_err"] < 1e-5 and row["argmax_agree"] == 1.0
    assert row["prefill_tok_s_moekit"] > 0 and row["decode_ms_moekit"] > 0 and row["decode_speedup"] > 0
    assert (row["D"], row["E"], row["top_k"]) == (128, 16, 8)
    assert hfbench.failures(row) == []


def test_llama4_default_baseline_is_its_own_forward():
    row = hfbench.run_arch("llama4", baseline="default", **TINY)
    assert row["baseline"] == "eager (model's own)" and row["tokens"] == "identical"
    assert hfbench.failures(row) == []


def test_the_check_fails_on_wrong_experts(monkeypatch):
    """A moekit experts forward off by a few percent fails the logits check (not a rounding)."""
    from moekit.integrations import transformers as mt

    real = mt.moekit_experts_forward

    def wrong(self, hidden_states, top_k_index, top_k_weights):
        return real(self, hidden_states, top_k_index, top_k_weights) * 0.9

    monkeypatch.setattr(mt, "moekit_experts_forward", wrong)  # enable() registers this one
    try:
        row = hfbench.run_arch("mixtral", baseline="eager", **TINY)
    finally:
        monkeypatch.undo()
        mt.register()
    bad = hfbench.failures(row)
    assert any("prompt's logits" in b for b in bad) and any("decode steps' logits" in b for b in bad), row


def test_compare_and_failures_rules():
    V = 16
    g = torch.Generator().manual_seed(0)
    steps = torch.randn(5, 2, V, generator=g)  # [N, B, V]
    toks = steps.argmax(-1).T.contiguous()  # [B, N]
    same = hfbench.compare(toks, steps, toks.clone(), steps.clone())
    assert same["tokens"] == "identical" and same["decode_err"] == 0 and same["argmax_agree"] == 1
    other = toks.clone()
    other[1, 3:] = (other[1, 3:] + 1) % V
    forced = steps.clone()
    forced[3, 1] = steps[3, 1] + 0.001 * torch.randn(V, generator=g)
    c = hfbench.compare(toks, steps, other, forced)
    assert c["tokens"] == "same 3/5" and c["same_steps"] == 3 and c["decode_err"] < 1e-3
    row = {"arch": "x", "dtype": "bfloat16", "new_tokens": 5, "tol": 3e-2, "prompt_err": 1e-2, **c}
    assert hfbench.failures(row) == []  # bf16: a drift after a near-tie is reported, not failed ...
    assert "greedy tokens differ" in hfbench.failures(row, strict=True)[0]  # ... unless --strict
    assert "greedy tokens differ" in hfbench.failures({**row, "dtype": "float32"})[0]  # fp32: always
    assert "prompt's logits" in hfbench.failures({**row, "prompt_err": 0.2})[0]


def test_hf_command_end_to_end(tmp_path, capsys):
    path = tmp_path / "hf.json"
    argv = ["bench", "--hf", "gpt-oss", "--layers", "1", "--prompt-len", "6", "--new-tokens", "3", "--reps", "1",
            "--vocab", "64", "--no-progress", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| gpt-oss | tiny | D=128 F=64 E=16 k=4 L=1 | grouped_mm |" in out and "identical" in out
    data = json.loads(path.read_text())
    (row,) = data["rows"]
    assert row["arch"] == "gpt-oss" and row["size"] == "tiny" and row["new_tokens"] == 3
    assert data["meta"]["transformers"]


def test_a_failing_architecture_keeps_the_others(tmp_path, monkeypatch, capsys):
    real = hfbench.build_model

    def build(arch, **kw):
        if arch == "mixtral":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(arch, **kw)

    monkeypatch.setattr(hfbench, "build_model", build)
    path = tmp_path / "hf.json"
    argv = ["bench", "--hf", "mixtral,llama4", "--layers", "1", "--prompt-len", "6", "--new-tokens", "3", "--reps",
            "1", "--vocab", "64", "--no-progress", "--json", str(path)]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL mixtral: RuntimeError: CUDA out of memory (simulated)" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["arch"] for r in rows] == ["mixtral", "llama4"] and rows[1]["tokens"] == "identical"


def test_option_validation(capsys):
    assert main(["bench", "--hf", "mixtral", "--new-tokens", "1"]) == 2
    assert "--new-tokens must be >= 2" in capsys.readouterr().out
    assert main(["bench", "--hf", "mixtral", "--layers", "0"]) == 2
    assert "--layers must be >= 1" in capsys.readouterr().out


def test_cpu_default_job_dispatch(monkeypatch, capsys):
    """``moekit bench`` without CUDA and without layer options runs the tiny HF job against eager
    experts and says that kernel timings need a GPU (no floor)."""
    seen = {}

    def fake_main(args, archs=None):
        seen.update(archs=archs, baseline=args.baseline)
        return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hfbench, "main", fake_main)
    assert main(["bench"]) == 0
    assert seen == {"archs": list(hfbench.CPU_DEFAULT_ARCHS), "baseline": "eager"}
    out = capsys.readouterr().out
    assert "GPU kernel timings need a CUDA GPU" in out and "floor 0.0" not in out


# ----------------------------------------------------------------------------------------------
# --plot
# ----------------------------------------------------------------------------------------------


def _layer_rows():
    rows = []
    for model in ("qwen3-30b-a3b", "llama4-scout"):
        for T in (1, 16, 256, 4096):
            floor = 10.0 + 0.05 * T
            rows.append({"model": model, "T": T, "dtype": "bfloat16", "floor_us": floor, "moekit_us": 1.3 * floor,
                         "torch_us": 3 * floor if T <= 256 else None, "vllm_us": 1.5 * floor,
                         "mslk_us": "refused"})  # fmt: skip
    return rows


def test_plot_groups_rows_per_model():
    panels = benchplot.group(_layer_rows() + [{"model": "m", "T": 1}])  # a row without times is left out
    assert list(panels) == ["qwen3-30b-a3b, bfloat16", "llama4-scout, bfloat16"]
    assert [r["T"] for r in panels["llama4-scout, bfloat16"]] == [1, 16, 256, 4096]


def test_plot_from_json(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional `plot` extra: pip install 'moekit[plot]'")
    src = tmp_path / "rows.json"
    src.write_text(json.dumps({"meta": {}, "rows": _layer_rows()}))
    out = tmp_path / "layer.png"
    assert main(["bench", "--plot", str(out), "--from", str(src)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_errors(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"arch": "qwen3-moe"}]}))  # --hf rows: no floor
    assert main(["bench", "--plot", str(tmp_path / "x.png"), "--from", str(bad)]) == 2
    assert "no layer benchmark rows" in capsys.readouterr().out
    assert main(["bench", "--from", str(bad)]) == 2
    assert "add --plot" in capsys.readouterr().out
    assert main(["bench", "--hf", "mixtral", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--hf has no floor" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--from ROWS.json" in capsys.readouterr().out


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(_layer_rows()))
    assert main(["bench", "--plot", str(tmp_path / "x.png"), "--from", str(src)]) == 2
    assert "pip install 'moekit[plot]'" in capsys.readouterr().out
