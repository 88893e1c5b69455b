"""Tokens out of `flashv41 run --generate` and `flashv41 synth --moe`: greedy tokens with the host MoE,
checked against the oracle; the built-in tiny MoE model; the memory the head takes; and the errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import flashv41
from flashv41.cli import main
from flashv41.host.moe import HostMoE
from flashv41.host.oracle import Oracle
from flashv41.memory import estimate_memory
from flashv41.runner import BUILTIN_MOE_NAME, CACHE_ENV, random_tokens
from flashv41.sampling import generate


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def generated(out: str) -> list[int]:
    line = next(x for x in out.splitlines() if x.startswith("generated:"))
    return [int(v) for v in re.search(r"\[(.*)\]", line).group(1).split(", ")]  # type: ignore[union-attr]


def test_run_generate_with_the_oracle(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a model, --generate takes the built-in tiny model with its MoE and head; the oracle's
    greedy tokens are flashv41.generate's on an oracle with HostMoE."""
    assert main(["run", "--oracle", "--generate", "4", "--ffn", "host-moe", "--prompt-len", "6", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert (cache / BUILTIN_MOE_NAME).is_file()
    tokens = generated(out)
    assert len(tokens) == 4 and "generated: 4 tokens (greedy)" in out
    with flashv41.load_model(cache / BUILTIN_MOE_NAME) as model:
        prompt = random_tokens(model.config.vocab_size, 6, 2, 0)
        want = generate(Oracle(model, ffn=HostMoE(model)).new_sequence(), prompt, 4)
    assert tokens == want.tolist()
    assert re.search(r"final highway \[9, 4, 32\]", out)  # the prompt and the 3 decoded tokens


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["llama.cpp", "ds4"])
def test_run_generate_checked(synth_model, layout: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine's greedy tokens with the host MoE equal the oracle's from each call's state, the
    head agreeing within its bound, every layer within the check's."""
    path = synth_model("tiny", moe=True, layout=layout)
    assert main(["run", str(path), "--generate", "4", "--ffn", "host-moe", "--check", "--prompt-len", "9"]) == 0
    out = capsys.readouterr().out
    assert "(equal to the engine's)" in out and "check: every layer agrees" in out
    head = next(x for x in out.splitlines() if "the head, every call" in x)
    assert head.endswith("ok")
    oracle_line = next(x for x in out.splitlines() if "greedy tokens, the oracle's" in x)
    assert re.search(r"\[(.*)\]", oracle_line).group(1) == ", ".join(map(str, generated(out)))  # type: ignore


@pytest.mark.parametrize("args, words", [
    (["--ffn", "host-moe"], "has no MoE tensors"),
    (["--generate", "2"], "has no head (output_norm, output)"),
    (["--generate", "0"], "--generate: must be at least 1"),
    (["--generate", "2", "--decode", "3"], "not allowed with argument"),
    (["--ffn", "moe"], "invalid choice: 'moe'"),
])
def test_run_generate_errors(tiny_path: Path, args: list[str], words: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", str(tiny_path), *args]) == 2
    err = capsys.readouterr().err
    assert words in err, err


def test_synth_moe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    assert main(["synth", "-o", str(out), "--moe", "--experts", "6", "--experts-used", "3", "--layout", "mxxm-t"]) == 0
    assert "MoE of 6 experts (top-3) and the head" in capsys.readouterr().out
    with flashv41.load_model(out) as model:
        assert model.config.moe is not None and (model.config.moe.n_experts, model.config.moe.n_active) == (6, 3)
    assert main(["synth", "-o", str(out), "--experts", "3"]) == 2
    assert "give --moe too" in capsys.readouterr().err
    assert main(["synth", "-o", str(out), "--moe", "--experts", "2", "--experts-used", "3"]) == 2
    assert "exceeds the 2 experts" in capsys.readouterr().err


def test_the_head_in_the_memory_estimate(synth_model, tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The head's weights count on the device, its input (bf16 [max_tokens, dim]) per sequence, its
    logits workspace per engine; the MoE tensors as host bytes; sequence_bytes agrees."""
    moe_path = synth_model("tiny", moe=True)
    with flashv41.load_model(moe_path) as moe, flashv41.load_model(tiny_path) as plain:
        with_head = estimate_memory(moe.config, moe.weights, 64, 16)
        without = estimate_memory(plain.config, plain.weights, 64, 16)
        assert with_head.head_input_bytes == 16 * 32 * 2
        assert with_head.state_bytes_per_sequence - without.state_bytes_per_sequence == 16 * 32 * 2
        head = sum(moe.tensor(None, r).nbytes for r in ("output", "output_norm"))
        norms = 6 * 32 * 4
        assert with_head.weight_bytes - without.weight_bytes == head + norms
        assert any(what.startswith("logits fp32 [16, 128]") for what, _ in with_head.workspaces)
        assert with_head.moe_host_bytes > 0 and without.moe_host_bytes == 0
        engine = flashv41.Engine(moe, max_seq=64, max_tokens=16)
        assert engine.sequence_bytes() == with_head.state_bytes_per_sequence
    assert main(["info", str(moe_path)]) == 0
    out = capsys.readouterr().out
    assert "head (output_norm, output)" in out and "MoE tensors (host, the file)" in out
    assert re.search(r"ffn:\s+ffn_norm \(an FFN callback can run\); MoE: 4 experts, top-2", out)
    assert "  h\n" in out  # the MoE tensors, read on the host only


def test_generate_matches_step_by_step(synth_model) -> None:
    """flashv41.generate is prefill, then argmax and decode in turn."""
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        oracle = Oracle(model, ffn=HostMoE(model))
        prompt = np.array([3, 1, 4, 1, 5])
        tokens = generate(oracle.new_sequence(), prompt, 3)
        seq = oracle.new_sequence()
        seq.prefill(prompt)
        want = []
        for _ in range(3):
            want.append(int(np.argmax(seq.logits())))
            seq.decode(want[-1])
        assert tokens.tolist() == want
