"""The examples run as written: each one's `main` on the tiny model with small arguments, its output
checked (where the kernels run, said first; every layer's line, the agreement table and its verdict
or exit 1, the decode timings and the stage table; the progress on stderr). Shapes are the
simulator's: about 25 s together."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from flashv41 import check
from flashv41.stages.backend import using_simulator

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BLOCK_TYPES = ("swa+engram", "kv_index_source_r2+engram", "consumer_r2", "candidate_source_r1", "consumer_r1",
               "candidate_index_source_r1")


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(synth_model) -> str:
    return str(synth_model("tiny"))


# the progress reporter's line every LOG_EVERY_S off a terminal ("<task>: 1/2 calls [00:12<00:06, ...]"),
# which a slow machine adds to a long call's stderr
PROGRESS_LINE = re.compile(r"^(?P<task>.+): [\d.]+/[\d.]+ \w+ \[")


def opening_lines(err: str) -> list[str]:
    """stderr's lines but the progress reporter's periodic ones, each of which must be about a task
    whose opening line came before it."""
    openings: list[str] = []
    for line in err.splitlines():
        periodic = PROGRESS_LINE.match(line)
        if periodic is None:
            openings.append(line)
        else:
            task = periodic["task"]
            assert any(o.startswith(f"{task}: ") for o in openings), f"progress line before its task's: {line}"
    return openings


def kernels_first(out: str) -> None:
    """The first line says where the kernels run, before the model is even opened."""
    first = out.splitlines()[0]
    assert first.startswith("kernels on: "), first
    if using_simulator():
        assert first == "kernels on: CUDA simulator (CPU), no GPU found"


def layer_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"\s+\d+\s{2}\S", line)]


@pytest.mark.slow
def test_inspect_layers(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example("inspect_layers").main(["--model", tiny, "--prompt-len", "4", "--query", "-1"]) == 0
    out = capsys.readouterr().out
    kernels_first(out)
    assert "compressed positions selected by query 3" in out
    rows = layer_rows(out)
    assert [row.split()[1] for row in rows] == list(BLOCK_TYPES)
    for row in rows:
        h_rms, attn_rms = (float(v) for v in row.split()[2:4])
        assert 0 < h_rms < 100 and 0 < attn_rms < 100, row
    gates = [row.split()[4] for row in rows]
    assert all(0 < float(g) < 1 for g in gates[:2]) and gates[2:] == ["-"] * 4  # a sigmoid, engram layers only
    assert rows[0].endswith("- (window only)")
    # the last query of four (positions 0..3) sees ratio-2 groups 0..1 and ratio-1 groups 0..3 (top-4)
    assert rows[1].endswith("[0, 1]") and rows[3].endswith("[0, 1, 2, 3]")
    assert "final highway [4, 4, 32]" in out


@pytest.mark.slow
def test_compare_oracle(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example("compare_oracle").main(["--model", tiny, "--prompt-len", "4", "--steps", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    kernels_first(out)
    assert opening_lines(captured.err) == ["engine and oracle: 2 calls"]
    rows = [line for line in out.splitlines() if line.startswith(("prefill 4", "decode at 4"))]
    assert len(rows) == 2 * len(BLOCK_TYPES)
    for row in rows:
        cosine = float(row.split()[-5])
        assert cosine > 0.999 and row.endswith("ok"), row
    assert out.splitlines()[-1] == "every layer agrees (6 layers x 2 calls)"


@pytest.mark.slow
def test_compare_oracle_exits_1_on_disagreement(tiny: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "COSINE", 2.0)  # no cosine reaches it: every layer fails
    assert load_example("compare_oracle").main(["--model", tiny, "--prompt-len", "2", "--steps", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and out.splitlines()[-1].startswith("DISAGREEMENT: ")


@pytest.mark.slow
def test_decode_loop(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example("decode_loop").main(["--model", tiny, "--prompt-len", "4", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    kernels_first(out)
    assert opening_lines(captured.err) == ["prefill of 4 tokens: 6 layers", "decode: 2 steps"]
    assert re.search(r"prefill: 4 tokens in [\d.]+ ms", out)
    assert re.search(r"decode: first step [\d.]+ ms at position 4", out)
    assert re.search(r"decode: 1 step, [\d.]+ ms per step .* [\d.]+ tokens/s with stage timing on", out)
    stages = out[out.index("stage times per decode step"):]
    for name in ("embedding", "engram rows, projection, gate", "hc mixes", "attention (swa)", "total"):
        assert f"  {name} " in stages, name
    assert "final highway [1, 4, 32] at position 5" in out
    assert out.splitlines()[-1] == "released the sequence (released=True) and closed the engine (closed=True)"


@pytest.mark.slow
def test_speculative(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Drafts verified in one call each, the rejected tails truncated away: the same tokens as plain
    greedy decoding, and the same state, bit for bit (exit 0 says both)."""
    module = load_example("speculative")
    assert module.main(["--model", tiny, "--prompt-len", "6", "--tokens", "4", "--draft", "3"]) == 0
    out = capsys.readouterr().out
    kernels_first(out)
    match = re.search(r"speculative: 4 tokens in (\d+) verify calls .*, (\d+) of (\d+) drafted tokens accepted", out)
    assert match is not None, out
    calls, accepted, drafted = (int(g) for g in match.groups())
    assert 1 <= calls <= 4 and drafted == 3 * calls and accepted == 4 - calls
    assert "plain decoding: 4 tokens in 4 decode steps" in out and "same tokens: yes" in out
    assert out.splitlines()[-1].startswith("kept state equals plain decoding: bit for bit (positions 0..9")


def test_lookup_draft() -> None:
    """The draft: what followed the latest earlier occurrence of the last two tokens, else the last
    one, padded with its last token; the last token repeated when neither occurs."""
    draft = load_example("speculative").lookup_draft
    assert draft([1, 2, 3, 1, 2], 2) == [3, 1]
    assert draft([1, 2, 3, 9, 2], 3) == [3, 9, 2]
    assert draft([5, 6, 5], 3) == [6, 5, 5]
    assert draft([4, 7], 2) == [7, 7]


@pytest.mark.parametrize("name", ["decode_loop", "compare_oracle", "inspect_layers", "speculative", "generate"])
def test_a_missing_model_is_one_line(name: str, tmp_path: Path) -> None:
    """Run as a script, an example answers a missing model as the flashv41 command does: its name
    and the error on one line (exit 2), no traceback."""
    absent = tmp_path / "absent.gguf"
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--model", str(absent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"{name}.py: error: {absent}: no such file"], done.stderr
    kernels_first(done.stdout)


def test_generate(synth_model, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/generate.py: greedy tokens through the API with HostMoE as the FFN callback, the same
    as flashv41.generate on the oracle."""
    import flashv41
    from flashv41.host.moe import HostMoE
    from flashv41.host.oracle import Oracle
    from flashv41.runner import random_tokens

    path = synth_model("tiny", moe=True)
    assert load_example("generate").main(["--model", str(path), "-n", "3", "--prompt-len", "5"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("generated (host FFN, greedy):"))
    with flashv41.load_model(path) as model:
        want = flashv41.generate(Oracle(model, ffn=HostMoE(model)).new_sequence(),
                                 random_tokens(model.config.vocab_size, 5, 0, 0), 3)
    assert line.endswith(str(want.tolist()))
    assert "the last step's top logits:" in out


def test_generate_device_moe_math(synth_model) -> None:
    """The device callbacks' MoE (examples/generate.py moe_math, fp32 where the reference rounds to
    bf16), run with NumPy as its array library: HostMoE's to bf16 precision."""
    import flashv41
    from flashv41.host.moe import HostMoE
    from flashv41.host.numerics import bf16

    example = load_example("generate")
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        moe = HostMoE(model)
        x = bf16(np.random.default_rng(4).standard_normal((7, 32)).astype(np.float32))
        for layer in (0, 3):
            w = example.dense_weights(moe, layer)
            got = example.moe_math(np, moe.cfg, w, x, np.minimum, lambda a, i: np.take_along_axis(a, i, -1))
            want = moe(layer, x)
            assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
