"""Benchmark rows of the whole stack's prefill (docs/performance.md P5L, issue 16) at V4.1-Flash dimensions.

One prompt of N random tokens prefilled from position 0 through an Engine, timed once, with the
device time split between the products, the indexer, the sparse attention and the rest:
- `prefill.stack.4k.40`, `prefill.stack.32k.40`: the flash40 preset, V4.1-Flash's real 40-layer
  schedule with two engram layers (the model file `stack.decode.40` writes, shared with it);
- `prefill.stack.32k`, `prefill.stack.128k`, `prefill.stack.1m`: the flash preset's six layers
  (every block type) with two engram layers, written once with a context of 1,048,576 (CONTEXT_6:
  V4.1's context; the length only sizes the engine, RoPE's scaling reads the original context).
The names follow `stack.decode` / `stack.decode.40`: the length, then `.40` for the 40-layer
schedule. P5L's must-reach (>= 8,000 tokens/s) and goal (>= 50,000) are for `prefill.stack.32k`.
Each row also has one `<row>.part.<part>` row per part of the split (below), its seconds summed
over the prefill (no bound).

These cases take minutes (a 32k prefill took 33.3 s on six layers and several minutes on 40 when
issue 16 was opened), so a plain `flashv41 bench` leaves them out (BenchCase.default): a --rows
pattern must name them, `--rows 'prefill.stack*'` all five. They run in Q8_0 whatever
--weight-type says, as the stack rows do, and time one run each, not the median of --reps.

How a row runs (`measure`): an Engine with max_tokens = CHUNK (512 tokens a chunk, as issue 16
measured) and max_seq = N, after checking flashv41.memory's estimate of it against the device's
free memory (a CapacityError naming both otherwise: at 128k on six layers the estimate is a few
GB, far under the H200's 141). A warm-up sequence prefills WARMUP_CHUNKS chunks and is released:
it compiles every kernel the timed run launches, so no compile time is timed (kernels are
specialised by shape parameters that do not change with the position), and its parts' names are
checked against CATEGORIES before the long run starts. Then a new sequence takes the N tokens one
chunk a Sequence.prefill call (the engine's own chunking), each returning only its last token's
highway (output="last", as a server asks: the N x hc x dim fp32 of every token, 10.7 GB at 128k,
stay on the device; until 2026-12-07 every call downloaded its chunk's, 0.82 s of 4.3 at 32k on an
H100). The headline is the wall clock of those calls: tokens/s = N / wall seconds, hash, uploads
and the downloads included. The timed prefill's progress goes to stderr (chunks done, the rate,
the time left: a bar on a terminal, a line every PROGRESS_EVERY_S seconds in a log), so a long row
that a time limit cuts short still shows how far it got.

The split comes from CUDA events, never a synchronisation (profile=True synchronises around every
step and slows the prefill down): `PartEvents` watches the engine's stage calls (Engine.observers)
and the stages' marks (stages.trace). It records an event on the engine's stream before and after
every step of a call (each `run(step, ...)` of flashv41.engine, host steps too) and at every mark a
stage makes inside a step; the events are read once the run is over. A part's time runs from the previous event
inside the same step (the step's start for the first mark) to its mark; what comes after a step's
last mark is the step's own, under the step's name; the time between steps (Python between them,
`_copy_inputs`) is nobody's, so the wall clock exceeds the events' sum by it. The host steps
(the token ids' upload, the engram hash, the rows' uploads, the highway's download) find the
device idle, so their events measure their wall time and they count in `rest`. Where Python
issues a part's launches more slowly than the GPU runs them, the part's time includes the wait:
the split is of the time the stream spent, not of busy SMs. Every part maps to one of four
categories in CATEGORIES:

- gemm: every product: wq_a + wkv, wq_b, wo_a, wo_b, the compressor's (compress products), the
  index keys' (wk), the indexer's (index products), the engram wkv, the hc mixes' (hc mixes
  product);
- indexer: the queries' RoPE and quantiser (index_queries), index_scores, select (the top-k and
  the candidate blocks);
- sparse_attention: sparse_attention;
- rest: the norm chains, the compressor's pooling (compress), publish, the ring write, the engram
  rows and gate, the hc mixes, pre, norm and posts, the embedding, the hash, the uploads and the
  highway's download.

The bound is the row's tensor-core work at the bf16 peak (PEAK_TFLOPS), `prefill_flops`: the
products, 2 T n k for every matrix a prompt of T tokens runs through ([n, k]: every layer's
attention projections and hc mixes, the kv sources' compressor (T rows) and index keys (one row a
completed group), the index sources' indexer, the engram wkv); the sparse attention, 2 x 2 x H x
D per entry a query attends (min(W, p) window rows and, where the layer has compressed rows,
min(K, p // ratio) selected ones, at position p = 1 .. T); and the index scores, 2 x IH x ID per
key a query scores (p // ratio of them at each index source). Ratio = wall clock / bound.

L2: a stack's weights are GBs, far past 4x L2, and a prefill reuses its tiles by design; nothing
is evicted or rotated, and the JSON's `l2` says the data is read from HBM.
"""

from __future__ import annotations

import fnmatch
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flashv41.bench.core import PEAK_TFLOPS, BenchCase, BenchContext, BenchOptions, BenchRow, L2Plan
from flashv41.bench.stack import STACKS, stack_model
from flashv41.host.config import ModelConfig
from flashv41.host.errors import CapacityError
from flashv41.host.model import Model
from flashv41.host.progress import Progress
from flashv41.memory import MemoryEstimate, device_free_bytes, estimate_memory, format_bytes
from flashv41.plan import Call, Step
from flashv41.stages.trace import Traced

if TYPE_CHECKING:
    from flashv41.engine import Engine, Sequence

CHUNK = 512  # tokens a prefill chunk (the engine's max_tokens), as issue 16 measured
WARMUP_CHUNKS = 2  # the warm-up prefill's chunks: the second runs with a filled window and earlier groups
CONTEXT_6 = 1 << 20  # the six-layer model's context: the 1m row's max_seq
TARGET_TOKENS_S = 8000  # P5L's must-reach, for prefill.stack.32k
GOAL_TOKENS_S = 50000  # P5L's goal
PROGRESS_EVERY_S = 30.0  # a line of the timed prefill's progress this often in a log (a terminal shows a bar)
CATEGORY_NAMES = ("gemm", "indexer", "sparse_attention", "rest")
OPEN = ""  # the name of a step's opening event: it ends no part

# What each part of the split is: the stages' marks (stages.trace: AttentionStage, HyperStage,
# EngramStage), then the engine's steps (flashv41.engine: what of a step follows its stage's last
# mark, or the whole step where the stage marks nothing). A name may be an fnmatch pattern.
CATEGORIES: dict[str, str] = {
    "wq_a + wkv": "gemm",
    "q_norm + kv_norm_rope_quant": "rest",
    "wq_b": "gemm",
    "compress products": "gemm",
    "compress": "rest",  # the ratio-r pooling and the latents' norm
    "wk": "gemm",
    "publish": "rest",  # the keys' and rows' norm, RoPE and quantisers, the cache scatter
    "index products": "gemm",
    "index_queries": "indexer",  # the queries' RoPE and fp4 quantiser
    "index_scores": "indexer",
    "select": "indexer",  # top-k, and the candidate source's block mask
    "sparse_attention": "sparse_attention",
    "wo_a": "gemm",
    "wo_b": "gemm",
    "ring_write": "rest",
    "hc mixes product": "gemm",
    "engram rows": "rest",
    "engram wkv": "gemm",
    "embedding": "rest",
    "engram hash (host)": "rest",
    "engram rows, projection, gate": "rest",  # the rows' upload, and the gate
    "hc mixes + hc_pre + attn_norm": "rest",
    "attention (*)": "rest",  # nothing follows the attention's last mark but the step's return
    "hc_post": "rest",
    # past POST_PRODUCT_MAX_TOKENS tokens (every prefill chunk) this post forms no product: the
    # mixes after it launch theirs, "hc mixes product"
    "hc_post + next mixes' product": "rest",
    "hc mixes + hc_post + next mixes' product": "rest",
    "hc mixes": "rest",
    "highway download": "rest",
    # an FFN callback's sublayer (Engine(ffn=...)): its input's collapse and norm, and the callback
    # itself (the caller's MoE, whatever it launches: no category of this split fits it)
    "hc mixes + hc_pre + ffn_norm": "rest",
    "ffn (callback)": "rest",
    "head input (hc_pre + output_norm)": "rest",
}


def category_of(part: str) -> str:
    """The category of a part (CATEGORIES: an exact name first, else the one pattern that matches);
    KeyError naming the part when the table does not know it, so a new part cannot go uncounted."""
    if part in CATEGORIES:
        return CATEGORIES[part]
    found = {CATEGORIES[p] for p in CATEGORIES if fnmatch.fnmatchcase(part, p)}
    if len(found) != 1:
        raise KeyError(f"prefill.stack: part {part!r} has {'no' if not found else 'more than one'} category in "
                       f"flashv41.bench.prefill_stack.CATEGORIES")
    return found.pop()


def split_by_category(parts: dict[str, float]) -> dict[str, float]:
    """Seconds by category (every one of CATEGORY_NAMES, in that order) from seconds by part."""
    split = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for part, seconds in parts.items():
        split[category_of(part)] += seconds
    return split


@dataclass(frozen=True)
class PrefillFlops:
    """The tensor-core work of a prefill (FLOPs, two a multiply-add): its products, its index
    scores and its sparse attention."""

    products: int
    index_scores: int
    attention: int

    @property
    def total(self) -> int:
        return self.products + self.index_scores + self.attention


def prefill_flops(cfg: ModelConfig, tokens: int) -> PrefillFlops:
    """The work of prefilling `tokens` tokens from position 0 (see the module docstring): token t
    sees p = t + 1 positions, a window of min(W, p) rows and, on a ratio-r layer, p // r groups,
    of which it attends min(K, p // r) and an index source scores all."""
    c, q, d = cfg.dim, cfg.q_lora_rank, cfg.head_dim
    heads = cfg.n_heads * d
    o = cfg.o_groups * cfg.o_lora_rank
    # a layer's matrices that every token runs through, as [n, k] products (the hc mixes twice)
    per_token = q * c + d * c + heads * q + o * cfg.group_width + c * o + 2 * cfg.mix_hc * cfg.hc * c
    seen = np.arange(1, tokens + 1, dtype=np.int64)  # p of each token
    window = int(np.minimum(seen, cfg.window).sum())
    products = scores = entries = 0
    for role in cfg.roles:
        mults = tokens * per_token
        entries += window
        if role.ratio > 0:  # kv and index sources are among these
            groups = seen // role.ratio
            entries += int(np.minimum(groups, cfg.index_topk).sum())
            if role.index_source:
                mults += tokens * (cfg.index_heads * cfg.index_head_dim * q + cfg.index_heads * c)
                scores += int(groups.sum()) * cfg.index_heads * cfg.index_head_dim
        if role.kv_source:
            mults += tokens * d * c * (2 if role.ratio > 1 else 1)  # the compressor's kv (and gate)
            mults += tokens // role.ratio * cfg.index_head_dim * d  # wk, one row a completed group
        if role.engram and cfg.engram is not None:
            mults += tokens * c * (cfg.hc + 1) * cfg.engram.cols * cfg.engram.head_dim
        products += mults
    return PrefillFlops(2 * products, 2 * scores, 2 * 2 * entries * cfg.n_heads * d)


class PartEvents:
    """A StepObserver of the engine's calls (flashv41.plan) and the stages' trace (stages.trace) at
    once: a CUDA event on `stream` before and after each step and at each mark inside one, none
    waited for until `collect` (see the module docstring for what a part's time is)."""

    def __init__(self, stream: Any = 0) -> None:
        self.stream = stream
        self.seconds: dict[str, float] = {}  # by part, in first-seen order
        self._events: list[tuple[str, Any]] = []  # (the part it ends, or OPEN; the event)

    def mark(self, part: str) -> None:
        """An event that ends `part` (the stages' trace)."""
        from numba import cuda

        event = cuda.event()
        event.record(self.stream)
        self._events.append((part, event))

    def before(self, step: Step, call: Call) -> None:
        self.mark(OPEN)

    def after(self, step: Step, call: Call) -> None:
        self.mark(step.name)

    def collect(self) -> dict[str, float]:
        """Wait for the last event, add every part's time to `seconds` and return it."""
        if self._events:
            self._events[-1][1].synchronize()
        for (_, start), (part, end) in itertools.pairwise(self._events):
            if part != OPEN:
                self.seconds[part] = self.seconds.get(part, 0.0) + start.elapsed_time(end) / 1e3
        self._events = []
        return self.seconds


@contextmanager
def watching(engine: Engine, events: PartEvents) -> Iterator[None]:
    """`events` observes every call of `engine` and receives the marks of its traced stages, until
    the block ends."""
    stages = [s for s in engine.plan.stages if isinstance(s, Traced)]
    engine.observers.append(events)
    for stage in stages:
        stage.trace = events.mark
    try:
        yield
    finally:
        engine.observers.remove(events)
        for stage in stages:
            stage.trace = None


def prefill_chunks(engine: Engine, seq: Sequence, tokens: np.ndarray, events: PartEvents, desc: str = "") -> float:
    """Prefill `tokens` into `seq`, one Sequence.prefill call a chunk of engine.max_tokens, watched
    by `events`, each returning its last token's highway as a server's would (output="last"); returns
    the calls' wall-clock seconds (each call ends when the device has finished). With `desc`, the
    chunks' progress goes to stderr (host.progress: a line every few seconds in a log, so a run cut
    short by a time limit still shows how far it got and how fast; its updates cost microseconds
    against a chunk's milliseconds)."""
    chunk = engine.max_tokens
    shown = Progress(desc, -(-tokens.size // chunk), "chunk", "chunks", log_every_s=PROGRESS_EVERY_S) if desc \
        else nullcontext()
    with watching(engine, events), shown as progress:
        start = time.perf_counter()
        for first in range(0, tokens.size, chunk):
            seq.prefill(tokens[first:first + chunk], output="last")
            if progress is not None:
                progress.update()
        return time.perf_counter() - start


def require_memory(model: Model, max_seq: int, chunk: int, free_bytes: int, what: str) -> MemoryEstimate:
    """flashv41.memory's estimate of an engine for `model` holding one sequence of `max_seq`
    positions; CapacityError naming `what` where it exceeds `free_bytes`."""
    estimate = estimate_memory(model.config, model.weights, max_seq, chunk)
    need = estimate.total_bytes(1)
    if need > free_bytes:
        raise CapacityError(f"{what}: an engine with max_seq {max_seq} and chunks of {chunk} tokens needs about "
                            f"{format_bytes(need)} of device memory (flashv41.memory's estimate), and "
                            f"{format_bytes(free_bytes)} is free")
    return estimate


@dataclass(frozen=True)
class PrefillStack:
    """One case: its row's name, the synthetic preset, the prompt's length, the model file in the
    work directory and the preset fields it is written with, and the tokens/s P5L asks of it
    (0: none)."""

    name: str
    preset: str
    tokens: int
    filename: str
    overrides: tuple[tuple[str, Any], ...] = ()
    target: int = 0


SIX_LAYER_FILE = f"flash-prefill-Q8_0-ctx{CONTEXT_6}.gguf"
SIX_LAYER = (("context_length", CONTEXT_6), ("stored_draw", True))
PREFILL_STACKS = (
    PrefillStack("prefill.stack.4k.40", "flash40", 4096, STACKS[1].filename),
    PrefillStack("prefill.stack.32k.40", "flash40", 32768, STACKS[1].filename),
    PrefillStack("prefill.stack.32k", "flash", 32768, SIX_LAYER_FILE, SIX_LAYER, TARGET_TOKENS_S),
    PrefillStack("prefill.stack.128k", "flash", 131072, SIX_LAYER_FILE, SIX_LAYER),
    PrefillStack("prefill.stack.1m", "flash", 1 << 20, SIX_LAYER_FILE, SIX_LAYER),
)


def stack_rows(stack: PrefillStack, cfg: ModelConfig, wall_s: float, parts: dict[str, float], l2: L2Plan,
               held_bytes: int | None = None) -> list[BenchRow]:
    """The row of a timed prefill (wall clock `wall_s`, device seconds by part `parts`) and its
    parts' rows; `held_bytes`, where known, the device memory the engine held at the run's end."""
    flops = prefill_flops(cfg, stack.tokens)
    bound = flops.total / (PEAK_TFLOPS * 1e12)
    split = split_by_category(parts)
    total = sum(split.values())

    def share(seconds: float) -> str:
        return f"{100 * seconds / total:.1f}%" if total > 0 else "-"

    rate = stack.tokens / wall_s
    target = f" (P5L must reach {stack.target:,}, goal {GOAL_TOKENS_S:,})" if stack.target else ""
    engram = 0 if cfg.engram is None else len(cfg.engram.layer_ids)
    note = (f"{len(cfg.roles)} layers + {engram} engram ({stack.preset}), {stack.tokens} random tokens from position 0 "
            f"in chunks of {CHUNK}, max_seq {stack.tokens}, one run after a {WARMUP_CHUNKS}-chunk warm-up: "
            f"{rate:,.0f} tokens/s wall clock{target}; "
            f"tensor-core work {flops.total / 1e12:.1f} TFLOP (products {flops.products / 1e12:.1f}, "
            f"index scores {flops.index_scores / 1e12:.1f}, sparse attention {flops.attention / 1e12:.1f}) at "
            f"{PEAK_TFLOPS:.0f} TFLOP/s, {flops.total / wall_s / 1e12:.1f} achieved; split of the events' "
            f"{total:.2f} s: " + ", ".join(f"{name} {seconds:.2f} s ({share(seconds)})"
                                           for name, seconds in split.items()))
    if held_bytes is not None:
        note += (f"; device memory held at the run's end {format_bytes(held_bytes)} (the free memory before "
                 f"the engine less after the run: the engine allocates its buffers up front)")
    rows = [BenchRow(stack.name, wall_s, bound, flops=flops.total, note=note, l2=l2, split=split)]
    for part, seconds in parts.items():
        rows.append(BenchRow(f"{stack.name}.part.{part}", seconds, 0.0,
                             note=f"{category_of(part)}; {share(seconds)} of the events' {total:.2f} s", l2=l2))
    return rows


def measure(engine: Engine, tokens: np.ndarray, desc: str = "") -> tuple[float, dict[str, float]]:
    """The warm-up, then the timed prefill of `tokens` (module docstring), its progress named `desc`
    on stderr: (wall seconds, device seconds by part)."""
    stream = engine.attention.stream
    warm = engine.new_sequence()
    warm_events = PartEvents(stream)
    prefill_chunks(engine, warm, tokens[:WARMUP_CHUNKS * engine.max_tokens], warm_events)
    split_by_category(warm_events.collect())  # a part CATEGORIES lacks fails here, not after the long run
    warm.release()
    seq = engine.new_sequence()
    events = PartEvents(stream)
    try:
        wall = prefill_chunks(engine, seq, tokens, events, desc)
        return wall, events.collect()
    finally:
        seq.release()


def prefill_case(stack: PrefillStack) -> BenchCase:
    def run(ctx: BenchContext) -> list[BenchRow]:
        import flashv41

        model = stack_model(ctx.options, stack, **dict(stack.overrides))
        cfg = model.config
        try:
            free_before = device_free_bytes()
            estimate = require_memory(model, stack.tokens, CHUNK, free_before, stack.name)
            tokens = np.random.default_rng(16).integers(0, cfg.vocab_size, stack.tokens)
            with flashv41.Engine(model, max_seq=stack.tokens, max_tokens=CHUNK) as engine:
                wall, parts = measure(engine, tokens, stack.name)
                held = free_before - device_free_bytes()
        finally:
            model.close()
        return stack_rows(stack, cfg, wall, parts, ctx.plan(estimate.weight_bytes), held)

    return BenchCase(stack.name, run, default=False)


def cases(options: BenchOptions) -> list[BenchCase]:
    """The five prefill.stack cases, each run only when a --rows pattern names it."""
    return [prefill_case(stack) for stack in PREFILL_STACKS]
