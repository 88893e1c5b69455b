"""The indexer's top-k selection spread over the GPU: a radix select over slices of each row.

stages.indexer.select ranks items by 16-bit keys (score_key: unsigned key order == score order,
-0 and +0 one key, -inf the lowest) and keeps the k largest, ties to the lower index: the top
positions of a row, and on the candidate source first the top candidate blocks (a block's key is
the max key of its visible positions, the newest visible block pinned at +inf, kept only if above
-inf). This module holds those keys, the block-wide scan and digit search, one block's whole
selection (`one_block_top_k`: 16 / radix_bits histogram passes over the items, then an ordered
compaction; stages.indexer.select_kernel runs it a row a block), and the split path that decode
rows take (few rows: one block a row would leave the GPU idle).

The split path. Each (problem, row) is cut into S contiguous slices of ceil(n / S) items, one
block each (grid (S, T, P); P = 2 problems on the candidate source, its blocks and its positions,
which are independent, else 1). n is read on the device off `positions`, so S only shapes the
grid: a graph captured for the whole cache still does what its position needs. Three kernels:
- digit 0 (`digit_kernel(.., 0, ..)`): each slice's histogram of the keys' high bytes, added into
  the row's histogram in `SelectWorkspace.hist` with integer atomics (exact in any order); the
  last slice to finish (an atomic count in `done`, after a fence) reads and clears the histogram
  and finds the high byte b1 of the k-th largest key and how many of the k lie above its bin;
- digit 1: the same for the low byte among keys whose high byte is b1, giving tau (the k-th
  largest key) and `need` (how many keys equal to tau are taken). Each slice also leaves in
  `SelectWorkspace.slice_counts` its count of keys above b1's bin and its low-byte counts as suffix sums,
  so that its count above tau and at tau are two reads once tau is known;
- write (`write_kernel`): each slice sums the counts of the slices before it (above tau, at tau),
  then compacts its own items in order (a block-wide prefix over per-thread runs) and writes the
  items above tau plus the first `need` ties at tau in index order: (key desc, index asc), the
  positions ascending and -1 padded, or the candidate blocks' flags.
A (problem, row) whose keys read at most SPLIT_MIN_READS scores is instead selected whole by its
first slice in the digit-0 kernel (one_block_top_k), the later kernels returning at once for it: at small widths
that costs less than the split path's round trips (the fence, the count, the reads of the totals).
The histogram and counter are left zero for the next call, so no launch clears them (and the
writes stay inside the selection even if they were not). The result equals the one-block
kernel's (stages.indexer.select_kernel) and the oracle's exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, int32, int64, uint32

from flashv41.host.errors import InputError
from flashv41.stages.device import SIM, WARP, DeviceArray, device, jit_kernel

NEG_KEY = 0x007F  # the key of -inf
POS_KEY = 0xFF80  # the key of +inf
NO_KEY = 0x10000  # above every key: the threshold of a selection of nothing
POSITIONS, MASKED, BLOCKS = 0, 1, 2  # what a top-k pass ranks
DIGIT_BITS = 8  # the split path's radix: two digits of a 16-bit key
DIGIT_BINS = 1 << DIGIT_BITS
SPLIT_THREADS = 1 if SIM else 256
SPLIT_ROWS = 64  # rows up to this many take the split path (a batch of sequences' tokens, decode)
SLICE_ITEMS = 4 if SIM else 256  # items a slice covers at the width the host knows, before the cap
# a (problem, row) whose keys read at most this many scores (its width read on the device; a block
# key reads blk) is selected whole by its first slice in the digit-0 kernel, one_block_top_k's
# passes (the other slices and the later kernels return at once): at small widths a block's few
# passes cost less than the split kernels' round trips
SPLIT_MIN_READS = 4 if SIM else 4096
# slices of all rows and problems together: at most SPLIT_BLOCKS_PER_SM blocks a multiprocessor
SPLIT_BLOCKS_PER_SM = 2
# the per-row state the digit kernels leave for the next: the high byte b1 of the k-th key, how
# many of the k remain inside b1's bin, then tau and how many ties at tau are taken
ROW_HIGH, ROW_REMAIN, ROW_TAU, ROW_NEED = 0, 1, 2, 3
SLICE_ABOVE = DIGIT_BINS  # a slice's count of keys above b1's bin, after its DIGIT_BINS suffix sums


@device
def score_key(bits):
    """A bf16 score's 16-bit key: unsigned key order == score order; -0 and +0 share one key."""
    b = uint32(bits)
    if b == 0x8000:
        b = uint32(0)
    if b & 0x8000:
        return int64((~b) & 0xFFFF)
    return int64(b | 0x8000)


@device
def item_key(mode, score, cand, t, i, visible, blk):
    """The key of item i of row t: position i (mode POSITIONS / MASKED: a position in a block that
    cand[t] does not keep ranks as -inf) or candidate block i of blk positions (BLOCKS)."""
    if mode == BLOCKS:
        if visible >= 1 and i == (visible - 1) // blk:
            return int64(POS_KEY)
        best = int64(NEG_KEY)
        for g in range(i * blk, min(i * blk + blk, visible)):
            best = max(best, score_key(score[t, g]))
        return best
    if mode == MASKED and cand[t, i // blk] == 0:
        return int64(NEG_KEY)
    return score_key(score[t, i])


@cache
def block_scan(threads: int):
    """scan(v, buf, tid) -> (sum of v over the threads before tid, sum over all threads), int64;
    buf: shared int64 [threads]. Every thread of the block calls it. On the GPU, for whole warps,
    each warp scans with shuffles and the warps' totals meet in buf (two barriers); else (the
    simulator has no shuffles) a scan in buf, log2(threads) steps of two barriers."""
    sync = threads > 1
    if not SIM and threads % WARP == 0:
        return warp_block_scan(threads)

    @cuda.jit(device=True)  # a device function on the simulator too: it synchronises
    def scan(v, buf, tid):
        if not sync:
            return int64(0), v
        buf[tid] = v
        cuda.syncthreads()
        off = 1
        while off < threads:
            add = buf[tid - off] if tid >= off else int64(0)
            cuda.syncthreads()
            buf[tid] += add
            cuda.syncthreads()
            off *= 2
        incl = buf[tid]
        total = buf[threads - 1]
        cuda.syncthreads()  # buf is free again
        return incl - v, total

    return scan


def warp_block_scan(threads: int):
    """block_scan's GPU form for a block of whole warps."""
    warps = threads // WARP

    @cuda.jit(device=True)
    def scan(v, buf, tid):
        lane = tid % WARP
        warp = tid // WARP
        incl = v
        off = 1
        while off < WARP:
            up = cuda.shfl_up_sync(0xFFFFFFFF, incl, off)
            if lane >= off:
                incl += up
            off *= 2
        if lane == WARP - 1:
            buf[warp] = incl
        cuda.syncthreads()
        base = int64(0)
        total = int64(0)
        for w in range(warps):
            part = buf[w]
            if w < warp:
                base += part
            total += part
        cuda.syncthreads()  # buf is free again
        return base + incl - v, total

    return scan


@cache
def descending_ranks(threads: int, bins: int):
    """ranks(hist, buf, tid) -> (r0, r1, above): of the counts hist[0 .. bins-1] ranked in
    descending bin order (rank r is bin bins - 1 - r), thread tid's ranks r0 .. r1 - 1 (tid *
    per_thread on) and the count in the ranks before them (a block scan). Every thread calls it."""
    scan = block_scan(threads)
    per_thread = max(1, bins // threads)

    @cuda.jit(device=True)  # a device function on the simulator too: it synchronises
    def ranks(hist, buf, tid):
        r0 = min(tid * per_thread, bins)
        r1 = min(r0 + per_thread, bins)
        local = int64(0)
        for r in range(r0, r1):
            local += hist[bins - 1 - r]
        above, _ = scan(local, buf, tid)
        return r0, r1, above

    return ranks


@cache
def digit_search(threads: int, bins: int):
    """search(hist, k_rem, buf, found, tid): of the counts hist[0 .. bins-1] of one digit's values,
    the bin holding the k_rem-th largest (1 <= k_rem <= the total) into found[0] and the count in
    the bins above it into found[1]. Every thread calls it; found is ready when it returns."""
    ranks = descending_ranks(threads, bins)

    @cuda.jit(device=True)  # a device function on the simulator too: it synchronises
    def search(hist, k_rem, buf, found, tid):
        r0, r1, c = ranks(hist, buf, tid)
        for r in range(r0, r1):
            h = hist[bins - 1 - r]
            if c < k_rem and k_rem <= c + h:
                found[0] = bins - 1 - r
                found[1] = c
            c += h
        if threads > 1:
            cuda.syncthreads()

    return search


@cache
def one_block_top_k(threads: int, radix_bits: int):
    """top_k(mode, score, cand, sel, t, n, k, visible, blk, finite_only, hist, buf, found, tid): one
    block's whole selection of row t's items 0..n-1 (16 / radix_bits histogram passes over all of
    them, then a block-wide prefix over per-thread segments); hist: shared int32 [2^radix_bits]."""
    nt = threads
    sync = nt > 1
    bins = 1 << radix_bits
    passes = 16 // radix_bits
    scan = block_scan(nt)
    search = digit_search(nt, bins)

    @cuda.jit(device=True)  # a device function on the simulator too: it synchronises
    def top_k(mode, score, cand, sel, t, n, k, visible, blk, finite_only, hist, buf, found, tid):
        """The k items of 0..n-1 with the largest keys, ties to the lower index. BLOCKS: cand[t, i] =
        kept (kept items must also be above -inf); else: sel[t] = the items ascending, -1 padded."""
        prefix = int64(0)
        prefix_mask = int64(0)
        k_rem = int64(k)
        above = int64(0)
        if k > 0:
            for ps in range(passes):
                shift = 16 - radix_bits * (ps + 1)
                for b in range(tid, bins, nt):
                    hist[b] = 0
                if sync:
                    cuda.syncthreads()
                for i in range(tid, n, nt):
                    key = item_key(mode, score, cand, t, i, visible, blk)
                    if (key & prefix_mask) == prefix:
                        cuda.atomic.add(hist, int32((key >> shift) & (bins - 1)), 1)
                if sync:
                    cuda.syncthreads()
                search(hist, k_rem, buf, found, tid)
                prefix |= found[0] << shift
                prefix_mask |= (bins - 1) << shift
                above += found[1]
                k_rem -= found[1]
        tau = prefix
        need = k_rem  # how many keys equal to tau to take, lowest indices first
        if k == 0 or (finite_only and tau == NEG_KEY):
            need = int64(0)
        seg = (n + nt - 1) // nt
        lo = min(tid * seg, n)
        hi = min(lo + seg, n)
        n_gt = int64(0)
        n_eq = int64(0)
        for i in range(lo, hi):
            key = item_key(mode, score, cand, t, i, visible, blk)
            if k > 0 and key > tau:
                n_gt += 1
            elif k > 0 and key == tau:
                n_eq += 1
        excl, _ = scan((n_gt << 32) | n_eq, buf, tid)
        eq_before = excl & 0xFFFFFFFF
        o = (excl >> 32) + min(eq_before, need)
        tie = eq_before
        for i in range(lo, hi):
            key = item_key(mode, score, cand, t, i, visible, blk)
            take = k > 0 and key > tau
            if k > 0 and key == tau:
                take = tie < need
                tie += 1
            if mode == BLOCKS:
                cand[t, i] = 1 if take else 0
            elif take:
                sel[t, o] = i
                o += 1
        if mode != BLOCKS:
            for i in range(above + need + tid, sel.shape[1], nt):
                sel[t, i] = -1

    return top_k


@device
def problem(z, t, positions, n_tokens, ratio, own_rows, candidate_source, masked, blk, topk, topk_blocks):
    """Problem z of row t: (mode, items n, k, the row's visible positions). On the candidate source
    problem 0 is its blocks (those of the widest row's width, or of the row's own on own_rows)."""
    visible = (positions[t] + 1) // ratio
    if candidate_source and z == 0:
        width = (positions[t if own_rows else n_tokens - 1] + 1) // ratio
        nb = (width + blk - 1) // blk
        return BLOCKS, nb, min(topk_blocks, nb), visible
    return (MASKED if masked else POSITIONS), visible, min(topk, visible), visible


@device
def whole_in_one(mode, n, blk):
    """Whether a problem of n items is one block's (SPLIT_MIN_READS)."""
    return n * (blk if mode == BLOCKS else 1) <= SPLIT_MIN_READS


@device
def slice_range(n, s, slices):
    """Slice s of `slices` over items 0..n-1: [lo, hi)."""
    seg = (n + slices - 1) // slices
    lo = min(s * seg, n)
    return lo, min(lo + seg, n)


@cache
def digit_kernel(threads: int, digit: int, own_rows: bool):
    """Grid (S, T, P), `threads` threads a block: slice blockIdx.x of problem blockIdx.z of row
    blockIdx.y adds its histogram of digit `digit` (0: the high byte; 1: the low byte of keys whose
    high byte is the row's b1) into hist; the last slice finds the digit of the k-th largest key."""
    nt = threads
    sync = nt > 1
    search = digit_search(nt, DIGIT_BINS)
    ranks = descending_ranks(nt, DIGIT_BINS)
    whole = one_block_top_k(nt, DIGIT_BITS)

    @jit_kernel(nt)
    def kernel(score, cand, positions, n_tokens, ratio, candidate_source, masked, blk, sel, topk_blocks,
               hist, done, row_state, slice_counts):
        # score bf16 [T, >= G], cand uint8 [T, >= NB]; hist int32 [P * T, 256], done int32 [P * T],
        # row_state int32 [P * T, 4], slice_counts int32 [>= P * T * S, 257]
        local = cuda.shared.array(DIGIT_BINS, int32)  # [256]: this slice's digit counts, then the row's
        buf = cuda.shared.array(nt, int64)  # [threads]: the scans'
        found = cuda.shared.array(2, int64)  # the k-th key's digit bin, the count above it
        last = cuda.shared.array(1, int32)  # this slice finished the row's histogram
        above_bin = cuda.shared.array(1, int32)  # digit 1: this slice's keys above b1's bin
        s, t, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        slices = cuda.gridDim.x
        tid = cuda.threadIdx.x
        row = z * n_tokens + t
        mode, n, k, visible = problem(z, t, positions, n_tokens, ratio, own_rows, candidate_source, masked, blk,
                                      sel.shape[1], topk_blocks)
        if whole_in_one(mode, n, blk):
            if digit == 0 and s == 0:
                whole(mode, score, cand, sel, t, n, k, visible, blk, mode == BLOCKS, local, buf, found, tid)
            return
        lo, hi = slice_range(n, s, slices)
        for b in range(tid, DIGIT_BINS, nt):
            local[b] = 0
        if tid == 0:
            above_bin[0] = 0
        if sync:
            cuda.syncthreads()
        high = int64(row_state[row, ROW_HIGH]) if digit == 1 else int64(0)
        above = int64(0)
        for i in range(lo + tid, hi, nt):
            key = item_key(mode, score, cand, t, i, visible, blk)
            if digit == 0:
                cuda.atomic.add(local, int32(key >> DIGIT_BITS), 1)
            elif (key >> DIGIT_BITS) > high:
                above += 1
            elif (key >> DIGIT_BITS) == high:
                cuda.atomic.add(local, int32(key & (DIGIT_BINS - 1)), 1)
        if above != 0:
            cuda.atomic.add(above_bin, 0, int32(above))
        if sync:
            cuda.syncthreads()
        for b in range(tid, DIGIT_BINS, nt):
            if local[b] != 0:
                cuda.atomic.add(hist, (row, b), local[b])
        if digit == 1:
            # this slice's counts for the write kernel: keys above b1's bin, and per low byte b the
            # keys in b1's bin at or above b (ranks in descending order, as digit_search holds them)
            slot = row * slices + s
            r0, r1, c = ranks(local, buf, tid)
            for r in range(r0, r1):
                c += local[DIGIT_BINS - 1 - r]
                slice_counts[slot, DIGIT_BINS - 1 - r] = int32(c)
            if tid == 0:
                slice_counts[slot, SLICE_ABOVE] = above_bin[0]
        cuda.threadfence()
        if sync:
            cuda.syncthreads()
        if tid == 0:
            last[0] = int32(1) if cuda.atomic.add(done, row, 1) == slices - 1 else int32(0)
        if sync:
            cuda.syncthreads()
        if not last[0]:
            return
        for b in range(tid, DIGIT_BINS, nt):
            local[b] = cuda.atomic.exch(hist, (row, b), int32(0))  # the row's totals, left zero
        if tid == 0:
            done[row] = 0
        if sync:
            cuda.syncthreads()
        k_rem = int64(k) if digit == 0 else int64(row_state[row, ROW_REMAIN])
        if k_rem > 0 and (digit == 0 or high < DIGIT_BINS):
            search(local, k_rem, buf, found, tid)
        elif tid == 0:
            found[0] = DIGIT_BINS  # nothing to select: a digit above every key's
            found[1] = 0
        if tid == 0 and digit == 0:
            row_state[row, ROW_HIGH] = int32(found[0])
            row_state[row, ROW_REMAIN] = int32(k_rem - found[1])
        if tid == 0 and digit == 1:
            tau = (high << DIGIT_BITS) | found[0] if found[0] < DIGIT_BINS else int64(NO_KEY)
            need = k_rem - found[1]
            if tau == NO_KEY or (mode == BLOCKS and tau == NEG_KEY):
                need = 0  # candidate blocks are kept only above -inf
            row_state[row, ROW_TAU] = int32(tau)
            row_state[row, ROW_NEED] = int32(need)

    return kernel


@cache
def write_kernel(threads: int, own_rows: bool):
    """Grid (S, T, P) as digit_kernel's: slice blockIdx.x writes its items above tau and its share
    of the first `need` ties, after the slices before it; positions into sel (ascending, -1 padded),
    or every block's flag into cand."""
    nt = threads
    scan = block_scan(nt)

    @jit_kernel(nt)
    def kernel(score, cand, positions, n_tokens, ratio, candidate_source, masked, blk, sel, topk_blocks,
               row_state, slice_counts):
        buf = cuda.shared.array(nt, int64)  # [threads]: the scans'
        before = cuda.shared.array(1, int64)  # the slices before this one: (keys above tau) << 32 | keys at tau
        s, t, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        slices = cuda.gridDim.x
        tid = cuda.threadIdx.x
        row = z * n_tokens + t
        mode, n, k, visible = problem(z, t, positions, n_tokens, ratio, own_rows, candidate_source, masked, blk,
                                      sel.shape[1], topk_blocks)
        if whole_in_one(mode, n, blk):
            return  # the digit-0 kernel selected it whole
        if tid == 0:
            before[0] = 0
        if nt > 1:
            cuda.syncthreads()
        tau = int64(row_state[row, ROW_TAU])
        need = int64(row_state[row, ROW_NEED])
        low = tau & (DIGIT_BINS - 1)
        part = int64(0)
        if tau < NO_KEY:
            for j in range(tid, s, nt):
                slot = row * slices + j
                at_or_above = slice_counts[slot, low]
                strictly = slice_counts[slot, low + 1] if low + 1 < DIGIT_BINS else 0
                part += (int64(slice_counts[slot, SLICE_ABOVE] + strictly) << 32) | (at_or_above - strictly)
        if part != 0:
            cuda.atomic.add(before, 0, part)
        if nt > 1:
            cuda.syncthreads()
        lo, hi = slice_range(n, s, slices)
        run = (hi - lo + nt - 1) // nt
        r_lo = min(lo + tid * run, hi)
        r_hi = min(r_lo + run, hi)
        n_gt = int64(0)
        n_eq = int64(0)
        for i in range(r_lo, r_hi):
            key = item_key(mode, score, cand, t, i, visible, blk)
            if key > tau:
                n_gt += 1
            elif key == tau:
                n_eq += 1
        excl, _ = scan((n_gt << 32) | n_eq, buf, tid)
        excl += before[0]
        tie = excl & 0xFFFFFFFF
        o = (excl >> 32) + min(tie, need)
        for i in range(r_lo, r_hi):
            key = item_key(mode, score, cand, t, i, visible, blk)
            take = key > tau
            if key == tau:
                take = tie < need
                tie += 1
            if mode == BLOCKS:
                cand[t, i] = 1 if take else 0
            elif take and o < sel.shape[1]:  # always, unless the workspace was not left clear
                sel[t, o] = i
                o += 1
        if mode != BLOCKS:
            for i in range(k + s * nt + tid, sel.shape[1], slices * nt):
                sel[t, i] = -1

    return kernel


@dataclass
class SelectWorkspace:
    """The split path's scratch for up to `rows` rows (stage-owned; every index source reuses it).
    hist and done are zero between calls (each call's last slices clear what they used)."""

    hist: DeviceArray  # int32 [2 * rows, 256]: each (problem, row)'s digit histogram
    done: DeviceArray  # int32 [2 * rows]: slices finished with the histogram
    row_state: DeviceArray  # int32 [2 * rows, 4]: ROW_HIGH .. ROW_NEED
    slice_counts: DeviceArray  # int32 [slots, 257]: each slice's suffix counts and SLICE_ABOVE

    @classmethod
    def allocate(cls, rows: int, slots: int = 0) -> SelectWorkspace:
        """slots: the slices of all rows and problems it serves (0 = what split_slices picks)."""
        pairs = 2 * max(1, rows)
        slots = max(slots, pairs, split_block_cap())
        return cls(cuda.to_device(np.zeros((pairs, DIGIT_BINS), np.int32)), cuda.to_device(np.zeros(pairs, np.int32)),
                   cuda.device_array((pairs, 4), np.int32), cuda.device_array((slots, DIGIT_BINS + 1), np.int32))

    @property
    def rows(self) -> int:
        return self.done.shape[0] // 2


@cache
def split_block_cap() -> int:
    """The most blocks one split-path kernel launches over all its rows and problems (3 on the
    simulator, which pays about a millisecond a block: enough for several slices a row)."""
    return 3 if SIM else SPLIT_BLOCKS_PER_SM * cuda.get_current_device().MULTIPROCESSOR_COUNT


def split_slices(width: int, pairs: int) -> int:
    """Slices a row for `pairs` (problem, row) pairs whose widest row the host knows as `width`."""
    return max(1, min(math.ceil(width / SLICE_ITEMS), split_block_cap() // pairs))


def split_select(score: DeviceArray, positions: DeviceArray, candidates: DeviceArray, selection: DeviceArray,
                 n_tokens: int, ratio: int, candidate_source: bool, masked: bool, blk: int, topk_blocks: int,
                 width: int, own_rows: bool, workspace: SelectWorkspace, stream=0, threads: int = 0,
                 slices: int = 0) -> None:
    """stages.indexer.select's split path (its arguments checked there): masked = the positions
    outside the candidate blocks rank as -inf. width: the widest row's groups as the host knows them
    (any number >= the real one; it sizes the grid only). threads (a power of two <= 256), slices:
    the launch shape (0 = the defaults; tests force others)."""
    problems = 2 if candidate_source else 1
    slices = slices or split_slices(width, problems * n_tokens)
    if workspace.rows < n_tokens or workspace.slice_counts.shape[0] < problems * n_tokens * slices:
        raise InputError(f"select: a SelectWorkspace of {workspace.rows} rows and {workspace.slice_counts.shape[0]} "
                         f"slices for {n_tokens} rows of {slices} slices")
    grid = (slices, n_tokens, problems)
    nt = threads or SPLIT_THREADS
    args = (score, candidates, positions, n_tokens, ratio, candidate_source, masked, blk)
    ws = workspace
    for digit in (0, 1):
        digit_kernel(nt, digit, own_rows)[grid, nt, stream](*args, selection, topk_blocks, ws.hist, ws.done,
                                                            ws.row_state, ws.slice_counts)
    write_kernel(nt, own_rows)[grid, nt, stream](*args, selection, topk_blocks, ws.row_state, ws.slice_counts)
