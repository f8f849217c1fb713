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
