"""docs/architecture.md against the code: the ladder it quotes is `Engine._layer` as written, and
every `Class.attribute` and dotted module path it names in backticks exists."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from flashv41.bench.prefill_stack import PartEvents
from flashv41.engine import BatchHasher, Engine, Sequence
from flashv41.host.engram_hash_fast import FastEngramHasher
from flashv41.host.tokens import Tokens
from flashv41.plan import Call, EngramPlan, LayerCapture, LayerPlan, Plan, Run, StageTimer, Step, Watched
from flashv41.stages.attention import AttentionStage
from flashv41.stages.engram import EngramStage
from flashv41.stages.head import HeadStage
from flashv41.stages.hyper import HyperLayer, HyperStage, Mixes

DOC = Path(__file__).resolve().parents[1] / "docs/architecture.md"
CLASSES = {c.__name__: c for c in (Engine, Sequence, BatchHasher, FastEngramHasher, Tokens, Call, Plan, LayerPlan,
                                   EngramPlan, Step, Run, Watched, StageTimer, LayerCapture, HyperStage, Mixes,
                                   HyperLayer, AttentionStage, EngramStage, HeadStage, PartEvents)}


def quoted_ladder() -> str:
    """The python block that follows the page's "Here is `Engine._layer`", dedented."""
    text = DOC.read_text()
    start = text.index("```python\n", text.index("Here is `Engine._layer`")) + len("```python\n")
    return textwrap.dedent(text[start:text.index("```", start)])


def test_the_quoted_ladder_is_the_code() -> None:
    source = textwrap.dedent(inspect.getsource(Engine._layer))
    body = ast.parse(source).body[0].body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), "a docstring first"
    after_docstring = textwrap.dedent("\n".join(source.split("\n")[body[1].lineno - 1:]))
    assert quoted_ladder().rstrip() == after_docstring.rstrip(), \
        "docs/architecture.md quotes another Engine._layer than the code's: copy it again"


def names() -> list[str]:
    """Every backticked dotted name of the page (no brackets, calls or spaces) that starts with a
    class of CLASSES or a module path (flashv41., host., stages., a stages module)."""
    found = set(re.findall(r"`([A-Za-z_]\w*(?:\.\w+)+)`", DOC.read_text()))
    return sorted(n for n in found if n.split(".")[0] in CLASSES or n.split(".")[0] in ("flashv41", "host", "stages")
                  or n.split(".")[0] in STAGE_MODULES)


STAGE_MODULES = {path.stem for path in (DOC.parents[1] / "stages").glob("*.py")}


def resolves(name: str) -> bool:
    head, *rest = name.split(".")
    if head in CLASSES:
        cls, attr = CLASSES[head], rest[0]
        if hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {}):
            return True
        # an instance attribute: assigned in one of the class's methods
        return re.search(rf"self\.{attr}\b[^=\n]*=", inspect.getsource(cls)) is not None
    if head in STAGE_MODULES:
        name = "stages." + name
    module = name if name.startswith("flashv41.") else f"flashv41.{name}"
    for split in range(len(name.split(".")) + 1, 1, -1):
        parts = module.split(".")
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("name", names())
def test_every_name_the_page_gives_exists(name: str) -> None:
    assert resolves(name), f"docs/architecture.md names {name}, which the code does not have"
