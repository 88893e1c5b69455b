"""The engine's call as a plan: steps built once, walked per call, watched by observers.

A `Step` is one call of a stage's method with its arguments: the fixed ones (a layer index, a
sublayer kind, the engine's buffers) stored in the step, the ones that change from call to call
(the token count, the position, the sequence's state, ...) stored as `PerCall` placeholders that
the walk fills in from the `Call`. `flashv41.engine.Engine` builds its `Plan` once, at
construction; a call then walks it:

    upload    host part: token ids, the engram hash, each engram layer's rows onto the device
    device    the embedding, then per layer (`LayerPlan`) engram -> attention sublayer -> FFN
              sublayer: launches only, so a one-token step can be recorded as a CUDA graph
    download  the call's rows of the highway back to the host

`walk(steps, call)` is a plain loop. Whatever needs to see the steps one by one is an observer
passed to it (`StepObserver`): `StageTimer` for profiling, `LayerCapture` for the per-layer
intermediates that `capture=True` keeps. The steps themselves know nothing of either.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class Call:
    """One chunk of T tokens of one sequence as the steps see it, or one token of each of T
    sequences (Engine.decode_batch: start, state and shared are then lists, one a sequence): what
    they read that changes from call to call, and what a step hands on to later ones (the hash's
    row ids, the highway)."""

    tokens: int  # T
    start: int | list[int]  # the sequence position of the first token; a batch's: each sequence's
    ids: np.ndarray  # int64 [T] token ids
    token_mask: np.ndarray | None  # bool [T] on the host; None: every token takes part
    mask: Any  # uint8 [>= T] the same mask on the device, or None
    hasher: Any  # the sequence's engram hasher (None without engram layers)
    state: Any  # the sequence's attention state (a batch: a list of them)
    shared: Any  # what source layers hand down the stack within this call (a batch: one a sequence)
    captures: list[dict] | None = None  # one dict per layer when the call keeps its intermediates
    hashes: np.ndarray | None = None  # int64 [T, n_engram_layers, cols], written by the hash step
    output: np.ndarray | None = None  # float32 [T, hc, C], written by the download step


class PerCall(ABC):
    """A step argument (or the object a step calls) that changes from call to call."""

    @abstractmethod
    def of(self, call: Call) -> Any:
        """Its value in `call`."""


_CALL_FIELDS = frozenset(f.name for f in dataclasses.fields(Call))


@dataclass(frozen=True)
class Field(PerCall):
    """One of the call's own values, by name."""

    name: str

    def __post_init__(self) -> None:
        # a misspelt name would otherwise only fail once a call reaches the step
        if self.name not in _CALL_FIELDS:
            raise ValueError(f"Call has no field {self.name!r}")

    def of(self, call: Call) -> Any:
        return getattr(call, self.name)


TOKENS = Field("tokens")
START = Field("start")
IDS = Field("ids")
TOKEN_MASK = Field("token_mask")
MASK = Field("mask")
HASHER = Field("hasher")
STATE = Field("state")
SHARED = Field("shared")


@dataclass(frozen=True)
class Rows(PerCall):
    """One engram layer's row ids int64 [T, cols]: its column of the call's hash."""

    column: int

    def of(self, call: Call) -> np.ndarray:
        assert call.hashes is not None, "the hash step runs before the steps that read its rows"
        return call.hashes[:, self.column]


@dataclass(frozen=True)
class Captured(PerCall):
    """The capture dict of `layer` when the call keeps its intermediates, else None."""

    layer: int

    def of(self, call: Call) -> dict | None:
        return None if call.captures is None else call.captures[self.layer]


@dataclass(frozen=True, eq=False)
class Head(PerCall):
    """The call's first T rows of a device buffer."""

    buffer: Any  # [>= T, ...] device array

    def of(self, call: Call) -> Any:
        return self.buffer[:call.tokens]


@dataclass(frozen=True, eq=False)
class Step:
    """`getattr(stage, method)(*args)`, each PerCall (in `args`, or as the `stage`) replaced by its
    value in the call being walked. Compared by identity, so observers can key on the step itself."""

    name: str  # the row of the profile's table its time adds to
    layer: int | None  # the layer it belongs to; None outside the layers
    stage: Any  # the object called: a stage, or a PerCall (the sequence's hasher, the highway's rows)
    method: str  # looked up as the step runs, so a method replaced on the stage is the one called
    args: tuple[Any, ...] = ()  # fixed values and PerCalls, in the method's order
    result: str | None = None  # the Call field its return value goes into; None: it returns nothing

    def run(self, call: Call) -> None:
        stage = self.stage.of(call) if isinstance(self.stage, PerCall) else self.stage
        args = [a.of(call) if isinstance(a, PerCall) else a for a in self.args]
        value = getattr(stage, self.method)(*args)
        if self.result is not None:
            setattr(call, self.result, value)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's steps by sublayer, and what its captures read besides the highway."""

    layer: int
    pre_mix: Any  # [T, hc] fp32 (device): the attention sublayer's mix, written by the layer before
    rows: Rows | None  # where the layer's engram row ids are in the call's hash; None without engram
    # the gate, in place on the highway (its rows and projection ran earlier: the first engram
    # layer's in the head, each later one's here, after the gate of the engram layer before it)
    engram: tuple[Step, ...]
    attn: tuple[Step, ...]  # mixes with hc_pre + attn_norm, attention, hc_post (and the FFN mixes' product)
    ffn: tuple[Step, ...]  # the FFN sublayer as a zero output: its mixes (the next layer's pre), hc_post

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.engram + self.attn + self.ffn


@dataclass(frozen=True)
class Plan:
    """Every step of a call, in order, built once per engine."""

    upload: tuple[Step, ...]  # host part: what the device part reads that changes from call to call
    head: tuple[Step, ...]  # device part before the first layer (the embedding, the first engram prepare)
    layers: tuple[LayerPlan, ...]
    download: tuple[Step, ...]  # the highway's rows back to the host
    highway: Any  # h [T, hc, C] fp32 (device): the buffer every layer updates in place
    device: tuple[Step, ...] = field(init=False)  # head, then every layer's steps: what a graph records

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", self.head + tuple(s for layer in self.layers for s in layer.steps))

    @classmethod
    def empty(cls) -> Plan:
        """No steps and no buffers: what a closed engine keeps, so the freed arrays are unreferenced."""
        return cls((), (), (), (), None)

    def device_stages(self) -> list[Any]:
        """The stage objects the device part launches through, each once, in order of first use."""
        stages: list[Any] = []
        for step in self.device:
            if not isinstance(step.stage, PerCall) and all(step.stage is not s for s in stages):
                stages.append(step.stage)
        return stages


class StepObserver(Protocol):
    """Something that watches a walk: `before` a step runs, `after` it returned (not after a step
    that raised: the call then fails and what was observed of it is incomplete anyway)."""

    def before(self, step: Step, call: Call) -> None: ...

    def after(self, step: Step, call: Call) -> None: ...


def walk(steps: tuple[Step, ...], call: Call, observers: tuple[StepObserver, ...] = ()) -> None:
    """Run `steps` in order for `call`. Observers are called `before` in the order given and
    `after` in the reverse order, so the first one's work brackets the later ones' (the captures'
    host copies stay outside the timer's synchronised window)."""
    if not observers:
        for step in steps:
            step.run(call)
        return
    for step in steps:
        for observer in observers:
            observer.before(step, call)
        step.run(call)
        for observer in reversed(observers):
            observer.after(step, call)


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
    what the stages put there themselves: h_in and pre_mix before the layer's first step,
    engram_ids after its engram sublayer, h_attn after its attention sublayer, h_out after the
    layer. Copies synchronise the device, which is why only a capturing call has this observer."""

    def __init__(self, plan: Plan) -> None:
        self._highway = plan.highway
        self._opens: dict[Step, LayerPlan] = {}
        self._closes: dict[Step, tuple[LayerPlan, str]] = {}
        for layer in plan.layers:
            self._opens[layer.steps[0]] = layer
            if layer.engram:
                self._closes[layer.engram[-1]] = (layer, "engram_ids")
            self._closes[layer.attn[-1]] = (layer, "h_attn")
            self._closes[layer.ffn[-1]] = (layer, "h_out")

    def before(self, step: Step, call: Call) -> None:
        layer = self._opens.get(step)
        if layer is None:
            return
        t = call.tokens
        self._dict(call, layer).update(h_in=self._highway[:t].copy_to_host(), pre_mix=layer.pre_mix[:t].copy_to_host())

    def after(self, step: Step, call: Call) -> None:
        found = self._closes.get(step)
        if found is None:
            return
        layer, key = found
        if key == "engram_ids":
            assert layer.rows is not None
            value = np.asarray(layer.rows.of(call), np.int64).copy()
        else:
            value = self._highway[:call.tokens].copy_to_host()
        self._dict(call, layer)[key] = value

    @staticmethod
    def _dict(call: Call, layer: LayerPlan) -> dict:
        assert call.captures is not None, "a capturing call carries one dict per layer"
        return call.captures[layer.layer]
