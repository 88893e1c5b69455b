"""Benchmark rows of the engram sublayer (docs/performance.md P1, P3 and P6) at V4.1-Flash dimensions.

- `engram.wkv_gemv.<type>` (P1): the engram projection for one token, [dim * (hc + 1), cols * 256]
  = [25600, 6144] (157.3 M weights) read from its stored blocks; bound = stored bytes / copy
  bandwidth. The weights are random stored blocks: a GEMV's time does not depend on the values.
- `engram.step.<type>.device` and `.pinned` (P3): one decode step's device work (rows kernel, wkv
  GEMV, gate) queued behind a sleeping kernel so that Python's launch cost is excluded, as in a
  replayed graph, the table on the device or in pinned host memory; bound = wkv bytes / copy
  bandwidth + the token's row bytes / the bandwidth they cross (the copy bandwidth, or for pinned
  tables the host link's, measured once in the same run: `copy.host_link`, a pinned
  host-to-device copy of HOST_LINK_BYTES, in the first case that needs it).
- `engram.step.<type>.<residency>.python` (P3): whole steps as Python issues them back to back
  (hash, row upload, the three kernels), launch cost included: what the engine gets without a
  graph.
- `engram.step.real.<residency>` (P3 at V4.1-Flash's real table size, issue 18): the same decode
  step on a one-layer model whose table has the official first table's 384,006,168 Q2_K rows
  (32.3 GB, a sparse file: holes read as zero rows, which a gather reads as any other), so the
  rows are gathered from the whole range; for `host` tables the Python step (the device part
  needs rows uploaded by the host). Beside it `.prefill4k`: one 4,096-token chunk through `apply`
  (hash ids uploaded, rows, wkv GEMM, gate), bound = its GEMM at the tensor cores' peak plus its
  rows over their link. The setup (upload, pinning) time is in the note.
- `engram.rows.device`, `engram.gate`: the row gather + dequantisation and the gate alone, device
  work of one token; bound = the bytes they move / copy bandwidth (both are latency-bound at one
  token).
- `engram.hash.64k` (P6): host.engram_hash_fast on a 64k-token prefill with the flash preset's two
  engram layers, host clock; bound = the target rate (20 M token-layers/s), so ratio <= 1 meets it.

The step rows run an EngramStage on a one-layer flash-dimension model written once into the
options' work directory (Q8_0 weights, a Q2_K table of a few million rows). For another wkv type
the stage's wkv is swapped for random stored blocks of that type and shape.

L2 (50 MB on the H200; a row under 4x L2 must not be timed from it):
- `engram.wkv_gemv`: the Q8_0 (167 MB) and Q2_K (52 MB) weights are under 4x L2: the row makes
  copies of the weight (4x L2 in all) and each call reads the next one. The BF16 weight
  (315 MB) is past 4x L2 and is timed back to back.
- `engram.step.*` (device and python), `engram.rows.device`, `engram.gate`: a stage cannot swap
  in a weight copy per call, so when the row's bytes are under 4x L2 (all but the BF16 steps),
  the L2 is evicted before every repetition by reading 3x L2 with the read-only kernel, and each
  repetition is timed alone with its own pair of events (the eviction outside them).
- `engram.hash.64k`: host work, nothing on the device.
The JSON's `l2` of each row says which was done.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flashv41.bench.core import (
    HOST,
    PEAK_TFLOPS,
    BenchCase,
    BenchContext,
    BenchOptions,
    BenchRow,
    device_copy,
    device_time,
    host_time,
)
from flashv41.host.config import EngramConfig
from flashv41.host.engram_tables import engram_multipliers, engram_offsets, engram_primes, stub_token_map
from flashv41.host.quants import FORMATS, GGMLType, ggml_type, random_blocks
from flashv41.host.synth import REAL_ENGRAM_VOCAB, preset
from flashv41.memory import TABLE_PLACES

HASH_TOKENS = 65536
HASH_TARGET = 20e6  # token-layers per second (docs/performance.md P6)
STEP_TABLE_ROWS = 3_000_000
# the flash preset cut to one window-only layer with engram: the smallest file with a real engram layer
STEP_MODEL: dict[str, Any] = dict(compress_ratios=(0,), kv_sources=(), index_sources=(), candidate_source=99,
                                  engram_layers=(0,), vocab=1024, engram_rows=STEP_TABLE_ROWS)
# the same layer with the real first table (384,006,168 rows), written as a hole
REAL_MODEL: dict[str, Any] = {**{k: v for k, v in STEP_MODEL.items() if k != "engram_rows"},
                              "engram_vocab_size": REAL_ENGRAM_VOCAB, "holes": "tables"}
PREFILL_TOKENS = 4096


def engram_config(preset_name: str, **overrides) -> EngramConfig:
    """The EngramConfig a synthetic model of this preset carries (host.synth.write_synthetic's
    tables), built without writing the file."""
    p = preset(preset_name, **overrides)
    n = len(p.engram_layers)
    primes = engram_primes(n, p.max_ngram, p.engram_heads, p.engram_vocab_size)
    token_map, compressed = stub_token_map(p.vocab, p.unmapped_tail)
    return EngramConfig(
        layer_ids=tuple(p.engram_layers), n_heads=p.engram_heads, head_dim=p.engram_head_dim,
        max_ngram=p.max_ngram, multipliers=engram_multipliers(p.engram_layers, p.max_ngram, compressed),
        primes=primes, offsets=engram_offsets(primes), token_map=token_map,
        pad_id=int(token_map[p.engram_pad_token]), table_rows=tuple(int(primes[i].sum()) for i in range(n)),
    )


def random_stored(n: int, k: int, gtype: GGMLType, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: random but finite stored rows of `gtype`: for Q8_0, Q2_K and BF16 values
    of RMS about k^-0.5, drawn straight in the stored format (fast at flash sizes); for the other
    types host.quants.random_blocks' valid blocks (a GEMV's time does not depend on the values)."""
    fmt = FORMATS[gtype]
    if gtype == GGMLType.Q8_0:
        blocks = np.zeros(n * k // fmt.block_values, fmt.block)
        blocks["d"] = np.float16(k**-0.5 / 73)  # uniform levels in [-127, 127]: RMS about 73
        blocks["qs"] = rng.integers(-127, 128, size=blocks["qs"].shape, dtype=np.int8)
    elif gtype == GGMLType.Q2_K:
        blocks = np.zeros(n * k // fmt.block_values, fmt.block)
        blocks["scales"] = rng.integers(0, 256, size=blocks["scales"].shape, dtype=np.uint8)
        blocks["qs"] = rng.integers(0, 256, size=blocks["qs"].shape, dtype=np.uint8)
        blocks["d"] = np.float16(k**-0.5 / 14)
        blocks["dmin"] = np.float16(k**-0.5 / 14)
    elif gtype == GGMLType.BF16:
        values = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(k**-0.5)).view(np.uint32)
        return (values >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    else:
        return random_blocks(gtype, n, k, rng)
    return blocks.view(np.uint8).reshape(n, -1)


def copy_weight(w, stream):
    """A copy of DeviceWeight `w` in new device memory (a rotation copy of the bench's L2 policy)."""
    return dataclasses.replace(w, data=device_copy(w.data, stream))


def _random_weight(name: str, n: int, k: int, gtype: GGMLType, stream):
    from flashv41.stages.linear import DeviceWeight

    stored = random_stored(n, k, gtype, np.random.default_rng(int(gtype)))
    return DeviceWeight.from_stored(name, gtype, stored, k, stream)


def _flash_shapes() -> tuple[int, int, int]:
    """(dim, hc, cols * head_dim) of the flash preset."""
    p = preset("flash")
    return p.dim, p.hc, (p.max_ngram - 1) * p.engram_heads * p.engram_head_dim


def gemv_case(wtype: str) -> BenchCase:
    gtype = ggml_type(wtype)

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.stages.linear import linear

        dim, hc, k = _flash_shapes()
        n = dim * (hc + 1)
        stream = cuda.stream()
        w = _random_weight("engram_wkv", n, k, gtype, stream)
        rng = np.random.default_rng(1)
        x = cuda.to_device(rng.integers(0x3C00, 0x3F80, size=(1, k), dtype=np.uint16), stream=stream)
        y = cuda.device_array((1, n), np.uint16, stream=stream)
        def product(v: Any) -> None:
            linear(x, v, y, 1, stream=stream)

        median, plan = ctx.rotated_time(w, lambda v: copy_weight(v, stream), product, w.nbytes, stream,
                                        prepare=product)  # each copy run once: imma's workspace, if picked
        return [BenchRow(f"engram.wkv_gemv.{wtype}", median, ctx.memory_bound(w.nbytes), bytes=w.nbytes,
                         note=f"[{n}, {k}] {wtype}, 1 token: {w.nbytes / median / ctx.copy_bandwidth:.0%} of copy "
                              "bandwidth", l2=plan)]

    return BenchCase(f"engram.wkv_gemv.{wtype}", run)


_MODELS: dict[str, object] = {}


def step_model(options: BenchOptions, real: bool = False):
    """The one-layer flash-dimension model of the step rows (real: with the real-size table),
    written once per work directory."""
    import flashv41
    from flashv41.host.synth import write_synthetic

    path = options.workdir / ("flash-engram-real.gguf" if real else f"flash-engram-{STEP_TABLE_ROWS}.gguf")
    key = str(path)
    if key not in _MODELS:
        if not path.exists():
            layout = REAL_MODEL if real else STEP_MODEL
            write_synthetic(path, "flash", weight_type="Q8_0", table_type="Q2_K", **layout)
        _MODELS[key] = flashv41.load_model(path)
    return _MODELS[key]


HOST_LINK_BYTES = 256 << 20  # the pinned host-to-device copy that measures the host link


def host_link_seconds(ctx: BenchContext, rows: list[BenchRow]) -> float:
    """Seconds a byte takes over the host link (what a pinned or host table's rows cross), from the
    run's `copy.host_link` row: measured by the first case that needs it, which adds the row to its
    `rows`; later cases read it from the run's rows."""
    link = next((r for r in ctx.rows + rows if r.name == "copy.host_link"), None)
    if link is None:
        link = host_link_row(ctx)
        rows.append(link)
    return link.median_s / HOST_LINK_BYTES


def host_link_row(ctx: BenchContext) -> BenchRow:
    """`copy.host_link`: the median device time of a pinned host-to-device copy of HOST_LINK_BYTES;
    not a ratio (bound = its own time)."""
    from numba import cuda

    stream = cuda.stream()
    host = cuda.pinned_array(HOST_LINK_BYTES, np.uint8)
    dev = cuda.device_array(HOST_LINK_BYTES, np.uint8, stream=stream)
    median = device_time(lambda: dev.copy_to_device(host, stream=stream), ctx.options.reps, ctx.options.warmup,
                         stream, n=4)
    return BenchRow("copy.host_link", median, median, bytes=HOST_LINK_BYTES,
                    note=f"pinned host-to-device copy, {HOST_LINK_BYTES >> 20} MiB: "
                         f"{HOST_LINK_BYTES / median / 1e9:.1f} GB/s", l2=HOST)


def step_case(wtype: str, residency: str) -> BenchCase:
    gtype = ggml_type(wtype)
    name = f"engram.step.{wtype}.{residency}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.host.engram_hash_fast import FastEngramHasher
        from flashv41.stages.engram import EngramStage

        model = step_model(ctx.options)
        cfg = model.config
        assert cfg.engram is not None
        layer = cfg.engram.layer_ids[0]
        stream = cuda.stream()
        stage = EngramStage(model, 8, residency, stream=stream)
        try:
            weights = stage.layers[layer]
            if weights.wkv.gtype != gtype:
                weights.wkv = _random_weight(weights.wkv.name, weights.wkv.n, weights.wkv.k, gtype, stream)
            hasher = FastEngramHasher(cfg.engram, 64)
            rng = np.random.default_rng(2)
            hasher.hash(rng.integers(0, cfg.vocab_size, 16), 0)
            token = np.array([5], np.int64)
            h = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim), dtype=np.float32), stream=stream)
            row_bytes = cfg.engram.cols * weights.table.row_bytes
            nbytes = weights.wkv.nbytes + row_bytes
            rows: list[BenchRow] = []
            bound = ctx.memory_bound(nbytes)
            if residency == "pinned":
                bound = ctx.memory_bound(weights.wkv.nbytes) + row_bytes * host_link_seconds(ctx, rows)

            def python_step() -> None:
                ids = hasher.hash(token, 16)[:, 0]
                stage.apply(layer, h, ids, 1)

            if residency in ("device", "pinned"):
                stage.upload_rows(layer, hasher.hash(token, 16)[:, 0], 1)

                median, plan = ctx.stage_time(lambda: stage.run(layer, h, 1), nbytes, stream)
                where = "" if residency == "device" else ", the rows read from pinned host memory"
                rows.append(BenchRow(name, median, bound, bytes=nbytes,
                                     note=f"rows + wkv {wtype} + gate, 1 token, launch cost excluded{where}", l2=plan))
                if gtype == GGMLType.Q8_0 and residency == "device":  # the two small stages once (any wkv type)
                    # rows: the token's table rows read, 256 bf16 values each written
                    moved = row_bytes + cfg.engram.cols * cfg.engram.head_dim * 2
                    median, plan = ctx.stage_time(lambda: stage.dequantize_rows(layer, 1), moved, stream)
                    rows.append(BenchRow("engram.rows.device", median, ctx.memory_bound(moved), bytes=moved,
                                         note=f"gather + dequantise {cfg.engram.cols} Q2_K rows to bf16, 1 token",
                                         l2=plan))
                    # gate: the highway read and written, the key/value row read
                    moved = 2 * cfg.hc * cfg.dim * 4 + (cfg.hc + 1) * cfg.dim * 2 + cfg.hc * cfg.dim * 4
                    median, plan = ctx.stage_time(lambda: stage.gate(layer, h, 1), moved, stream)
                    rows.append(BenchRow("engram.gate", median, ctx.memory_bound(moved), bytes=moved,
                                         note="normalised dot, signed-sqrt sigmoid, h += g * value, 1 token",
                                         l2=plan))
            median, plan = ctx.python_time(python_step, nbytes, stream)
            rows.append(BenchRow(f"{name}.python", median, bound, bytes=nbytes,
                                 note=f"hash + apply, {residency} table, from Python", l2=plan))
            return rows
        finally:
            stage.free()

    return BenchCase(name, run)


def real_case(residency: str) -> BenchCase:
    name = f"engram.step.real.{residency}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        import time

        from numba import cuda

        from flashv41.host.engram_hash_fast import FastEngramHasher
        from flashv41.stages.engram import EngramStage

        model = step_model(ctx.options, real=True)
        cfg = model.config
        assert cfg.engram is not None
        layer = cfg.engram.layer_ids[0]
        stream = cuda.stream()
        start = time.perf_counter()
        stage = EngramStage(model, PREFILL_TOKENS, residency, stream=stream)
        stream.synchronize()
        setup_s = time.perf_counter() - start
        try:
            weights = stage.layers[layer]
            table = weights.table
            rng = np.random.default_rng(4)
            hasher = FastEngramHasher(cfg.engram, PREFILL_TOKENS + 64)
            prompt = rng.integers(0, cfg.vocab_size, PREFILL_TOKENS)
            prefill_ids = hasher.hash(prompt, 0)[:, 0]
            token = np.array([5], np.int64)
            decode_ids = hasher.hash(token, PREFILL_TOKENS)[:, 0]
            h = cuda.to_device(rng.standard_normal((PREFILL_TOKENS, cfg.hc, cfg.dim), dtype=np.float32),
                               stream=stream)
            row_bytes = cfg.engram.cols * table.row_bytes
            wkv = weights.wkv.nbytes
            rows: list[BenchRow] = []
            # seconds a row byte takes over the bandwidth it crosses
            link_s = 1 / ctx.copy_bandwidth if residency == "device" else host_link_seconds(ctx, rows)
            where = TABLE_PLACES[residency]
            size = table.rows * table.row_bytes / 1e9
            setup = f"{table.rows:,} rows ({size:.1f} GB) {where}, set up in {setup_s:.1f} s"
            bound = ctx.memory_bound(wkv) + row_bytes * link_s
            if residency in ("device", "pinned"):
                stage.upload_rows(layer, decode_ids, 1)
                median, plan = ctx.stage_time(lambda: stage.run(layer, h, 1), wkv + row_bytes, stream)
                rows.append(BenchRow(name, median, bound, bytes=wkv + row_bytes,
                                     note=f"rows + wkv Q8_0 + gate, 1 token, launch cost excluded; {setup}", l2=plan))
            else:
                median, plan = ctx.python_time(lambda: stage.apply(layer, h, decode_ids, 1), wkv + row_bytes, stream)
                rows.append(BenchRow(name, median, bound, bytes=wkv + row_bytes,
                                     note=f"hash ids -> rows read and uploaded + wkv Q8_0 + gate, 1 token, from "
                                          f"Python; {setup}", l2=plan))
            n, k = weights.wkv.n, weights.wkv.k
            moved = wkv + PREFILL_TOKENS * row_bytes
            prefill_bound = 2 * PREFILL_TOKENS * n * k / (PEAK_TFLOPS * 1e12) + PREFILL_TOKENS * row_bytes * link_s
            median, plan = ctx.python_time(lambda: stage.apply(layer, h, prefill_ids, PREFILL_TOKENS), moved, stream)
            rows.append(BenchRow(f"{name}.prefill4k", median, prefill_bound, bytes=moved,
                                 note=f"apply on {PREFILL_TOKENS} tokens ({PREFILL_TOKENS * row_bytes / 1e6:.1f} MB "
                                      f"of rows {where}); bound = the wkv GEMM at {PEAK_TFLOPS:.0f} TFLOP/s + "
                                      "the rows over their link", l2=plan))
            return rows
        finally:
            stage.free()

    return BenchCase(name, run)


def hash_case() -> BenchCase:
    def run(ctx: BenchContext) -> list[BenchRow]:
        from flashv41.host.engram_hash_fast import FastEngramHasher

        cfg = engram_config("flash")
        ids = np.random.default_rng(3).integers(0, cfg.token_map.shape[0], HASH_TOKENS)
        hasher = FastEngramHasher(cfg, HASH_TOKENS)
        median = host_time(lambda: hasher.hash(ids, 0), ctx.options.reps, ctx.options.warmup)
        work = HASH_TOKENS * len(cfg.layer_ids)
        return [BenchRow("engram.hash.64k", median, work / HASH_TARGET,
                         note=f"host: {work / median / 1e6:.1f} M token-layers/s ({HASH_TOKENS} tokens x "
                              f"{len(cfg.layer_ids)} layers x {cfg.cols} cols); bound = the 20 M/s target",
                         l2=HOST)]

    return BenchCase("engram.hash.64k", run)


def cases(options: BenchOptions) -> list[BenchCase]:
    """Every engram row for the options' weight types."""
    for wtype in options.weight_types:
        ggml_type(wtype)  # an UnsupportedError naming the supported types for any other
    out = [gemv_case(w) for w in options.weight_types]
    out += [step_case(w, r) for w in options.weight_types for r in ("device", "pinned", "host")]
    out += [real_case(r) for r in ("device", "pinned", "host")]
    out.append(hash_case())
    return out
