"""`flashv41 run`: the built-in tiny model in a cache directory, the oracle run and its report, the
engine run with its stage table, its check against the oracle and its progress on stderr, errors as
one line (each bad argument, exit 2, before any work) and Ctrl-C as one line (exit 130)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import flashv41
from flashv41 import load_model, runner
from flashv41.cli import main
from flashv41.host.oracle import Oracle
from flashv41.host.progress import Progress
from flashv41.runner import BUILTIN_NAME, CACHE_ENV, RunResult, cache_dir, random_tokens, report, run_sequence
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


@pytest.mark.slow
def test_run_engine_with_check(cache: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job: the engine (here on the simulator, and it says so), its stage table, and the
    per-layer agreement with the oracle; the final highway equals the oracle's within the check.
    The prefill's progress moves layer by layer, inside its one chunk."""
    finished: list[tuple[str, float, float]] = []
    close = Progress.close

    def closing(self: Progress) -> None:
        finished.append((self.desc, self.done, self.total))
        close(self)

    monkeypatch.setattr(Progress, "close", closing)
    assert main(["run", "--prompt-len", "5", "--decode", "2", "--check"]) == 0
    assert ("prefill of 5 tokens", 6, 6) in finished, finished
    captured = capsys.readouterr()
    out = captured.out
    assert "runner: engine on " in out
    if using_simulator():
        assert "runner: engine on CUDA simulator (CPU), no GPU found\n" in out
    # stderr: where the kernels run first (the built-in model's writing aside), then each long piece
    # of work named as it starts (stderr is not a terminal here, and this run is too short for more)
    err = [line for line in captured.err.splitlines() if not line.startswith(("writing the built-in", "wrote "))]
    assert err[0] == out.splitlines()[2], err
    for words in ("prefill of 5 tokens: 6 layers", "decode: 2 steps", "check against the oracle: 3 calls"):
        assert words in err, words
    for words in ("stage times", "attention (kv_index_source_r2)", "engram rows, projection, gate", "hc mixes",
                  "check against the oracle (3 calls"):
        assert words in out, words
    layers = [x for x in out.splitlines() if x.strip().startswith("layer ")]
    assert len(layers) == 6 and all("cosine" in x for x in layers), layers
    assert "check: every layer agrees" in out


@pytest.mark.slow
@pytest.mark.parametrize("residency", ["pinned", "host"])
def test_run_table_residency(residency: str, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`run --table-residency`: the engine with its tables in pinned host memory or read from the
    file still agrees with the oracle layer by layer, and says where the tables are and what the
    engram stage holds on the device."""
    assert main(["run", "--prompt-len", "3", "--decode", "1", "--check", "--table-residency", residency]) == 0
    out = capsys.readouterr().out
    where = {"pinned": "in pinned host memory", "host": "read from the file per call"}[residency]
    line = next(x for x in out.splitlines() if x.startswith("engram tables: "))
    assert where in line and "of device memory" in line, line
    assert "check: every layer agrees" in out


def test_run_max_seq(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-seq sizes the sequence beyond what the run needs; the results do not change."""
    assert main(["run", "--oracle", str(tiny_path), "--prompt-len", "3", "--decode", "1"]) == 0
    exact = stat_line(capsys.readouterr().out, "final highway")
    assert main(["run", "--oracle", str(tiny_path), "--prompt-len", "3", "--decode", "1", "--max-seq", "256"]) == 0
    assert stat_line(capsys.readouterr().out, "final highway") == exact


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


@pytest.mark.parametrize(("args", "line"), [
    (["--tokens", "99999999999999999999999"],
     "flashv41: error: argument --tokens: item 1 of '99999999999999999999999', 99999999999999999999999, is "
     "too large for a token id"),
    (["--tokens", "1,,2"],
     "flashv41: error: argument --tokens: item 2 of '1,,2' is empty (ids are comma-separated integers, "
     "e.g. 1,2,3)"),
    (["--tokens", "1,2,"],
     "flashv41: error: argument --tokens: item 3 of '1,2,' is empty (ids are comma-separated integers, "
     "e.g. 1,2,3)"),
    (["--prompt-len", "99999999999999999999999"],
     "flashv41: error: 99999999999999999999999 prompt tokens and 4 decode steps exceed the model's context "
     "length 256"),
    (["--decode", "99999999999999999999999"],
     "flashv41: error: 8 prompt tokens and 99999999999999999999999 decode steps exceed the model's context "
     "length 256"),
    (["--prompt-len", "x"], "flashv41: error: argument --prompt-len: takes an integer, got 'x'"),
    (["--seed", "-1"], "flashv41: error: argument --seed: must be at least 0, got -1"),
    (["--decode", "-1"], "flashv41: error: argument --decode: must be at least 0, got -1"),
    (["--prompt-len", "0"], "flashv41: error: argument --prompt-len: must be at least 1, got 0"),
    (["--tokens", "1,2,128"], "flashv41: error: token id 128 at index 2 is outside the vocabulary [0, 128)"),
    (["--tokens", "1", "--decode", "1", "--max-seq", "1"],
     "flashv41: error: --max-seq 1 is too small for 1 prompt token and 1 decode step (2 positions)"),
    (["--max-seq", "257"], "flashv41: error: --max-seq 257 exceeds the model's context length 256"),
    (["--max-seq", "0"], "flashv41: error: argument --max-seq: must be at least 1, got 0"),
])
@pytest.mark.parametrize("oracle", [True, False])
def test_run_bad_argument_is_its_only_line(args: list[str], line: str, oracle: bool, tiny_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any work (for the engine too: nothing is set up), so the error is all there is."""
    assert main(["run", str(tiny_path), *(["--oracle"] if oracle else []), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""


def test_run_interrupted(tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the run: the runner and the model are closed, and one line says so (exit 130)."""
    closed = []
    monkeypatch.setattr(flashv41.Model, "close", lambda self: closed.append(self.path))

    def interrupt(*args: object) -> RunResult:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_sequence", interrupt)
    assert main(["run", "--oracle", str(tiny_path)]) == 130
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["runner: NumPy oracle", "flashv41: interrupted"] and captured.out == ""
    assert closed == [tiny_path]


class ChunkedRunner:
    """A stand-in engine of max_tokens 2 that records the calls it is given."""

    max_tokens = 2

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def new_sequence(self) -> ChunkedRunner:
        return self

    def prefill(self, token_ids: np.ndarray) -> np.ndarray:
        self.calls.append([int(t) for t in token_ids])
        return np.zeros((len(token_ids), 1, 1), np.float32)

    def decode(self, token_id: int) -> np.ndarray:
        self.calls.append([token_id])
        return np.zeros((1, 1, 1), np.float32)

    def release(self) -> None:
        pass


def test_prefill_in_the_engines_chunks(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The prompt goes in max_tokens at a time (the progress counts those calls), as the engine
    would have split it, and the report says how many calls it took."""
    fake = ChunkedRunner()
    result = run_sequence(fake, np.arange(5), np.array([7]))
    assert fake.calls == [[0, 1], [2, 3], [4], [7]] and result.prefill_calls == 3
    assert result.highway.shape == (6, 1, 1)
    err = capsys.readouterr().err.splitlines()
    assert err == ["prefill of 5 tokens: 3 chunks", "decode: 1 step"]
    model = load_model(tiny_path)
    try:
        lines = report(model, "test", result, 0)
    finally:
        model.close()
    assert any(line.startswith("prefill: 5 tokens in 3 calls, ") for line in lines), lines


class WatchedRunner(ChunkedRunner):
    """A stand-in engine with a plan of three layers of two steps (the second each layer's `last`),
    whose calls run them before its observers as the engine's do."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = [(object(), object()) for _ in range(3)]
        self.plan = SimpleNamespace(layers=[SimpleNamespace(last=steps[-1]) for steps in self.steps])
        self.observers: list = []

    def prefill(self, token_ids: np.ndarray) -> np.ndarray:
        for steps in self.steps:
            for step in steps:
                for observer in self.observers:
                    observer.before(step, None)
                    observer.after(step, None)
        return super().prefill(token_ids)


def test_prefill_progress_moves_layer_by_layer(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's prefill shows its progress in layers, each chunk passing every layer, so a long
    chunk does not sit at 0%; the watcher leaves with the prefill (decode steps run unwatched)."""
    seen: list[float] = []
    update = Progress.update

    def updating(self: Progress, amount: float = 1.0) -> None:
        update(self, amount)
        seen.append(self.done)

    monkeypatch.setattr(Progress, "update", updating)
    fake = WatchedRunner()
    run_sequence(fake, np.arange(5), np.array([7]))
    assert capsys.readouterr().err.splitlines() == ["prefill of 5 tokens in 3 chunks: 9 layers", "decode: 1 step"]
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8, 9, 1] and fake.observers == []


def test_report_rates(tiny_path: Path) -> None:
    """A prefill slower than a token a second keeps its digits: no '(1 tokens/s)'."""
    model = load_model(tiny_path)
    try:
        slow = RunResult(np.arange(8), np.arange(0), np.zeros((8, 4, 32), np.float32), 10.3, 0.0)
        fast = RunResult(np.arange(8), np.arange(0), np.zeros((8, 4, 32), np.float32), 0.0125, 0.0)
        slow_line, fast_line = (next(x for x in report(model, "test", r, 0) if x.startswith("prefill:"))
                                for r in (slow, fast))
    finally:
        model.close()
    assert slow_line == "prefill: 8 tokens in one call, 10.300 s (0.777 tokens/s)"
    assert fast_line == "prefill: 8 tokens in one call, 0.013 s (640 tokens/s)"


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
