"""The engine's plan, built once, and how a call's stage calls are made and watched.

`flashv41.engine.Engine` builds its `Plan` once, at construction: what a call decides the same way
every time, per layer (`LayerPlan`): which engram layer's rows come next (`EngramPlan`), the hyper
stage's values for the layer (stages.hyper.HyperLayer: which buffers, which post forms which
product) and the names the profile shows (`Step`). A call then runs as code, Engine methods that
read in the V4.1 order:

    _upload    host part: the token ids once onto the device, the engram hash, each engram layer's
               rows, then the mask, the first mix and the positions
    _device    the embedding, then `_layer` per layer: engram gate -> attention sublayer -> FFN
               sublayer (launches only, so a one-token step can be recorded as a CUDA graph)
    _download  the call's rows of the highway back to the host

Every stage call on that path is written `run(step, self.stage.method, *args)`. `run` is a `Run`:
`DIRECT` makes the call as written (the plain path, and a graph's capture); `Watched` brackets each
call with its observers' `before` and `after` (`StepObserver`: `StageTimer` for profiling, a
benchmark's events in `Engine.observers`) and keeps, at the layer's edges that the code marks
(`layer_begins`, `sublayer_ends`), the per-layer intermediates of capture=True (`LayerCapture`).
The stages know nothing of either.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import numpy as np

from flashv41.host.tokens import Tokens

if TYPE_CHECKING:
    from flashv41.stages.hyper import HyperLayer

P = ParamSpec("P")
R = TypeVar("R")

# the sublayers whose ends `Run.sublayer_ends` marks
ENGRAM, ATTN, FFN = "engram", "attn", "ffn"


@dataclass
class Call:
    """One chunk of T tokens of one sequence, or one token of each of T sequences (decode_batch:
    `batched`, and start, state and shared are lists, one a sequence): what changes from call to
    call, and what the host part hands the device part (the hash's row ids)."""

    tokens: int  # T
    start: Any  # int: the sequence position of the first token; batched: list[int], each sequence's
    ids: Tokens  # the checked token ids int64 [T] and mask bool [T] or None (host.tokens)
    mask: Any  # uint8 [>= T] the same mask on the device, or None
    hasher: Any  # the sequence's engram hasher (batched: engine.BatchHasher; None without engram layers)
    state: Any  # the sequence's AttentionState (batched: a list of them)
    shared: Any  # what source layers hand down the stack within this call (batched: one a sequence)
    batched: bool = False
    captures: list[dict] | None = None  # one dict per layer when the call keeps its intermediates
    hashes: np.ndarray | None = None  # int64 [T, n_engram_layers, cols], the host part's hash
    head_x: Any = None  # uint16 [>= T, C] where the head's input goes (the sequence's; batched: the engine's)

    def capture(self, layer: int) -> dict | None:
        """The capture dict of `layer` when the call keeps its intermediates, else None."""
        return None if self.captures is None else self.captures[layer]


@dataclass(frozen=True)
class Step:
    """What an observer sees of one stage call: the row of the profile's table its time adds to,
    and the layer it belongs to (None outside the layers)."""

    name: str
    layer: int | None = None


@dataclass(frozen=True, eq=False)
class EngramPlan:
    """One engram layer: its row ids' upload (host part), its rows and projection
    (EngramStage.prepare: the first engram layer's right after the embedding, each later one's
    after the gate of the one before, as their shared workspaces allow; a captured graph runs them
    beside the layers in between) and its gate (EngramStage.finish)."""

    layer: int
    column: int  # its column of the call's hash [T, n_engram_layers, cols] (EngramConfig.hash_index)
    step: Step  # every one of its calls: "engram rows, projection, gate" at its layer
    next: EngramPlan | None  # the next engram layer, whose prepare follows this one's gate


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """One layer's fixed decisions: its engram (None without), its hyper-connection values and
    what the profile calls each of its calls."""

    layer: int
    engram: EngramPlan | None
    hyper: HyperLayer  # the hyper stage's buffers and fusions for the layer (HyperStage.plan)
    attn_mixes: Step  # "hc mixes + hc_pre + attn_norm"
    attention: Step  # "attention (<block type>)"
    attn_post: Step  # "hc_post", or "hc_post + next mixes' product" where it forms the FFN's
    ffn_mixes: Step  # "hc mixes", or "hc mixes + hc_post + next mixes' product" where the FFN is one launch,
    # or "hc mixes + hc_pre + ffn_norm" where an FFN callback runs
    ffn_post: Step  # the FFN's hc_post, where it is a launch of its own
    ffn: Step | None = None  # "ffn (callback)": the engine's FFN callback, where it has one

    @property
    def steps(self) -> tuple[Step, ...]:
        """The layer's steps in the order its calls make them (its engram's first, where it has
        one; the next engram layer's prepare, which an engram layer also runs, aside)."""
        first = (self.engram.step,) if self.engram is not None else ()
        if self.hyper.ffn_in_one:
            last: tuple[Step, ...] = (self.ffn_mixes,)
        else:
            last = (self.ffn_mixes, *(() if self.ffn is None else (self.ffn,)), self.ffn_post)
        return (*first, self.attn_mixes, self.attention, self.attn_post, *last)

    @property
    def last(self) -> Step:
        """The step of the layer's last call (Engine._layer's ladder), the one an observer sees end
        the layer."""
        return self.ffn_mixes if self.hyper.ffn_in_one else self.ffn_post


@dataclass(frozen=True, eq=False)
class Plan:
    """Every call's fixed decisions, built once per engine."""

    layers: tuple[LayerPlan, ...]
    engram: tuple[EngramPlan, ...]  # the engram layers in order (the first's prepare follows the embedding)
    stages: tuple[Any, ...]  # the stages the device part launches through (a capture switches their streams)
    highway: Any  # h [T, hc, C] fp32 (device): the buffer every layer updates in place

    @classmethod
    def empty(cls) -> Plan:
        """No layers and no buffers: what a closed engine keeps, so the freed arrays are unreferenced."""
        return cls((), (), (), None)


class StepObserver(Protocol):
    """Something that watches a call's stage calls: `before` one runs, `after` it returned (not
    after one that raised: the call then fails and what was observed of it is incomplete anyway)."""

    def before(self, step: Step, call: Call) -> None: ...

    def after(self, step: Step, call: Call) -> None: ...


class Run:
    """How a call's stage calls are made. This one, `DIRECT`, makes each as written and ignores the
    layer edges: the plain path, and what a CUDA graph's capture records."""

    observed = False  # whether anything watches: a one-token step is then launched eagerly, not replayed

    def __call__(self, step: Step, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """fn(*args, **kwargs), which `step` names for the observers."""
        return fn(*args, **kwargs)

    def layer_begins(self, layer: LayerPlan) -> None:
        """`layer`'s first call comes next."""

    def sublayer_ends(self, layer: LayerPlan, sublayer: str) -> None:
        """`layer`'s sublayer (ENGRAM, ATTN or FFN, the layer's last) made its last call."""


DIRECT = Run()


class Watched(Run):
    """A watched call's runs: each stage call between its observers' `before` (in the order given)
    and `after` (in the reverse order); the layer edges to `capture`, when the call keeps its
    intermediates (its host copies then fall between calls, outside any observer's bracket)."""

    observed = True

    def __init__(self, call: Call, observers: tuple[StepObserver, ...], capture: LayerCapture | None) -> None:
        self.call = call
        self.observers = observers
        self.capture = capture

    def __call__(self, step: Step, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        for observer in self.observers:
            observer.before(step, self.call)
        value = fn(*args, **kwargs)
        for observer in reversed(self.observers):
            observer.after(step, self.call)
        return value

    def layer_begins(self, layer: LayerPlan) -> None:
        if self.capture is not None:
            self.capture.layer_begins(layer, self.call)

    def sublayer_ends(self, layer: LayerPlan, sublayer: str) -> None:
        if self.capture is not None:
            self.capture.sublayer_ends(layer, sublayer, self.call)


class StageTimer:
    """Profiling: each step's wall time between two device synchronisations (so it is the step's
    own work, queued launches included), added up by step name in `seconds`: a stage that runs in
    every layer is one row of the table."""

    def __init__(self, synchronize: Callable[[], None], seconds: defaultdict[str, float]) -> None:
        self._synchronize = synchronize
        self.seconds = seconds
        self._start = 0.0

    def before(self, step: Step, call: Call) -> None:
        self._synchronize()
        self._start = time.perf_counter()

    def after(self, step: Step, call: Call) -> None:
        self._synchronize()
        self.seconds[step.name] += time.perf_counter() - self._start


class LayerCapture:
    """capture=True: host copies of every layer's intermediates in `call.captures[layer]`, beside
    what the stages put there themselves: h_in and pre_mix as the layer begins, engram_ids after its
    engram sublayer, h_attn after its attention sublayer, h_out after the layer. Copies synchronise
    the device, which is why only a capturing call has this."""

    # what each sublayer's end keeps
    KEYS = {ENGRAM: "engram_ids", ATTN: "h_attn", FFN: "h_out"}

    def __init__(self, highway: Any) -> None:
        self._highway = highway  # h [>= T, hc, C] fp32 (device)

    def layer_begins(self, layer: LayerPlan, call: Call) -> None:
        t = call.tokens
        self._dict(call, layer).update(h_in=self._highway[:t].copy_to_host(),
                                       pre_mix=layer.hyper.pre_in[:t].copy_to_host())

    def sublayer_ends(self, layer: LayerPlan, sublayer: str, call: Call) -> None:
        if sublayer == ENGRAM:
            assert layer.engram is not None and call.hashes is not None
            value = np.asarray(call.hashes[:, layer.engram.column], np.int64).copy()
        else:
            value = self._highway[:call.tokens].copy_to_host()
        self._dict(call, layer)[self.KEYS[sublayer]] = value

    @staticmethod
    def _dict(call: Call, layer: LayerPlan) -> dict:
        assert call.captures is not None, "a capturing call carries one dict per layer"
        return call.captures[layer.layer]
