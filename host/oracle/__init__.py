"""The NumPy oracle: the engram and attention layers and the layer stack, as V4.1 computes them.

This is the yardstick every GPU kernel is held to. It follows the official reference's operation
order (model.py, engram.py, kernel_cpu.py) with deliberate deviations only (README.md lists them,
under "How the oracle differs from the reference"): weights as the GGUF stores them, an fp32
highway, top-k ties to the lower position, prefill in chunks from any position. host.numerics
says how each operation is rounded.

    oracle = Oracle(model)                 # model from flashv41.load_model
    seq = oracle.new_sequence()
    h = seq.prefill(token_ids)             # final highway [T, hc, dim] fp32
    h = seq.decode(token_id)               # [1, hc, dim]

Per layer i: engram (engram layers) -> attention sublayer between hc_pre and hc_post, using the
pre-mix the previous layer's FFN mixes produced -> the FFN sublayer between its own mixes and
hc_post: its input ffn_norm(hc_pre(h, pre)) with the pre of this layer's attention mixes (the
reference's Block.forward: a sublayer's mixes feed the next sublayer), its output `ffn(layer, x)`
(Oracle's `ffn`: a host function such as host.moe.HostMoE, rounded to bf16), or zero without one;
its mixes' `pre` becomes the next layer's pre-mix (the first layer's is one-hot on copy 0). After
the last layer, `logits()` is the head (host.oracle.head) of the last call.
"""

from __future__ import annotations

import numpy as np

from flashv41.host import gguf_layout as L
from flashv41.host.engram_hash import EngramHasher
from flashv41.host.errors import CapacityError, InputError, SequenceStateError, UnsupportedError, plural
from flashv41.host.model import Model
from flashv41.host.numerics import F32, bf16, rms_norm, rope_tables
from flashv41.host.oracle.attention import (
    Adopt,
    AttentionWeights,
    LayerState,
    SharedRuntime,
    attention_layer,
    own_choice,
)
from flashv41.host.oracle.engram import engram_layer
from flashv41.host.oracle.hc import hc_mixes, hc_post, hc_pre
from flashv41.host.oracle.head import head_input, head_logits
from flashv41.host.quants import dequantize
from flashv41.host.tokens import check_output, check_tokens, one_token

__all__ = ["Oracle", "OracleSequence"]


class Oracle:
    """The oracle for one model: dequantised weights (cached on first use) and the RoPE tables.
    ffn: the FFN sublayer's output, `ffn(layer, x) -> y` on float32 [T, C] (x bf16 values; y rounded
    to bf16), e.g. host.moe.HostMoE(model); None: a zero FFN output."""

    def __init__(self, model: Model, max_seq: int | None = None, ffn=None):
        if ffn is not None and not model.config.ffn_norm:
            raise UnsupportedError(f"{model.path.name}: an FFN needs every layer's ffn_norm, and the file has none")
        self.ffn = ffn
        self.model = model
        self.cfg = model.config
        self.max_seq = max_seq or self.cfg.context_length
        self.tables = rope_tables(self.cfg, self.max_seq)
        self._cache: dict[tuple[int | None, str], np.ndarray] = {}

    def weight(self, layer: int | None, role: str) -> np.ndarray:
        """A tensor dequantised to float32 (cached)."""
        k = (layer, role)
        if k not in self._cache:
            self._cache[k] = self.model.tensor(layer, role).dequantize()
        return self._cache[k]

    def attention_weights(self, layer: int) -> AttentionWeights:
        args = {name: self.weight(layer, role) for name, role in L.ATTENTION_ROLES.items()}
        for name, role in L.OPTIONAL_ATTENTION_ROLES.items():
            if self.model.weights.has(layer, role):
                args[name] = self.weight(layer, role)
        return AttentionWeights(**args)

    def engram_qk(self, layer: int) -> np.ndarray:
        """q_weight * k_weight [hc, C] fp32 (the gate only ever uses their product)."""
        return (self.weight(layer, "engram_q") * self.weight(layer, "engram_k")).astype(F32)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """token_embd rows as bf16 values [T, C]."""
        table = self.model.tensor(None, L.TOKEN_EMBD)
        rows = dequantize(table.raw()[np.asarray(token_ids, np.int64)], table.ggml_type, table.shape[-1])
        return bf16(rows)

    def new_sequence(self, max_seq: int | None = None) -> OracleSequence:
        return OracleSequence(self, max_seq or self.max_seq)


class OracleSequence:
    """One sequence: its position, its hash cache and every layer's state."""

    def __init__(self, oracle: Oracle, max_seq: int):
        if max_seq > oracle.max_seq:
            raise CapacityError(f"max_seq {max_seq} exceeds the oracle's RoPE tables ({oracle.max_seq})")
        self.oracle = oracle
        self.cfg = oracle.cfg
        self.max_seq = max_seq
        self.captures: list[dict] = []
        self.released = False
        self.reset()

    def reset(self) -> None:
        """Back to an empty sequence at position 0."""
        cfg = self.cfg
        self.position = 0
        self.hasher = EngramHasher(cfg.engram, self.max_seq) if cfg.engram else None
        self.states = [LayerState.create(cfg, role, self.max_seq) for role in cfg.roles]
        self.last: tuple[np.ndarray, np.ndarray] | None = None  # the last call's final (h, pre_mix)

    def _check(self, token_ids, token_mask) -> tuple[np.ndarray, np.ndarray | None]:
        if self.released:
            raise SequenceStateError("this sequence was released")
        ids, mask = check_tokens(token_ids, token_mask, self.cfg.vocab_size)
        if self.position + ids.size > self.max_seq:
            raise CapacityError(f"{plural(ids.size, 'token')} at position {self.position} "
                                f"{'exceeds' if ids.size == 1 else 'exceed'} max_seq "
                                f"{self.max_seq}")
        return ids, mask

    def prefill(self, token_ids, token_mask=None, capture: bool = False,
                layer_inputs: list[tuple[np.ndarray, np.ndarray]] | None = None,
                choices: list[Adopt] | None = None, output: str = "all") -> np.ndarray:
        """Run a chunk of tokens from the current position; returns the final highway [T, hc, C] fp32
        (output "last": the last token's, [1, hc, C]; host.tokens.check_output).

        layer_inputs: per layer, (h [T, hc, C], pre_mix [T, hc]) to start that layer from instead
        of the previous layer's result (e.g. another implementation's `h_in` / `pre_mix` captures),
        so each layer is compared from identical inputs rather than through the whole chain.
        choices: per layer, the hook its attention's discrete choices go through
        (host.oracle.attention.Adopt; by default the oracle keeps its own).
        """
        check_output(output)
        ids, mask = self._check(token_ids, token_mask)
        cfg, o = self.cfg, self.oracle
        start = self.position
        t = ids.size
        hashes = self.hasher.hash(ids, start, mask) if self.hasher is not None else None
        h = np.repeat(o.embed(ids)[:, None, :], cfg.hc, axis=1).astype(F32)
        pre_mix = np.zeros((t, cfg.hc), F32)
        pre_mix[:, 0] = 1
        shared = SharedRuntime()
        self.captures = []
        for role in cfg.roles:
            i = role.layer
            cap: dict | None = {} if capture else None
            if layer_inputs is not None:
                h, pre_mix = (np.asarray(v, F32) for v in layer_inputs[i])
            if cap is not None:
                cap.update(h_in=h, pre_mix=pre_mix)
            if role.engram:
                assert cfg.engram is not None and hashes is not None
                e = cfg.engram.hash_index(i)
                h = engram_layer(h, hashes[:, e], o.model.tensor(i, L.ENGRAM_TABLE), o.weight(i, "engram_wkv"),
                                 o.engram_qk(i), cfg.norm_eps, mask, cap)
            attn_pre, post, comb = self._mixes(i, "attn", h)
            x = rms_norm(hc_pre(h, pre_mix), o.weight(i, "attn_norm"), cfg.norm_eps)
            adopt = choices[i] if choices is not None else own_choice
            a = attention_layer(cfg, role, o.attention_weights(i), o.tables, self.states[i], shared, x, start, cap,
                                adopt)
            h = hc_post(a, h, post, comb)
            if cap is not None:
                cap["h_attn"] = h
            pre_mix, post_f, comb_f = self._mixes(i, "ffn", h)
            y = None
            if o.ffn is not None:
                xf = rms_norm(hc_pre(h, attn_pre), o.weight(i, "ffn_norm"), cfg.norm_eps)
                y = ffn_output(o.ffn, i, xf)
                if cap is not None:
                    cap.update(ffn_in=xf, ffn_out=y)
            h = hc_post(y, h, post_f, comb_f)
            if cap is not None:
                cap["h_out"] = h
                self.captures.append(cap)
        self.position += t
        self.last = (h, pre_mix)
        return h if output == "all" else h[-1:]

    def decode(self, token_id: int, token_mask: bool | None = None, capture: bool = False) -> np.ndarray:
        """One token at the current position; returns [1, hc, C]."""
        ids = one_token(token_id)
        mask = None if token_mask is None else np.array([bool(token_mask)])
        return self.prefill(ids, mask, capture)

    def logits(self, all_positions: bool = False) -> np.ndarray:
        """The head's fp32 logits of the last call: [vocab] of its last position, or [T, vocab]
        (host.oracle.head, from the call's final highway and the last layer's pre-mix)."""
        self._require_head()
        if self.last is None:
            raise SequenceStateError("no call yet: logits are the last call's (prefill or decode first)")
        h, pre = self.last if all_positions else (self.last[0][-1:], self.last[1][-1:])
        out = self._head(h, pre)[1]
        return out if all_positions else out[0]

    def head_from(self, h_attn: np.ndarray, h_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The head from another implementation's last layer, its highway after the attention
        sublayer (whence the collapse weights: the FFN mixes' pre) and its final highway (e.g. an
        engine sequence's last `captures`), so that the head is compared from the same starting
        point as every layer: (input x [T, C] bf16 values, logits [T, vocab] fp32)."""
        self._require_head()
        pre, _, _ = self._mixes(self.cfg.n_layers - 1, "ffn", np.asarray(h_attn, F32))
        return self._head(np.asarray(h_out, F32), pre)

    def _require_head(self) -> None:
        if not self.cfg.head:
            raise UnsupportedError(f"{self.oracle.model.path.name}: the file has no head (output_norm, output), so "
                                   "no logits")

    def _mixes(self, i: int, sublayer: str, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer i's hc mixes (pre, post, comb) of its "attn" or "ffn" sublayer from the highway h."""
        cfg, o = self.cfg, self.oracle
        return hc_mixes(h, o.weight(i, f"hc_{sublayer}_fn"), o.weight(i, f"hc_{sublayer}_scale"),
                        o.weight(i, f"hc_{sublayer}_base"), cfg.hc, cfg.sinkhorn_iters, cfg.norm_eps, cfg.hc_eps)

    def _head(self, h: np.ndarray, pre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input x, logits) of the head from the final highway h and the collapse weights pre."""
        x = head_input(h, pre, self.oracle.weight(None, L.OUTPUT_NORM), self.cfg.norm_eps)
        return x, head_logits(x, self.oracle.weight(None, L.OUTPUT))

    def load_attention_state(self, layers: list[dict[str, np.ndarray]]) -> None:
        """Overwrite every layer's attention state (window ring, compressor partial group, caches)
        with another implementation's, e.g. `flashv41.Sequence.attention_state()`, so the next call
        is compared from the same starting point. Positions and the hash history are not touched."""
        if len(layers) != len(self.states):
            raise InputError(f"{len(layers)} layer states for a model of {len(self.states)} layers")
        for state, values in zip(self.states, layers, strict=True):
            for name, value in values.items():
                target = getattr(state, name)
                if target is None or target.shape != value.shape:
                    raise InputError(f"attention state {name}: shape {value.shape} does not fit "
                                     f"{None if target is None else target.shape}")
                target[...] = value

    def release(self) -> None:
        """Drop the sequence's state; further calls raise SequenceStateError."""
        self.states = []
        self.last = None
        self.hasher = None
        self.released = True


def ffn_output(ffn, layer: int, x: np.ndarray) -> np.ndarray:
    """An FFN function's output for layer `layer` of x [T, C]: float32 [T, C], rounded to bf16 (the
    sublayer's output dtype); InputError naming the function when it gives anything else."""
    y = np.asarray(ffn(layer, x))
    if y.shape != x.shape or not np.issubdtype(y.dtype, np.floating):
        raise InputError(f"the FFN function {getattr(ffn, '__name__', type(ffn).__name__)} returned {y.dtype} "
                         f"{y.shape} for layer {layer}, expected float {x.shape}")
    return bf16(y.astype(F32))
