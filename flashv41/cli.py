"""The `flashv41` command line (also `python -m flashv41`).

Each subcommand is a pair of functions: `add_<name>_command(parser)` declares its arguments and
`<name>_command(args) -> int` runs it; `SUBCOMMANDS` lists each name with its one-line help and
declarer, so adding a command is adding a pair and one entry.

It answers at once: this module imports only the standard library, and a subcommand's arguments
are declared (importing what their defaults and checks need: NumPy, gguf-py, never Numba) only
when that subcommand is parsed or its help shown. So `flashv41 --help`, `--version` and a bad
argument cost a Python start and no more; Numba and the kernels are imported by the work itself.

Every error is one line on stderr: a bad argument as argparse words it, `flashv41: error:
argument --seed: ...` (exit 2; numbers are checked as they are parsed, so nothing runs first); an
error flashv41 raises on purpose (`FlashError`) as `flashv41: error: <message>` (exit 2); an
operating-system error (a full disk, a folder that cannot be written) likewise with exit 1;
Ctrl-C, at any moment, as `flashv41: interrupted` (exit 130, after the work under way has cleaned
up: synth leaves no partial file). A reader that stops early (`flashv41 info | head`) ends the
command quietly, with the status of a process a closed pipe stops (141), as `cat` or `git log`
would. `main(argv)` returns the status instead of exiting, so the CLI can be driven from Python.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from flashv41 import __version__

if TYPE_CHECKING:
    import numpy as np

    from flashv41.host.config import ModelConfig
    from flashv41.host.model import Model

# what `synth` writes: every type flashv41 reads (Q3_K .. Q6_K drawn as random valid super-blocks)
SYNTH_TYPES = ("BF16", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16", "F32")
BENCH_WEIGHT_TYPES = SYNTH_TYPES  # the bench's rows: random stored blocks of any of these
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)
BROKEN_PIPE = 141  # ... and by SIGPIPE (128 + 13): what a reader that stops early leaves
# `flashv41 bench`'s defaults, written here so that its help and its argument errors need not
# import the bench (which imports Numba); tests/test_cli.py holds them to flashv41.bench's
BENCH_MIN_REPS = 20
BENCH_DEFAULT_WEIGHT_TYPES = ("Q8_0", "Q2_K", "BF16")
BENCH_DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "flashv41-bench"


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, `flashv41: error: message`, without the usage
    block above it: the same shape as every other flashv41 error, whichever subcommand's parser
    found it (its prog is "flashv41 run"; the usage is a --help away).

    A subcommand's parser is made with its `declare` function and declares its arguments only
    when it is first parsed or its help formatted: the imports its defaults and checks need are
    paid by that subcommand alone, never by `flashv41 --help`."""

    def __init__(self, *args, declare: Callable[[Parser], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._declare = declare

    def declared(self) -> Parser:
        if self._declare is not None:
            declare, self._declare = self._declare, None
            declare(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.declared()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.declared()
        return super().format_help()

    def format_usage(self) -> str:
        self.declared()
        return super().format_usage()

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.split()[0]}: error: {message}\n")


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `least`, or an error naming the value given."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return whole_number


def token_list(text: str) -> np.ndarray:
    """An argparse type: --tokens' comma-separated ids (flashv41.runner.parse_tokens)."""
    from flashv41.host.errors import FlashError
    from flashv41.runner import parse_tokens

    try:
        return parse_tokens(text)
    except FlashError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def type_map_items(text: str) -> dict[str, str]:
    """An argparse type: --type-map's `role=TYPE,role=TYPE` (flashv41.host.synth.parse_type_map)."""
    from flashv41.host.errors import FlashError
    from flashv41.host.synth import parse_type_map

    try:
        return parse_type_map(text)
    except FlashError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_synth_command(p: Parser) -> None:
    from flashv41.host.gguf_layout import LAYOUTS
    from flashv41.host.synth import PRESETS, TYPE_MAP_ROLES

    p.description = ("Write a complete synthetic DeepSeek-V4.1 model in the llama.cpp (or mxxm-t, or ds4) GGUF "
                     "layout, with seeded random weights of realistic statistics.")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="model sizes: tiny (simulator-sized), small (the reference tests' sizes), tiny256 (tiny "
                        "with rows 256 wide, so every matrix but the index keys' holds K-quant blocks), "
                        "flash (V4.1-Flash dimensions, 6 layers), flash40 (V4.1-Flash dimensions on its real "
                        "40-layer schedule, 7.2 GB in Q8_0); default tiny")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="FILE.gguf", help="where to write")
    p.add_argument("--weight-type", choices=SYNTH_TYPES, default="Q8_0",
                   help="type of the dense attention matrices, the engram projection and the embedding "
                        "(default Q8_0; a matrix whose rows do not hold whole blocks takes Q8_0, then BF16; "
                        "Q3_K to Q6_K are drawn as random valid super-blocks)")
    p.add_argument("--table-type", choices=SYNTH_TYPES, default=None,
                   help="type of the engram tables (default: the preset's, Q2_K where rows are 256 wide)")
    p.add_argument("--type-map", type=type_map_items, action="append", default=None, metavar="ROLE=TYPE,...",
                   help="types by tensor role, over --weight-type and --table-type: ROLE is a tensor's name "
                        f"without blk.N. and .weight as llama.cpp names it ({', '.join(TYPE_MAP_ROLES)}) or as "
                        "the layout names it, TYPE one of "
                        f"{', '.join(SYNTH_TYPES)}; every tensor of the role takes it, and one whose rows do "
                        "not hold whole blocks of it is an error (e.g. attn_q_b=Q4_K,engram_embd=Q8_0; "
                        "may be given more than once; the routed experts, ffn_*_exps, may also be IQ2_XXS)")
    p.add_argument("--moe", action="store_true",
                   help="also write the FFN sublayer's and the head's tensors (every layer's ffn_norm, router, "
                        "routed and shared experts; output_norm, output), after the others, which keep their "
                        "bytes: a model flashv41.HostMoE and the head run on (`run --generate`)")
    p.add_argument("--experts", type=at_least(1), default=None, metavar="N",
                   help="with --moe: routed experts a layer (default: the preset's, 4, or 8 for the flash "
                        "presets; V4.1 has 384)")
    p.add_argument("--experts-used", type=at_least(1), default=None, metavar="K",
                   help="with --moe: experts a token takes (default: the preset's, 2, or 6 for the flash presets)")
    p.add_argument("--seed", type=at_least(0), default=0, help="random seed of the weights (default 0)")
    p.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0],
                   help="the GGUF layout's keys and tensor names: llama.cpp (default), mxxm-t (explicit source "
                        "lists, raw pad id, its engram names) or ds4 (HF-named keys, E4M3 engram rows stored as I8, "
                        "no --table-type); the same seed gives the same tensors in all (ds4: but the tables)")
    p.add_argument("--engram-rows", type=int, default=None, metavar="N",
                   help="about N rows per engram table (default: the preset's; at least the preset's smallest "
                        "table: a distinct prime of at least 2 rows per n-gram order and head)")
    p.add_argument("--shards", type=at_least(1), default=1, metavar="N",
                   help="write a split set as llama.cpp's gguf-split does: N files beside FILE.gguf, named "
                        "from it without its .gguf suffix, NAME-00001-of-0000N.gguf ... NAME-0000N-of-0000N.gguf "
                        "(-o m.gguf --shards 3: m-00001-of-00003.gguf to m-00003-of-00003.gguf), the metadata in "
                        "the first; default 1: one plain file named FILE.gguf")
    p.set_defaults(handler=synth_command)


def synth_command(args: argparse.Namespace) -> int:
    from flashv41.host.errors import InputError
    from flashv41.host.gguf_layout import ENGRAM_TABLE
    from flashv41.host.synth import PRESETS, progress_bar, resolve_type_map, shard_paths, write_synthetic
    from flashv41.memory import format_bytes

    overrides: dict = {} if args.engram_rows is None else {"engram_rows": args.engram_rows}
    if (args.experts is not None or args.experts_used is not None) and not args.moe:
        raise InputError("--experts and --experts-used size the MoE that --moe writes: give --moe too")
    if args.moe:
        overrides["moe"] = True
        p = PRESETS[args.preset]
        overrides["n_experts"] = args.experts or p.n_experts
        overrides["n_active"] = args.experts_used or p.n_active
        if overrides["n_active"] > overrides["n_experts"]:
            raise InputError(f"--experts-used {overrides['n_active']} exceeds the {overrides['n_experts']} experts")
    type_map: dict[str, str] = {}
    for items in args.type_map or ():
        for role, type_name in items.items():
            if role in type_map:
                raise InputError(f"--type-map: role {role!r} is given twice ({role}={type_map[role]}, "
                                 f"{role}={type_name})")
            type_map[role] = type_name
    if args.layout == "ds4":
        if args.table_type is not None:
            raise InputError(f"--table-type {args.table_type}: the ds4 layout's engram tables are E4M3 rows "
                             "(E4M3_ROW264) only")
        table_type = "E4M3_ROW264"
    else:
        table_type = args.table_type or PRESETS[args.preset].default_table_type
    start = time.monotonic()
    with progress_bar(f"writing {args.output.name}") as progress:
        path = write_synthetic(args.output, args.preset, weight_type=args.weight_type, table_type=table_type,
                               seed=args.seed, progress=progress, shards=args.shards, layout=args.layout,
                               type_map=type_map, **overrides)
    elapsed = time.monotonic() - start
    files = shard_paths(args.output, args.shards)
    written = str(path) if len(files) == 1 else f"{path} .. {files[-1].name} ({len(files)} shards)"
    size = sum(f.stat().st_size for f in files)
    mapped = resolve_type_map(type_map, args.layout)
    tables = mapped[ENGRAM_TABLE].name if ENGRAM_TABLE in mapped else table_type
    by_role = "".join(f", {role} {t.name}" for role, t in mapped.items() if role != ENGRAM_TABLE)
    moe = (f", MoE of {overrides['n_experts']} experts (top-{overrides['n_active']}) and the head" if args.moe
           else "")
    print(f"wrote {written} ({format_bytes(size)}) in {elapsed:.2f} s: preset {args.preset}, "
          f"weights {args.weight_type}{by_role}, engram tables {tables}, seed {args.seed}, layout {args.layout}{moe}")
    return 0


def add_info_command(p: Parser) -> None:
    from flashv41.memory import DEFAULT_MAX_TOKENS, TABLE_RESIDENCIES

    p.description = ("Load and validate a DeepSeek-V4.1 GGUF (llama.cpp, mxxm-t or ds4 layout) and describe it: "
                     "its configuration, layer roles, tensors and the memory an engine on it needs. Without "
                     "MODEL, the built-in tiny synthetic model (as `flashv41 run`).")
    p.add_argument("model", type=Path, nargs="?", default=None, metavar="MODEL.gguf",
                   help="the model (default: the built-in tiny model)")
    p.add_argument("--max-seq", type=at_least(1), default=None, metavar="N",
                   help="positions per sequence for the memory estimate, up to the model's context length "
                        "(default: the context length)")
    p.add_argument("--max-tokens", type=at_least(1), default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"tokens per forward chunk for the memory estimate (default {DEFAULT_MAX_TOKENS}, "
                        "as `flashv41 run`)")
    p.add_argument("--table-residency", choices=TABLE_RESIDENCIES, default="device",
                   help="where the engram tables live (default device)")
    p.set_defaults(handler=info_command)


def info_command(args: argparse.Namespace) -> int:
    from flashv41.memory import estimate_memory
    from flashv41.runner import open_model

    model = open_model(args.model)
    try:
        cfg = model.config
        max_seq = args.max_seq if args.max_seq is not None else cfg.context_length
        # first, so that a refused estimate prints its error alone, not after the whole listing
        estimate = estimate_memory(cfg, model.weights, max_seq, args.max_tokens, args.table_residency)
        print(describe_config(model))
        print()
        print(describe_roles(cfg))
        print()
        print(describe_tensors(model))
        print()
        print(estimate.table())
        if cfg.engram is not None:
            print()
            print(describe_residencies(cfg, model, max_seq, args.max_tokens))
    finally:
        model.close()
    return 0


def describe_residencies(cfg: ModelConfig, model: Model, max_seq: int, max_tokens: int) -> str:
    """One line per table residency: the device memory of an engine with one sequence, and the host
    memory its engram tables take beside it (`info`, whichever residency it was given)."""
    from flashv41.memory import TABLE_RESIDENCIES, estimate_memory, format_bytes

    lines = ["by table residency (one sequence):"]
    for residency in TABLE_RESIDENCIES:
        e = estimate_memory(cfg, model.weights, max_seq, max_tokens, residency)
        where = {"device": "", "pinned": f", {format_bytes(e.host_table_bytes)} of pinned host memory",
                 "host": f", tables read from the file ({format_bytes(e.host_table_bytes)})"}[residency]
        lines.append(f"  {residency:<7} {format_bytes(e.total_bytes(1)):>10} on the device{where}")
    return "\n".join(lines)


# ModelConfig fields by topic, for `info`; a field missing here still prints, under "other".
CONFIG_GROUPS: dict[str, tuple[str, ...]] = {
    "sizes": ("n_layers", "context_length", "vocab_size", "dim", "hc", "sinkhorn_iters"),
    "attention": ("n_heads", "head_dim", "rope_dim", "q_lora_rank", "window", "o_groups", "o_lora_rank",
                  "compress_ratios"),
    "indexer": ("index_heads", "index_head_dim", "index_topk"),
    "candidates": ("candidate_source", "candidate_block_size", "candidate_topk_blocks"),
    "epsilons": ("norm_eps", "hc_eps"),
    "rope": ("rope_theta", "compress_rope_theta", "rope_factor", "rope_original_ctx", "beta_fast",
             "beta_slow"),
}
CONFIG_SHOWN_ELSEWHERE = ("roles", "engram", "name", "layout", "ffn_norm", "moe", "head")


def _value(v: object) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(str(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def describe_config(model: Model) -> str:
    """The file (or the shards of a split set), then every ModelConfig field by topic, then the
    engram geometry."""
    import dataclasses

    from flashv41.host.config import ModelConfig
    from flashv41.host.gguf_layout import OLD_ENGRAM_PREFIX
    from flashv41.memory import format_bytes

    cfg = model.config
    files = model.weights.files
    size = sum(f.path.stat().st_size for f in files)
    lines = [f"{model.path.name}: {format_bytes(size)}, {len(model.weights.names())} tensors, "
             f"architecture {cfg.name} ({cfg.layout} layout)"]
    lines.append(f"  {'layout:':<12} {cfg.layout}")
    if len(files) == 1:
        lines.append(f"  {'files:':<12} 1 file")
    else:
        lines.append(f"  {'files:':<12} {len(files)} shards (split set)")
        width = max(len(f.path.name) for f in files)
        for f in files:
            lines.append(f"  {'':<12} {f.path.name:<{width}}  {f.n_tensors} tensors, "
                         f"{format_bytes(f.path.stat().st_size)}")
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in CONFIG_SHOWN_ELSEWHERE]
    grouped = {n for group in CONFIG_GROUPS.values() for n in group}
    groups = dict(CONFIG_GROUPS)
    other = tuple(n for n in names if n not in grouped)
    if other:
        groups["other"] = other
    for topic, fields in groups.items():
        lines.append(f"  {topic + ':':<12} " + ", ".join(f"{n} {_value(getattr(cfg, n))}" for n in fields))
    ffn = "ffn_norm (an FFN callback can run)" if cfg.ffn_norm else "no ffn_norm (the FFN is a zero output)"
    moe = f"MoE: {cfg.moe.describe()}" if cfg.moe is not None else "no MoE tensors"
    lines.append(f"  {'ffn:':<12} {ffn}; {moe}; {'a head (logits)' if cfg.head else 'no head (no logits)'}")
    e = cfg.engram
    if e is None:
        lines.append(f"  {'engram:':<12} none")
    else:
        unmapped = int((e.token_map < 0).sum())
        lines += [
            f"  {'engram:':<12} layers {_value(e.layer_ids)}, heads {e.n_heads}, head_dim {e.head_dim}, "
            f"max_ngram {e.max_ngram}, cols {e.cols}, pad_id {e.pad_id}",
            f"  {'':<12} token map {e.token_map.size} entries ({unmapped} unmapped, compressed vocab "
            f"{int(e.token_map.max()) + 1}), table rows {_value(e.table_rows)}",
        ]
        if e.rebuilt:
            lines.append(f"  {'':<12} engram tables: rebuilt from the file's tokenizer (old {OLD_ENGRAM_PREFIX}* "
                         "keys): token map, pad_id, primes, offsets, multipliers")
    return "\n".join(lines)


def describe_roles(cfg: ModelConfig) -> str:
    """One line per layer: its block type and the flags that make it."""
    def flag(b: bool) -> str:
        return "yes" if b else "-"

    header = ("layer", "block type", "ratio", "kv src", "index src", "cand. src", "uses cand.", "engram")
    rows = [(str(r.layer), r.block_type, str(r.ratio), flag(r.kv_source), flag(r.index_source),
             flag(r.candidate_source), flag(r.uses_candidates), flag(r.engram)) for r in cfg.roles]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["layer roles"]
    for row in (header, *rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _type_name(ggml_type: object) -> str:
    name = getattr(ggml_type, "name", None)
    if name is not None:
        return str(name)
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(ggml_type)).name  # type: ignore[call-overload]
    except ValueError:
        return f"type {ggml_type}"


def _split_name(name: str) -> tuple[int | None, str]:
    """`blk.3.attn_q_a.weight` -> (3, 'attn_q_a'); `token_embd.weight` -> (None, 'token_embd')."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        layer: int | None = int(parts[1])
        parts = parts[2:]
    else:
        layer = None
    if parts[-1] == "weight":
        parts = parts[:-1]
    return layer, ".".join(parts)


def describe_tensors(model: Model) -> str:
    """Every tensor in the file by layer: type, NumPy shape and stored bytes; unused ones marked."""
    from flashv41.host import gguf_layout as L
    from flashv41.memory import format_bytes

    cfg = model.config
    name_of = model.weights.name_of  # the role's name in the file's layout
    used = {name_of(None, L.TOKEN_EMBD)} | ({name_of(None, s.role) for s in L.HEAD_TENSORS} if cfg.head else set())
    host: set[str] = set()
    for r in cfg.roles:
        used.update(name_of(r.layer, s.role)
                    for s in L.layer_tensor_specs(r.ratio, r.kv_source, r.index_source, r.engram))
        if r.engram:
            used.add(name_of(r.layer, L.ENGRAM_TABLE))
        if cfg.ffn_norm:
            used.add(name_of(r.layer, L.FFN_NORM))
        if cfg.moe is not None:
            host.update(name_of(r.layer, s.role) for s in L.MOE_TENSORS)
    by_layer: dict[int | None, list[tuple[str, str, str, int, str]]] = {}
    for t in model.weights:
        layer, role = _split_name(t.name)
        shape = "[" + ", ".join(str(n) for n in t.shape) + "]"
        row = (role, _type_name(t.ggml_type), shape, t.nbytes, "" if t.name in used else "  h" if t.name in host
               else "  *")
        by_layer.setdefault(layer, []).append(row)
    role_width = max((len(row[0]) for rows in by_layer.values() for row in rows), default=10)
    shape_width = max((len(row[2]) for rows in by_layer.values() for row in rows), default=10)
    lines = ["tensors (shape in NumPy order [out, in]; bytes as stored; * = not used by flashv41; h = read on the "
             "host only, by flashv41.HostMoE)"]
    order = sorted(by_layer, key=lambda k: -1 if k is None else k)
    for layer in order:
        rows = by_layer[layer]
        total = format_bytes(sum(row[3] for row in rows))
        if layer is None:
            title = "model"
        else:
            title = f"layer {layer}"
            if layer < cfg.n_layers:
                title += f" ({cfg.roles[layer].block_type}{', engram' if cfg.roles[layer].engram else ''})"
        lines.append(f"  {title}: {len(rows)} tensor{'s' if len(rows) != 1 else ''}, {total}")
        for role, type_name, shape, nbytes, mark in rows:
            lines.append(f"    {role:<{role_width}}  {type_name:<5} {shape:<{shape_width}} "
                         f"{format_bytes(nbytes):>10}{mark}")
    return "\n".join(lines)


def add_bench_command(p: Parser) -> None:
    p.description = ("Run the benchmark rows of docs/performance.md on the GPU: the copy bandwidth first, then "
                     "every selected row with its median time, bytes, bound and ratio. Needs a CUDA GPU.")
    p.add_argument("--rows", nargs="+", default=[], metavar="PATTERN",
                   help="row names or fnmatch patterns to run (e.g. 'engram.wkv*'); default all but the "
                        "whole-stack prefills, which take minutes and run only when a pattern names them "
                        "(e.g. 'prefill.stack*')")
    p.add_argument("--weight-type", nargs="+", default=list(BENCH_DEFAULT_WEIGHT_TYPES), choices=BENCH_WEIGHT_TYPES,
                   dest="weight_types", help="weight types of the GEMV and step rows (default "
                                             f"{' '.join(BENCH_DEFAULT_WEIGHT_TYPES)})")
    p.add_argument("--reps", type=at_least(BENCH_MIN_REPS), default=BENCH_MIN_REPS, metavar="N",
                   help=f"timed repetitions per row, the median is reported (default and minimum {BENCH_MIN_REPS})")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--workdir", type=Path, default=BENCH_DEFAULT_WORKDIR, metavar="DIR",
                   help=f"where synthetic models for the rows are written and reused (default {BENCH_DEFAULT_WORKDIR})")
    p.set_defaults(handler=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    from flashv41.bench import BenchOptions, run

    options = BenchOptions(reps=args.reps, rows=tuple(args.rows), weight_types=tuple(args.weight_types),
                           workdir=args.workdir)
    run(options, args.json)
    return 0


def add_run_command(p: Parser) -> None:
    from flashv41.memory import TABLE_RESIDENCIES

    p.description = ("Prefill a prompt, decode N more tokens one at a time, and print the timings and "
                     "the final highway's statistics (the hidden state the last layer hands on; README.md, "
                     "'What run prints'). Without MODEL, the built-in tiny synthetic model (written once into "
                     "$FLASHV41_CACHE, $XDG_CACHE_HOME/flashv41 or ~/.cache/flashv41).")
    p.add_argument("model", type=Path, nargs="?", default=None, metavar="MODEL.gguf",
                   help="the model (default: the built-in tiny model)")
    p.add_argument("--oracle", action="store_true", help="run the NumPy oracle (CPU) instead of the GPU engine")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--tokens", type=token_list, default=None, metavar="ID,ID,...",
                        help="the prompt's token ids")
    prompt.add_argument("--prompt-len", type=at_least(1), default=8, metavar="N",
                        help="a random prompt of N tokens from --seed (default 8)")
    prompt.add_argument("--prompt", default=None, metavar="TEXT",
                        help="the prompt as text, encoded with the file's tokenizer (tokenizer.ggml.*; needs the "
                             "tokenizers package: the text extra)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--decode", type=at_least(0), default=4, metavar="N",
                       help="decode steps of random tokens after the prompt (default 4)")
    steps.add_argument("--generate", type=at_least(1), default=None, metavar="N",
                       help="decode N tokens greedily after the prompt (each the argmax of the head's logits, fed "
                            "back) and print their ids, and their text where the file has a tokenizer; the model "
                            "needs its head (without MODEL: the built-in tiny model with its MoE and head)")
    p.add_argument("--ffn", choices=("zero", "host-moe"), default="zero",
                   help="the FFN sublayer: zero (its output zero, default) or host-moe (the model's MoE computed "
                        "on the CPU by flashv41.HostMoE: exact, slow on a real model)")
    p.add_argument("--seed", type=at_least(0), default=0,
                   help="seed of the random prompt and decode tokens (default 0)")
    p.add_argument("--check", action="store_true",
                   help="also compare every layer's output with the NumPy oracle (exit 1 below cosine 0.99999)")
    p.add_argument("--table-residency", choices=TABLE_RESIDENCIES, default="device",
                   help="where the engine keeps the engram tables: device (default), pinned host memory, "
                        "or the file (host)")
    p.add_argument("--max-seq", type=at_least(1), default=None, metavar="N",
                   help="positions the sequence may hold, up to the model's context length (default: the "
                        "prompt's tokens and the decode steps, exactly)")
    p.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    from flashv41.runner import run_model

    return run_model(args.model, args.oracle, args.tokens, args.prompt_len, args.decode, args.seed,
                     check=args.check, table_residency=args.table_residency, max_seq=args.max_seq,
                     generate=args.generate, ffn=args.ffn, prompt_text=args.prompt)


# name, the line `flashv41 --help` shows, and the declarer of its arguments
SUBCOMMANDS: tuple[tuple[str, str, Callable[[Parser], None]], ...] = (
    ("synth", "write a synthetic V4.1 model (random weights, real layout) to a GGUF file", add_synth_command),
    ("info", "show a GGUF model's configuration, layer roles, tensors and memory estimate", add_info_command),
    ("run", "run one sequence (prefill, then decode or greedy generation) and summarise the final highway",
     add_run_command),
    ("bench", "time the stages on the GPU against their bounds (copy bandwidth, GEMVs, engram steps, hash; "
              "docs/performance.md)", add_bench_command),
)


def build_parser() -> Parser:
    """The parser, its subcommands named but not yet declared (Parser.declared)."""
    parser = Parser(
        prog="flashv41",
        description="DeepSeek-V4.1-Flash engram and attention layers on the GPU (Numba-CUDA), from GGUF files. "
                    "Token ids in; the last layer's hidden state, the head's logits and greedy tokens out; the MoE "
                    "is the caller's (an FFN callback), or computed on the CPU (--ffn host-moe). "
                    "Without a GPU the kernels run on Numba's CUDA simulator.",
    )
    parser.add_argument("--version", action="version", version=f"flashv41 {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_line, declare in SUBCOMMANDS:
        subparsers.add_parser(name, help=help_line, declare=declare)
    return parser


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's last flush of what
    is still buffered has nowhere to fail (a sys.stdout without a file, as in a test, is left be)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def guarded(prog: str, work: Callable[[], int]) -> int:
    """`work()`'s exit status, with what goes wrong said as every flashv41 command says it: a
    FlashError as `PROG: error: message` (2), an operating-system error likewise (1), Ctrl-C as
    `PROG: interrupted` (130), a closed pipe silently (141). The examples run their main through
    it, so they answer a missing model file as the command line does."""
    try:
        from flashv41.host.errors import FlashError

        try:
            status = work()
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            return status
        except FlashError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        # the reader went away (`flashv41 info | head`): nothing more to say, and nowhere to say it
        _quiet_stdout()
        return BROKEN_PIPE
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # the work's finally blocks have run by now: files closed, partial writes removed
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    def command() -> int:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version and usage errors: hand back argparse's status
            return exc.code if isinstance(exc.code, int) else 2
        return int(args.handler(args))

    return guarded("flashv41", command)
