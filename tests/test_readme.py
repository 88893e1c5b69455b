"""README.md as a newcomer reads it: its Python snippet runs exactly as written (extracted from the
README itself) on the built-in model, in a fresh interpreter with its own cache folder; CI runs the
test command it gives; its performance targets are those of docs/performance.md; every file it
links exists; and it stays a guide (short, with the development history kept in docs/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 220  # "under about 200": the history belongs in docs/performance-log.md


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def plain_blocks() -> list[str]:
    return [block.strip() for block in re.findall(r"```\n(.*?)```", README.read_text(), flags=re.DOTALL)]


def test_the_readme_has_one_python_snippet():
    assert len(python_snippets()) == 1


def test_the_python_snippet_runs_as_written(tmp_path: Path):
    env = {**os.environ, "FLASHV41_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", python_snippets()[0]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    shape, context = done.stdout.split("\n")[-2].rsplit(" ", 1)
    assert shape.startswith("(1, ") and int(context) >= 256, done.stdout
    assert (tmp_path / "cache").is_dir(), "the built-in model goes into FLASHV41_CACHE"


def test_ci_runs_the_readmes_test_command():
    """The README's test command is the whole suite, and .ci/run runs exactly it; the quick tier is
    the same command leaving out the slow tests."""
    commands = [block for block in plain_blocks() if block.startswith("python -m pytest")]
    full, quick = commands
    assert quick == f'{full} -m "not slow"'
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(full)} \|\| status=\$\?$", ci, flags=re.MULTILINE), ci


def targets(text: str, columns: int, must_reach: int) -> dict[str, str]:
    """{row id: its "must reach" cell} of the Markdown tables in `text` whose rows have `columns`
    cells and start with a target's id (P1, P2L, ...)."""
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.match(r"([PHM]\d+L?)\b", cells[0])
        if len(cells) == columns and match:
            found[match[1]] = cells[must_reach]
    return found


def test_the_readmes_targets_are_the_docs():
    """Each target the README's performance table gives is docs/performance.md's "must reach"."""
    readme = targets(README.read_text(), 3, 2)
    docs = targets((ROOT / "docs/performance.md").read_text(), 4, 3)
    assert len(readme) >= 5 and set(readme) <= set(docs), (readme, docs)
    for row, target in readme.items():
        assert docs[row].startswith(target), (row, target, docs[row])


def test_links_point_to_files():
    text = README.read_text()
    for doc in [README, *(ROOT / "docs").glob("*.md")]:
        for link in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not link.startswith("http"):
                assert (doc.parent / link).is_file(), f"{doc.name}: {link}"
    for path in re.findall(r"`((?:examples|docs|tests)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), path


def test_the_readme_is_a_guide_not_a_log():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
    assert (ROOT / "docs/performance-log.md").is_file()
