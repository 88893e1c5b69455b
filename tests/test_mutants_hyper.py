"""Broken variants of the hyper-connection kernels (stages.hyper, stages.mixes_tiles), each
rejected by the check its real test in tests/test_hyper.py (test_embed.py, test_mixes_tiles.py)
uses, on the same inputs (the small preset: four stream slices, eight post d-ranges, 3 tokens; the
tiles' partials of 11 tokens and five chunks past two slices, and their mixes); `test_unmutated_passes`
runs every check with the real kernels.
Each mutant edits one line of a kernel's own source (tests.mutants.edited): a Sinkhorn column read
as a row, a sigmoid's sign, the last slice left out of the sums, the attention input collapsed with
the sublayer's own mix instead of the layer before's, the last copy left out of the product, the
product's weights read at a neighbouring d, the new copies written in the wrong places; in the
FFN sublayer's one launch, its own mixes' mean over one copy, its post written as pre; in the
embedding, each block's last chunk left unwritten; in the tiles' product, a warp's fourth token's
last columns of each slice dropped, a token's square sum made of its neighbour's values.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from unittest.mock import patch

import pytest

import flashv41
from flashv41.host.oracle import Oracle
from flashv41.host.quants import GGMLType
from flashv41.stages import hyper, mixes_tiles
from flashv41.stages.hyper import HyperStage
from tests.mutants import edited, mutant
from tests.test_embed import IDS, check_embed
from tests.test_hyper import check_mixes, check_mixes_norm, check_mixes_post, check_post_with_next_product
from tests.test_mixes_tiles import PARTIAL_K, check_partials


def check_tiled_mixes(model, oracle, stage) -> None:
    """check_mixes with the product from mixes_tiles (test_mixes_tiles' `tiled`), 11 tokens."""
    with patch.object(hyper, "MIXES_TILES_MIN_TOKENS", 1):
        check_mixes(model, oracle, stage, 1, "attn", 11)


CHECKS = {
    "mixes": lambda m, o, s: check_mixes(m, o, s, 1, "ffn", 3),
    "mixes_norm": lambda m, o, s: check_mixes_norm(m, o, s, 3),
    "post_product": lambda m, o, s: check_post_with_next_product(m, o, s, 1, "ffn", 3, True),
    "mixes_post": lambda m, o, s: check_mixes_post(m, o, s, 1, 3),
    "embed": lambda m, o, s: check_embed(m, IDS),
    "tiles": lambda m, o, s: check_partials(GGMLType.F32, 11, PARTIAL_K, int(GGMLType.F32)),
    "tiled_mixes": check_tiled_mixes,
}


@dataclass(frozen=True)
class Mutant:
    check: str
    key: str
    name: str  # the kernel, device function or factory edited
    old: str
    new: str
    module: types.ModuleType = hyper  # the module that defines it


# a warp's fourth token (tokens 3 and 7 of 11) without each lane's last column of each slice (the
# slice's last column on the simulator's one lane, its last 32 on a GPU)
TILES_X3, TILES_X3_SHORT = ("x3 = x[t0 + 3, c] if t0 + 3 <= last else",
                            "x3 = x[t0 + 3, c] if t0 + 3 <= last and c + LANES < k1 else")
MUTANTS = [
    Mutant("mixes", "column_read_as_row", "split_sinkhorn", "else _cell(m, j * hc + line)",
           "else _cell(m, line * hc + j)"),
    Mutant("mixes", "pre_sign", "split_sinkhorn", "_sigmoid(raw[c] * r", "_sigmoid(-raw[c] * r"),
    Mutant("mixes", "last_slice_dropped", "mix_sums", "range(lane, n_slices, LANES)",
           "range(lane, n_slices - 1, LANES)"),
    Mutant("mixes_norm", "own_mix_collapsed", "mixes_norm_kernel", "norm(h, pre_in,", "norm(h, pre,"),
    Mutant("post_product", "last_copy_dropped", "post_product_kernel", "for c in range(hc):\n                    v",
           "for c in range(hc - 1):\n                    v"),
    Mutant("post_product", "weight_neighbour", "post_product_kernel", "wv[row, c * dim + d]",
           "wv[row, (c * dim + d) ^ 1]"),
    Mutant("mixes_post", "own_width_one_copy", "post_product_kernel", "float32(hc * dim)", "float32(dim)"),
    Mutant("mixes_post", "post_for_pre", "post_product_kernel", "pre[t, c] = own_pre[0, c]",
           "pre[t, c] = own_post[0, c]"),
    Mutant("post_product", "copies_rotated", "post_product_kernel", "h[t, c, d] = new[j * MAX_HC + c]",
           "h[t, c, d] = new[j * MAX_HC + (c + 1) % hc]"),
    Mutant("embed", "block_last_chunk_unwritten", "embed_kernel", "n = min(EMBED_THREADS, chunks - first) * CHUNK",
           "n = (min(EMBED_THREADS, chunks - first) - 1) * CHUNK"),
    Mutant("tiles", "tiles_last_column_dropped", "mixes_tiles_kernel", TILES_X3, TILES_X3_SHORT, mixes_tiles),
    Mutant("tiled_mixes", "tiles_last_column_dropped_mixes", "mixes_tiles_kernel", TILES_X3, TILES_X3_SHORT,
           mixes_tiles),
    Mutant("tiles", "tiles_neighbour_square", "mixes_tiles_kernel", "acc2[n_rows] += x2 * x2",
           "acc2[n_rows] += x1 * x1", mixes_tiles),
    Mutant("tiled_mixes", "tiles_neighbour_square_mixes", "mixes_tiles_kernel", "acc2[n_rows] += x2 * x2",
           "acc2[n_rows] += x1 * x1", mixes_tiles),
]


@pytest.fixture(scope="module")
def small(synth_model):
    model = flashv41.load_model(synth_model("small"))
    stage = HyperStage(model, max_tokens=16)
    yield model, Oracle(model, max_seq=64), stage
    stage.free()


@pytest.mark.parametrize("check", list(CHECKS))
def test_unmutated_passes(small, check):
    CHECKS[check](*small)


@pytest.mark.parametrize("m", MUTANTS, ids=[m.key for m in MUTANTS])
def test_mutant_rejected(small, m):
    replacement = edited(m.module, m.name, m.old, m.new)  # a MutationError here is a failure, never a rejection
    with mutant(m.module, **{m.name: replacement}), pytest.raises(AssertionError):
        CHECKS[m.check](*small)
