"""`flashv41 run`: one sequence through a model, prefill then decode steps, with a short report.

The work is done by a *runner*, anything with `new_sequence()` whose sequences have
`prefill(token_ids) -> [T, hc, dim]`, `decode(token_id) -> [1, hc, dim]` and `release()`: the NumPy
oracle (`host.oracle.Oracle`) or the GPU engine (`flashv41.engine.Engine`), so `make_runner` is the
one place that chooses. Without a model file the built-in tiny synthetic model is used, written once
into the cache directory (`$FLASHV41_CACHE`, else `$XDG_CACHE_HOME/flashv41`, else
`~/.cache/flashv41`) and rewritten when it is missing or unreadable.

What `flashv41 run` prints: the results and the stage table on stdout; on stderr, before any long
work, where the kernels run (the GPU's name, or the CUDA simulator), then the engine's set-up and
the progress of the prefill chunks, the decode steps and the check (host.progress: a bar on a
terminal, a line now and then elsewhere).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flashv41.host.errors import CapacityError, FlashError, InputError, UnsupportedError, plural
from flashv41.host.model import Model
from flashv41.host.progress import Progress
from flashv41.host.tokens import check_tokens
from flashv41.host.vocab import NO_TOKENIZER, has_vocab
from flashv41.memory import DEFAULT_MAX_TOKENS, TABLE_PLACES, format_bytes
from flashv41.model import load_model
from flashv41.text import Text

CACHE_ENV = "FLASHV41_CACHE"
BUILTIN_NAME = "tiny.gguf"
BUILTIN_MOE_NAME = "tiny-moe.gguf"  # the built-in tiny model with its FFN and head tensors (`run --generate`)
FFN_CHOICES = ("zero", "host-moe")  # `run --ffn`: the zero FFN output, or flashv41.HostMoE through host_ffn


class RunnerSequence(Protocol):
    def prefill(self, token_ids: Any) -> np.ndarray: ...

    def decode(self, token_id: int) -> np.ndarray: ...

    def release(self) -> None: ...


class Runner(Protocol):
    def new_sequence(self) -> RunnerSequence: ...


def cache_dir() -> Path:
    """Where the built-in model is kept: $FLASHV41_CACHE, $XDG_CACHE_HOME/flashv41, ~/.cache/flashv41."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "flashv41"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def builtin_model(cache: Path | None = None, log: Callable[[str], None] = _stderr, moe: bool = False) -> Path:
    """The built-in tiny model's path, writing it first (atomically) if it is missing or unreadable.
    moe: the same model with its MoE and head tensors (tiny-moe.gguf: the same attention and engram
    tensors, byte for byte), which `run --generate` takes."""
    from flashv41.host.synth import progress_bar, write_synthetic

    folder = cache if cache is not None else cache_dir()
    name = BUILTIN_MOE_NAME if moe else BUILTIN_NAME
    path = folder / name
    if path.is_file():
        try:
            load_model(path).close()
            return path
        except FlashError as exc:
            log(f"rewriting the built-in model: {path} is unreadable ({exc})")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{name}.{os.getpid()}.tmp"
    what = "the built-in tiny model" + (" with its MoE and head" if moe else "")
    try:
        with progress_bar(f"writing {what}") as progress:
            write_synthetic(tmp, "tiny", progress=progress, moe=moe)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote {what} to {path}")
    return path


def backend_description() -> str:
    """Where the engine's kernels run, in words: the GPU's name, or 'CUDA simulator (CPU), no GPU found'."""
    from flashv41.stages.backend import backend_name, using_simulator

    return backend_name() + (", no GPU found" if using_simulator() else "")


def host_moe(model: Model, ffn: str) -> Any:
    """`run --ffn`'s FFN as a host function: flashv41.HostMoE of the model for "host-moe", None for
    "zero" (InputError for another name, or a model without MoE tensors)."""
    if ffn not in FFN_CHOICES:
        raise InputError(f"--ffn {ffn!r}: one of {', '.join(FFN_CHOICES)}")
    if ffn == "zero":
        return None
    if model.config.moe is None:
        raise InputError(f"--ffn host-moe: {model.path.name} has no MoE tensors (write a model with them: "
                         "flashv41 synth --moe)")
    from flashv41.host.moe import HostMoE

    return HostMoE(model)


def make_runner(model: Model, oracle: bool, max_seq: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                table_residency: str = "device", ffn: str = "zero") -> Runner:
    """The NumPy oracle, or the engine (on the GPU, or on the CUDA simulator without one) with
    per-stage timing on and its engram tables in `table_residency`; ffn: FFN_CHOICES (host-moe:
    the oracle's FFN, and the engine's through flashv41.host_ffn)."""
    moe = host_moe(model, ffn)
    if oracle:
        from flashv41.host.oracle import Oracle

        return Oracle(model, max_seq=max_seq, ffn=moe)
    from flashv41.engine import Engine
    from flashv41.ffn import host_ffn

    return Engine(model, max_seq=max_seq, max_tokens=min(max_tokens, max_seq), profile=True,
                  table_residency=table_residency, progress=lambda line: _stderr(f"engine: {line}"),
                  ffn=None if moe is None else host_ffn(moe))


def table_line(runner: Runner) -> str | None:
    """Where an engine's engram tables live and what they hold there (None for the oracle or a
    model without engram)."""
    engram = getattr(runner, "engram", None)
    if engram is None:
        return None
    tables = sum(w.table.rows * w.table.row_bytes for w in engram.layers.values())
    return (f"engram tables: {format_bytes(tables)} {TABLE_PLACES[engram.table_residency]}; the engram stage holds "
            f"{format_bytes(engram.device_bytes)} of device memory")


def stage_table(seconds: dict[str, float]) -> list[str]:
    """The engine's per-stage wall times (each stage between two device synchronisations)."""
    total = sum(seconds.values())
    lines = [f"  {'stage':<42} {'seconds':>9} {'share':>6}"]
    for name, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<42} {sec:9.4f} {100 * sec / max(total, 1e-12):5.1f}%")
    lines.append(f"  {'total':<42} {total:9.4f}")
    return lines


def check_against_oracle(model: Model, engine: Any, prompt: np.ndarray, decoded: np.ndarray, ffn: str = "zero",
                         generated: np.ndarray | None = None) -> tuple[list[str], bool]:
    """Every layer of every call against the oracle from identical starting points
    (flashv41.check): the prompt (its last max_tokens tokens in one call), then each decode step;
    and the whole run against an oracle sequence run from position 0 on its own (flashv41.check.Chain:
    the prompt's earlier chunks too). ffn: the oracle's FFN (FFN_CHOICES), the engine's. generated:
    the engine's greedy tokens (`decoded` being all but the last): then the head too, every call's
    (flashv41.check.head_agreement), and the oracle's greedy token after each call, which must be
    the engine's. Returns the report lines and whether everything agreed."""
    from flashv41.check import COSINE, MAX_FLIP_SHARE, REL_RMS, Chain, Flips, compare_call
    from flashv41.host.oracle import Oracle

    oracle = Oracle(model, max_seq=engine.max_seq, ffn=host_moe(model, ffn))
    heads = HeadCheck(model) if generated is not None else None
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    n = model.config.n_layers
    chain = Chain(oracle.new_sequence(), n)
    worst_cos, worst_err, flips, ok = [1.0] * n, [0.0] * n, [0] * n, True
    failures: list[str] = []
    run = Flips()
    start = max(0, prompt.size - engine.max_tokens)
    calls = [prompt[start:]] + [np.array([t]) for t in decoded]
    try:
        for s in range(0, start, engine.max_tokens):  # the chunks before the compared call: chained only
            chain.step(seq, prompt[s:min(start, s + engine.max_tokens)])
        if start:
            ref.prefill(prompt[:start])
        with Progress("check against the oracle", len(calls), "call", "calls") as progress:
            for k, ids in enumerate(calls):
                _, call = compare_call(seq, ref, ids, chain=chain)
                if heads is not None:
                    heads.compare(seq, ref)
                progress.update()
                for a in call.layers:
                    worst_cos[a.layer] = min(worst_cos[a.layer], a.cosine)
                    worst_err[a.layer] = max(worst_err[a.layer], a.max_error)
                    flips[a.layer] += a.flips.total
                run.add(call.flips)
                if not call.ok:
                    ok = False
                    failures.append(f"  call {k} ({'prefill' if k == 0 else 'decode'}): {call.describe()}")
    finally:
        seq.release()
    if not run.rare:
        ok = False
        failures.append(f"  flips over the run are not rare: {run.describe()}")
    chained = chain.agreement()
    if not chained.ok:
        ok = False
        failures.append("  the whole run left the oracle beyond its bound (the chained line above)")
    lines = [f"check against the oracle ({len(calls)} calls, each from the engine's state, per-layer inputs and "
             f"choices; cosine >= {COSINE} and rel rms <= {REL_RMS}, flips <= {MAX_FLIP_SHARE:.0%} a kind):"]
    for role, cos, err, flip in zip(model.config.roles, worst_cos, worst_err, flips, strict=True):
        lines.append(f"  layer {role.layer:>3} {role.block_type:<28} max |err| {err:.3e}  cosine {cos:.8f}"
                     + (f"  ({flip} flipped values adopted from the engine)" if flip else ""))
    lines.append(f"  flips (the engine's choices the oracle went on with): {run.describe()}")
    lines.append(f"  {chained.describe()}")
    if heads is not None:
        assert generated is not None
        head_lines, head_ok = heads.report(generated)
        lines += head_lines
        ok = ok and head_ok
    lines += failures
    lines.append("check: " + ("every layer agrees" if ok else "DISAGREEMENT beyond the bounds"))
    return lines, ok


class HeadCheck:
    """The head of each checked call: the engine's inputs and logits against the oracle's (its head
    run from the engine's last layer: flashv41.check.oracle_head), and the oracle's greedy token."""

    def __init__(self, model: Model) -> None:
        from flashv41.host import gguf_layout as L

        self.output = model.tensor(None, L.OUTPUT)
        self.agreements: list[Any] = []
        self.tokens: list[int] = []

    def compare(self, seq: Any, ref: Any) -> None:
        from flashv41.check import engine_head_input, head_agreement, oracle_head

        x_o, want = oracle_head(seq, ref)
        self.agreements.append(head_agreement(engine_head_input(seq), x_o, seq.logits(all_positions=True), want,
                                              self.output))
        self.tokens.append(int(np.argmax(want[-1])))

    def report(self, generated: np.ndarray) -> tuple[list[str], bool]:
        worst = max(self.agreements, key=lambda a: a.worst)
        ok = all(a.ok for a in self.agreements) and self.tokens == [int(t) for t in generated]
        same = "equal" if self.tokens == [int(t) for t in generated] else "DIFFERENT"
        return [f"  the head, every call (the worst): {worst.describe()}; "
                + ("ok" if all(a.ok for a in self.agreements) else "BEYOND THE BOUND"),
                f"  greedy tokens, the oracle's after each call from the engine's state: {_ids(np.array(self.tokens))}"
                f" ({same} to the engine's)"], ok


INT64_MAX = int(np.iinfo(np.int64).max)


def parse_tokens(text: str) -> np.ndarray:
    """'1,2,3' -> int64 ids (spaces around an id are fine); InputError naming the first item that is
    empty, not an integer, or too large for int64. Whether an id is in the vocabulary is the
    model's to say (host.tokens.check_tokens)."""
    ids = []
    for k, part in enumerate(text.split(","), start=1):
        item = part.strip()
        if not item:
            raise InputError(f"item {k} of {text!r} is empty (ids are comma-separated integers, e.g. 1,2,3)")
        try:
            value = int(item)
        except ValueError:
            raise InputError(f"item {k} of {text!r}, {item!r}, is not an integer (ids are comma-separated "
                             "integers)") from None
        if abs(value) > INT64_MAX:
            raise InputError(f"item {k} of {text!r}, {item}, is too large for a token id")
        ids.append(value)
    return np.array(ids, np.int64)


def open_model(path: Path | None) -> Model:
    """The model at `path`, or the built-in tiny model (written first if need be) when it is None."""
    return load_model(path if path is not None else builtin_model())


def random_tokens(vocab: int, count: int, seed: int, stream: int) -> np.ndarray:
    """`count` ids in [0, vocab), from the seed; stream 0 = the prompt, 1 = the decode steps."""
    return np.random.default_rng([seed, stream]).integers(0, vocab, size=count, dtype=np.int64)


@dataclass
class RunResult:
    prompt: np.ndarray
    decoded: np.ndarray
    highway: np.ndarray  # [prompt + decode, hc, dim] fp32: every position's final highway
    prefill_s: float
    decode_s: float
    prefill_calls: int = 1
    generated: np.ndarray | None = None  # `run --generate`: the greedy tokens (decoded: all but the last)


def prefill_chunk(runner: Runner, prompt: np.ndarray) -> int:
    """Tokens per prefill call: the engine's max_tokens (it would chunk the prompt so itself), or
    the whole prompt for a runner without one (the oracle)."""
    return int(getattr(runner, "max_tokens", prompt.size))


class LayerProgress:
    """An engine observer (flashv41.plan.StepObserver) that moves `progress` on by one as each layer
    of a call finishes, so a long prefill chunk shows its progress inside the chunk."""

    def __init__(self, plan: Any, progress: Progress) -> None:
        self.last_steps = {id(layer.last) for layer in plan.layers}
        self.progress = progress

    def before(self, step: Any, call: Any) -> None:
        pass

    def after(self, step: Any, call: Any) -> None:
        if id(step) in self.last_steps:
            self.progress.update()


@contextmanager
def prefill_progress(runner: Any, tokens: int, chunks: int = 1) -> Iterator[Callable[[], None]]:
    """The progress of a prefill of `tokens` tokens in `chunks` calls, on stderr (host.progress):
    layer by layer for an engine, each chunk passing every layer (a LayerProgress among its
    observers while the block runs), so a long chunk does not sit at 0%; call by call for a runner
    that cannot be watched inside a call (the oracle). Yields what to call after each call."""
    desc = f"prefill of {plural(tokens, 'token')}"
    plan = getattr(runner, "plan", None)
    observers = getattr(runner, "observers", None)
    if plan is None or observers is None:
        with Progress(desc, chunks, "chunk", "chunks") as progress:
            yield progress.update
        return
    desc += f" in {chunks} chunks" if chunks > 1 else ""
    with Progress(desc, chunks * len(plan.layers), "layer", "layers") as progress:
        watcher = LayerProgress(plan, progress)
        observers.append(watcher)
        try:
            yield lambda: None
        finally:
            observers.remove(watcher)


def prefill_in_chunks(runner: Runner, seq: Any, prompt: np.ndarray) -> tuple[list[np.ndarray], float, int]:
    """Prefill `prompt` into seq in chunks of `prefill_chunk` tokens, the engine's progress shown
    layer by layer inside each chunk: (the chunks' outputs, seconds, chunks)."""
    chunk = prefill_chunk(runner, prompt)
    n_chunks = -(-prompt.size // chunk)
    outs = []
    start = time.perf_counter()
    with prefill_progress(runner, prompt.size, n_chunks) as chunk_done:
        for s in range(0, prompt.size, chunk):
            outs.append(np.asarray(seq.prefill(prompt[s:s + chunk])))
            chunk_done()
    return outs, time.perf_counter() - start, n_chunks


def run_sequence(runner: Runner, prompt: np.ndarray, decoded: np.ndarray) -> RunResult:
    """Prefill `prompt` in chunks of `prefill_chunk` tokens, then decode `decoded` one token at a
    time, the progress of each shown on stderr (host.progress): the engine's prefill layer by
    layer, inside each chunk, as an observer of its calls."""
    seq = runner.new_sequence()
    try:
        outs, prefill_s, n_chunks = prefill_in_chunks(runner, seq, prompt)
        start = time.perf_counter()
        if decoded.size:
            with Progress("decode", decoded.size, "step", "steps") as progress:
                for token in decoded:
                    outs.append(np.asarray(seq.decode(int(token))))
                    progress.update()
        decode_s = time.perf_counter() - start
    finally:
        seq.release()
    return RunResult(prompt, decoded, np.concatenate(outs, axis=0), prefill_s, decode_s, n_chunks)


def generate_sequence(runner: Runner, prompt: np.ndarray, n: int) -> RunResult:
    """Prefill `prompt` as run_sequence does, then n greedy tokens (flashv41.sample at temperature
    0 of the last position's logits), each but the last decoded in turn."""
    from flashv41.sampling import sample

    seq: Any = runner.new_sequence()
    tokens = np.zeros(n, np.int64)
    try:
        outs, prefill_s, n_chunks = prefill_in_chunks(runner, seq, prompt)
        start = time.perf_counter()
        with Progress("generate", n, "token", "tokens") as progress:
            for k in range(n):
                tokens[k] = sample(seq.logits())
                if k + 1 < n:
                    outs.append(np.asarray(seq.decode(int(tokens[k]))))
                progress.update()
        decode_s = time.perf_counter() - start
    finally:
        seq.release()
    return RunResult(prompt, tokens[:-1], np.concatenate(outs, axis=0), prefill_s, decode_s, n_chunks, tokens)


def highway_stats(h: np.ndarray) -> str:
    """mean, std, min, max, sum (float64) and the sha256 of the float32 bytes (first 16 hex digits)."""
    a = np.ascontiguousarray(h, np.float32)
    x = a.astype(np.float64)
    digest = hashlib.sha256(a.tobytes()).hexdigest()[:16]
    return (f"mean {x.mean():.6g}, std {x.std():.6g}, min {x.min():.6g}, max {x.max():.6g}, "
            f"sum {x.sum():.9g}, sha256 {digest}")


def _ids(ids: np.ndarray, shown: int = 12) -> str:
    values = [str(int(v)) for v in ids]
    if len(values) > shown:
        values = values[: shown - 2] + ["...", *values[-2:]]
    return "[" + ", ".join(values) + "]"


def _per_second(count: int, seconds: float) -> str:
    """A rate with the digits it needs: 0.777, 12.3, 195."""
    rate = count / max(seconds, 1e-9)
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"


def _rate(count: int, seconds: float, unit: str) -> str:
    if count == 0:
        return "none"
    per = seconds / count * 1e3
    return f"{count} {unit}{'s' if count != 1 else ''} in {seconds:.3f} s ({per:.2f} ms each)"


def report(model: Model, runner_name: str, result: RunResult, seed: int, text: Text | None = None) -> list[str]:
    """The summary lines `flashv41 run` prints; text: the file's tokenizer, which spells out the
    generated tokens (as a Python string literal, so that the line stays one line)."""
    cfg = model.config
    roles = ", ".join(f"{r.layer} {r.block_type}{'+engram' if r.engram else ''}" for r in cfg.roles)
    h = result.highway
    calls = "one call" if result.prefill_calls == 1 else f"{result.prefill_calls} calls"
    generated = [] if result.generated is None else [
        f"generated: {plural(result.generated.size, 'token')} (greedy) {_ids(result.generated, 32)}"]
    if result.generated is not None and text is not None:
        generated.append(f"generated text: {text.decode(result.generated)!r}")
    return generated + [
        f"model: {model.path} ({cfg.describe()})",
        f"roles: {roles}",
        f"runner: {runner_name}",
        f"tokens: prompt {result.prompt.size} {_ids(result.prompt)}, decode {result.decoded.size} "
        f"{_ids(result.decoded)} (seed {seed})",
        f"prefill: {plural(result.prompt.size, 'token')} in {calls}, {result.prefill_s:.3f} s "
        f"({_per_second(result.prompt.size, result.prefill_s)} tokens/s)",
        f"decode: {_rate(result.decoded.size, result.decode_s, 'step')}",
        f"final highway [{', '.join(str(n) for n in h.shape)}] fp32: {highway_stats(h)}",
        f"last position: {highway_stats(h[-1])}",
    ]


def generated_text(model: Model) -> Text | None:
    """The tokenizer that spells out `run --generate`'s tokens: the file's, when it has one and the
    tokenizers package is installed (without it the ids alone are printed, as for a file without one)."""
    if not has_vocab(model.weights.readers[0]) or importlib.util.find_spec("tokenizers") is None:
        return None
    return Text.from_model(model)


def run_model(model_path: Path | None, oracle: bool, tokens: np.ndarray | None, prompt_len: int, n_decode: int,
              seed: int, out: Callable[[str], None] = print, check: bool = False,
              table_residency: str = "device", max_seq: int | None = None, generate: int | None = None,
              ffn: str = "zero", prompt_text: str | None = None) -> int:
    """The whole `flashv41 run`; returns the exit status. Everything is checked before any work
    starts, so a bad argument costs no time and prints nothing but its error. `max_seq`: the
    positions the sequence may hold (default: the prompt and the decode steps, exactly).
    generate: N greedy tokens after the prompt instead of n_decode random ones (N - 1 decode steps;
    without a model, the built-in tiny model with its MoE and head), spelled out too when the file has
    a tokenizer. ffn: FFN_CHOICES. prompt_text: the prompt as text, encoded with the file's tokenizer
    (flashv41.Text; instead of tokens)."""
    if tokens is not None and prompt_text is not None:
        raise InputError("a prompt is either token ids (--tokens) or text (--prompt), not both")
    if prompt_len < 1 or n_decode < 0 or seed < 0 or (generate is not None and generate < 1):
        raise InputError(f"--prompt-len must be >= 1, --decode >= 0, --generate >= 1 and --seed >= 0, got "
                         f"{prompt_len}, {n_decode}, {generate} and {seed}")
    if check and oracle:
        raise InputError("--check compares the engine with the oracle; it cannot be combined with --oracle")
    if ffn not in FFN_CHOICES:
        raise InputError(f"--ffn {ffn!r}: one of {', '.join(FFN_CHOICES)}")
    if generate is not None:
        n_decode = generate - 1
    model = load_model(model_path) if model_path is not None else load_model(builtin_model(moe=generate is not None))
    try:
        cfg = model.config
        if generate is not None and not cfg.head:
            raise InputError(f"--generate: {model.path.name} has no head (output_norm, output) to give logits "
                             "(write a model with one: flashv41 synth --moe)")
        text = None
        if prompt_text is not None:
            if not has_vocab(model.weights.readers[0]):
                raise UnsupportedError(f"--prompt: {model.path.name}: {NO_TOKENIZER}; give the prompt's ids with "
                                       "--tokens")
            text = Text.from_model(model)
            tokens = text.encode(prompt_text)
            if tokens.size == 0:
                raise InputError("--prompt is empty: it encodes to no tokens")
        if generate is not None and text is None:
            text = generated_text(model)
        n_prompt = tokens.size if tokens is not None else prompt_len
        needed = f"{plural(n_prompt, 'prompt token')} and {plural(n_decode, 'decode step')}"
        if n_prompt + n_decode > cfg.context_length:
            raise CapacityError(f"{needed} exceed the model's context length {cfg.context_length}")
        if max_seq is not None and max_seq > cfg.context_length:
            raise CapacityError(f"--max-seq {max_seq} exceeds the model's context length {cfg.context_length}")
        if max_seq is not None and max_seq < n_prompt + n_decode:
            raise CapacityError(f"--max-seq {max_seq} is too small for {needed} ({n_prompt + n_decode} positions)")
        if tokens is not None:
            prompt, _ = check_tokens(tokens, None, cfg.vocab_size)
        else:
            prompt = random_tokens(cfg.vocab_size, prompt_len, seed, 0)
        decoded = random_tokens(cfg.vocab_size, n_decode, seed, 1)
        name = "NumPy oracle" if oracle else f"engine on {backend_description()}"
        _stderr(f"runner: {name}")
        positions = max_seq if max_seq is not None else prompt.size + n_decode
        runner = make_runner(model, oracle, positions, table_residency=table_residency, ffn=ffn)
        status = 0
        try:
            if generate is not None:
                result = generate_sequence(runner, prompt, generate)
            else:
                result = run_sequence(runner, prompt, decoded)
            for line in report(model, name, result, seed, text):
                out(line)
            tables = table_line(runner)
            if tables is not None:
                out(tables)
            seconds = getattr(runner, "stage_seconds", None)
            if seconds:
                out("stage times (prefill and decode together):")
                for line in stage_table(seconds):
                    out(line)
            if check:
                lines, ok = check_against_oracle(model, runner, prompt, result.decoded, ffn, result.generated)
                for line in lines:
                    out(line)
                status = 0 if ok else 1
        finally:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
    finally:
        model.close()
    return status
