"""`flashv41 run`: the built-in tiny model in a cache directory, the oracle run and its report, the
engine run with its stage table and its check against the oracle, and errors as one line."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from flashv41 import load_model
from flashv41.cli import main
from flashv41.host.oracle import Oracle
from flashv41.runner import BUILTIN_NAME, CACHE_ENV, cache_dir, random_tokens
from flashv41.stages.backend import using_simulator


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def stat_line(out: str, prefix: str) -> dict[str, str]:
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return dict(re.findall(r"(mean|std|min|max|sum|sha256) (\S+?)(?:,|$)", line))


def expected_highway(path: Path, prompt: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    model = load_model(path)
    try:
        seq = Oracle(model).new_sequence()
        outs = [seq.prefill(prompt)] + [seq.decode(int(t)) for t in decoded]
        return np.concatenate(outs)
    finally:
        model.close()


def test_run_oracle_builtin(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", "--prompt-len", "12", "--decode", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    model_path = cache / BUILTIN_NAME
    assert model_path.is_file() and f"wrote the built-in tiny model to {model_path}" in captured.err
    assert list(cache.iterdir()) == [model_path]  # no temporary file left behind
    for words in (f"model: {model_path}", "runner: NumPy oracle", "prompt 12", "decode 3", "(seed 0)",
                  "prefill: 12 tokens", "decode: 3 steps", "final highway [15, 4, 32] fp32", "last position"):
        assert words in out, words
    roles = next(x for x in out.splitlines() if x.startswith("roles:"))
    for role in ("swa+engram", "kv_index_source_r2+engram", "consumer_r2", "candidate_source_r1", "consumer_r1",
                 "candidate_index_source_r1"):
        assert role in roles, role
    assert len(out.splitlines()) <= 10

    # the numbers are the oracle's on the prompt and decode tokens the seed gives
    model = load_model(model_path)
    vocab = model.config.vocab_size
    model.close()
    prompt, decoded = random_tokens(vocab, 12, 0, 0), random_tokens(vocab, 3, 0, 1)
    h = expected_highway(model_path, prompt, decoded)
    stats = stat_line(out, "final highway")
    assert stats["sha256"] == hashlib.sha256(h.astype(np.float32).tobytes()).hexdigest()[:16]
    assert float(stats["mean"]) == pytest.approx(h.astype(np.float64).mean(), rel=1e-5, abs=1e-6)
    assert float(stats["max"]) == pytest.approx(float(h.max()), rel=1e-5)
    last = stat_line(out, "last position")
    assert last["sha256"] == hashlib.sha256(h[-1].astype(np.float32).tobytes()).hexdigest()[:16]

    # a second run reuses the cached model and gives the same numbers
    mtime = model_path.stat().st_mtime_ns
    assert main(["run", "--oracle", "--prompt-len", "12", "--decode", "3"]) == 0
    again = capsys.readouterr()
    assert model_path.stat().st_mtime_ns == mtime and "wrote" not in again.err
    assert stat_line(again.out, "final highway") == stats


def test_run_tokens_seed_and_model_file(tiny_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", str(tiny_path), "--tokens", "5, 6,7", "--decode", "2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert not cache.exists()  # a model was given: nothing cached
    assert "prompt 3 [5, 6, 7]" in out and "(seed 3)" in out
    model = load_model(tiny_path)
    decoded = random_tokens(model.config.vocab_size, 2, 3, 1)
    model.close()
    assert f"decode 2 [{decoded[0]}, {decoded[1]}]" in out
    h = expected_highway(tiny_path, np.array([5, 6, 7]), decoded)
    assert stat_line(out, "final highway")["sha256"] == hashlib.sha256(h.tobytes()).hexdigest()[:16]
    # no decode steps
    assert main(["run", "--oracle", str(tiny_path), "--tokens", "1", "--decode", "0"]) == 0
    assert "decode: none" in capsys.readouterr().out


def test_run_rewrites_a_missing_or_broken_cache(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache.mkdir()
    (cache / BUILTIN_NAME).write_bytes(b"GGUF but not really")
    assert main(["run", "--oracle", "--prompt-len", "2", "--decode", "1"]) == 0
    err = capsys.readouterr().err
    assert "unreadable" in err and "wrote the built-in tiny model" in err
    (cache / BUILTIN_NAME).unlink()
    assert main(["run", "--oracle", "--prompt-len", "2", "--decode", "1"]) == 0
    assert (cache / BUILTIN_NAME).is_file()
    capsys.readouterr()


def test_run_engine_with_check(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The main job: the engine (here on the simulator, and it says so), its stage table, and the
    per-layer agreement with the oracle; the final highway equals the oracle's within the check."""
    assert main(["run", "--prompt-len", "5", "--decode", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "runner: engine on " in out
    if using_simulator():
        assert "CUDA simulator" in out and "no GPU found" in out
    for words in ("stage times", "attention (kv_index_source_r2)", "engram rows, projection, gate", "hc mixes",
                  "check against the oracle (3 calls"):
        assert words in out, words
    layers = [x for x in out.splitlines() if x.strip().startswith("layer ")]
    assert len(layers) == 6 and all("cosine" in x for x in layers), layers
    assert "check: every layer agrees" in out


def test_run_check_refuses_oracle(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", "--check", "--prompt-len", "2"]) == 2
    assert "--check" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "words"), [
    (["--tokens", "1,2,128"], "outside the vocabulary"),
    (["--tokens", "1,x"], "comma-separated integers"),
    (["--tokens", ","], "empty"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--decode", "-1"], "--decode"),
    (["--prompt-len", "250", "--decode", "10"], "context length 256"),
])
def test_run_errors_are_one_line(args: list[str], words: str, cache: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flashv41: error: ") and words in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_run_usage_errors(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", "--tokens", "1", "--prompt-len", "3"]) == 2  # mutually exclusive
    assert main(["run", "--oracle", str(tmp_path / "absent.gguf")]) == 2
    assert "absent.gguf" in capsys.readouterr().err


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "flashv41"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "flashv41"
