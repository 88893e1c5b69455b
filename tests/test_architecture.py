"""The three floors, read from the code's own imports: `flashv41.host` (host/) imports nothing of
the other two, `flashv41.stages` (stages/) imports `flashv41.host` only, `flashv41` (flashv41/)
sits on top; all three install under the one `flashv41` namespace, so no top-level `host` or
`stages` package exists (tests and examples import them by their installed names too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"host": "flashv41.host", "stages": "flashv41.stages", "flashv41": "flashv41"}
# what each floor may import of the project: its own floor and the ones below
ALLOWED = {
    "host": ("flashv41.host",),
    "stages": ("flashv41.host", "flashv41.stages"),
    "flashv41": ("flashv41",),
}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; a relative import names its level as dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def project_modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("folder", list(FOLDERS))
def test_imports_only_run_downward(folder: str):
    wrong = []
    for path in project_modules(folder):
        for line, module in imported(path):
            if module.startswith("."):
                wrong.append(f"{path.relative_to(ROOT)}:{line} relative import {module}")
            elif within(module, ("flashv41", "host", "stages")) and not within(module, ALLOWED[folder]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, f"{folder}/ ({FOLDERS[folder]}) may import only {ALLOWED[folder]}:\n" + "\n".join(wrong)


def test_host_never_touches_the_gpu():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in project_modules("host") for line, module in imported(path)
             if within(module, ("numba.cuda", "cuda"))]
    assert not wrong, "host/ is the NumPy floor:\n" + "\n".join(wrong)


@pytest.mark.parametrize("folder", ["tests", "examples"])
def test_users_of_the_package_use_its_installed_names(folder: str):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / folder).glob("*.py")) for line, module in imported(path)
             if within(module, ("host", "stages"))]
    assert not wrong, "\n".join(wrong)


def test_one_namespace(tmp_path: Path):
    """From a folder outside the checkout, flashv41.host and flashv41.stages import and a bare
    `host` does not exist (it would shadow a user's own module of that name)."""
    script = ("import importlib.util, flashv41.host, flashv41.stages\n"
              "assert importlib.util.find_spec('host') is None, importlib.util.find_spec('host')\n"
              "assert importlib.util.find_spec('stages') is None, importlib.util.find_spec('stages')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_floor_refuses_its_bare_name():
    """Imported by its folder's name (from the checkout's root, say), a floor says what to import."""
    done = subprocess.run([sys.executable, "-c", "import host"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "import flashv41.host, not host" in done.stderr, done.stderr


def test_each_block_layout_is_written_once():
    """The sizes and field offsets of the multi-byte blocks (Q8_0: 34 bytes; Q2_K: 84 bytes, 21
    32-bit words, d at byte 80, dmin at 82) appear as numbers in host/quants.py's table alone;
    every other module reads them from its dtypes."""
    from flashv41.host.quants import FORMATS, Q2_K_BLOCK, Q8_0_BLOCK, GGMLType, field_offset

    layout = {Q8_0_BLOCK.itemsize, Q2_K_BLOCK.itemsize, Q2_K_BLOCK.itemsize // 4,
              field_offset(Q2_K_BLOCK, "d"), field_offset(Q2_K_BLOCK, "dmin")}
    assert layout == {34, 84, 21, 80, 82}
    assert FORMATS[GGMLType.Q2_K].block_bytes == 84
    table = ROOT / "host" / "quants.py"
    wrong = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
             for folder in FOLDERS for path in project_modules(folder) if path != table
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and type(node.value) is int and node.value in layout]
    assert not wrong, "a block layout written outside host/quants.py:\n" + "\n".join(wrong)
