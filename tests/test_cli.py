"""The command line: synth then info from Python, `python -m flashv41`, and errors as one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashv41
from flashv41.cli import main
from flashv41.host.synth import preset

ROOT = Path(__file__).resolve().parents[1]


def test_synth_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.gguf"
    assert main(["synth", "--preset", "tiny", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert path.is_file() and f"wrote {path}" in out and "Q8_0" in out and "Q2_K" in out

    assert main(["info", str(path), "--max-seq", "256", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    model = flashv41.load_model(path)
    for role in model.config.roles:  # every layer's role, by block type
        assert f"  {role.layer}  " in out and role.block_type in out
    for name in ("n_layers", "norm_eps", "compress_rope_theta", "beta_slow", "candidate_topk_blocks",
                 "table rows", "engram_embd", "attn_q_a", "Q2_K", "max_seq 256, max_tokens 16", "total"):
        assert name in out, name
    model.close()


def test_synth_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.gguf"
    args = ["synth", "--preset", "tiny", "-o", str(path), "--weight-type", "BF16", "--table-type", "Q8_0",
            "--seed", "3", "--engram-rows", "300"]
    assert main(args) == 0
    model = flashv41.load_model(path)
    try:
        assert model.tensor(1, "attn_q_a").ggml_type.name == "BF16"
        assert model.tensor(1, "engram_embd").ggml_type.name == "Q8_0"
        assert model.config.engram is not None and all(rows >= 300 for rows in model.config.engram.table_rows)
        assert model.config.n_layers == preset("tiny").n_layers
    finally:
        model.close()
    assert "seed 3" in capsys.readouterr().out


def test_info_with_host_tables(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tiny_path), "--table-residency", "host"]) == 0
    out = capsys.readouterr().out
    assert "engram tables on the host" in out and "(host)" in out


def test_module_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flashv41", "--help"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "synth" in done.stdout and "info" in done.stdout


def test_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("not a model\n")
    assert main(["info", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashv41: error: ") and "notes.gguf" in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_missing_file_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "absent.gguf")]) == 2
    assert "absent.gguf" in capsys.readouterr().err
    assert main(["synth", "--preset", "tiny"]) == 2  # -o is required: argparse's usage error
    assert main(["--help"]) == 0
