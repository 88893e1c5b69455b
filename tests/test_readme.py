"""README.md's Python snippet, run exactly as written (extracted from the README itself) on the
built-in model, in a fresh interpreter with its own cache folder: a newcomer copies it verbatim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


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
