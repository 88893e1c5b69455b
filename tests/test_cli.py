"""The command line: synth then info from Python, `python -m flashv41`, errors as one line (each bad
argument of synth and info, exit 2, before any work), an interrupted synth, and the progress shown
off a terminal."""

from __future__ import annotations

import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashv41
from flashv41 import cli
from flashv41.cli import main
from flashv41.host.errors import CapacityError
from flashv41.host.progress import Progress
from flashv41.host.synth import preset, write_synthetic
from flashv41.memory import DEFAULT_MAX_TOKENS
from flashv41.runner import BUILTIN_NAME, CACHE_ENV, make_runner

ROOT = Path(__file__).resolve().parents[1]


def test_synth_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.gguf"
    assert main(["synth", "--preset", "tiny", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert path.is_file() and f"wrote {path}" in out and "Q8_0" in out and "Q2_K" in out

    assert main(["info", str(path), "--max-seq", "256", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    model = flashv41.load_model(path)
    for role in model.config.roles:  # every layer's role, by block type
        assert f"  {role.layer}  " in out and role.block_type in out
    for name in ("n_layers", "norm_eps", "compress_rope_theta", "beta_slow", "candidate_topk_blocks",
                 "table rows", "engram_embd", "attn_q_a", "Q2_K", "max_seq 256, max_tokens 16", "total"):
        assert name in out, name
    model.close()


def test_synth_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.gguf"
    args = ["synth", "--preset", "tiny", "-o", str(path), "--weight-type", "BF16", "--table-type", "Q8_0",
            "--seed", "3", "--engram-rows", "300"]
    assert main(args) == 0
    model = flashv41.load_model(path)
    try:
        assert model.tensor(1, "attn_q_a").ggml_type.name == "BF16"
        assert model.tensor(1, "engram_embd").ggml_type.name == "Q8_0"
        assert model.config.engram is not None and all(rows >= 300 for rows in model.config.engram.table_rows)
        assert model.config.n_layers == preset("tiny").n_layers
    finally:
        model.close()
    assert "seed 3" in capsys.readouterr().out


def test_info_with_host_tables(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tiny_path), "--table-residency", "host"]) == 0
    out = capsys.readouterr().out
    assert "engram tables on the host" in out and "(host)" in out
    plans = out[out.index("by table residency (one sequence):"):].splitlines()[1:]
    assert [line.split()[0] for line in plans] == ["device", "pinned", "host"]
    assert "pinned host memory" in plans[1] and "read from the file" in plans[2]


def test_module_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flashv41", "--help"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "synth" in done.stdout and "info" in done.stdout


def test_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("not a model\n")
    assert main(["info", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashv41: error: ") and "notes.gguf" in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_missing_file_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "absent.gguf")]) == 2
    assert "absent.gguf" in capsys.readouterr().err
    assert main(["synth", "--preset", "tiny"]) == 2  # -o is required: argparse's usage error
    assert main(["--help"]) == 0


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single line a refused command printed (on stderr, nothing on stdout)."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert " error: " in lines[0] and "Traceback" not in lines[0]
    return lines[0]


def test_synth_refuses_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "nope" / "sub" / "t.gguf"
    assert main(["synth", "-o", str(target)]) == 2
    line = one_error_line(capsys)
    assert f"the folder {target.parent} does not exist" in line
    assert not (tmp_path / "nope").exists()  # nothing created on the way


def test_synth_refuses_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "-o", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert f"{tmp_path} is a directory" in line and ".partial" not in line
    assert list(tmp_path.iterdir()) == []


def test_synth_refuses_too_few_engram_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A table needs a distinct prime of at least 2 rows per n-gram order and head: tiny's smallest
    has 2 + 3 = 5 rows, so fewer are refused rather than silently rounded up."""
    path = tmp_path / "t.gguf"
    for rows in ("0", "4", "-3"):
        assert main(["synth", "-o", str(path), "--engram-rows", rows]) == 2
        line = one_error_line(capsys)
        assert f"engram rows {rows}:" in line and "5 rows" in line, line
    assert main(["synth", "-o", str(path), "--engram-rows", "99999999999999999999999"]) == 2
    assert "engram rows 99999999999999999999999:" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []
    assert main(["synth", "-o", str(path), "--engram-rows", "5"]) == 0
    model = flashv41.load_model(path)
    try:
        assert model.config.engram is not None and model.config.engram.table_rows[0] == 5
    finally:
        model.close()


def test_synth_refuses_a_negative_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "-o", str(tmp_path / "t.gguf"), "--seed", "-1"]) == 2
    assert one_error_line(capsys) == "flashv41: error: argument --seed: must be at least 0, got -1"


def test_synth_progress_and_summary_share_a_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.gguf"
    assert main(["synth", "-o", str(path)]) == 0
    captured = capsys.readouterr()
    # stderr is not a terminal here: the write is named once, with its size, in the summary's unit
    (opening,) = captured.err.splitlines()
    assert opening.startswith("writing t.gguf: ")
    unit = opening.split()[-1]
    assert unit in ("KiB", "MiB", "GiB") and f" {unit}) in " in captured.out


def test_synth_interrupted_leaves_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of the write: one line, exit 130, neither the file nor its temporary."""
    def interrupt(self: Progress, amount: float = 1.0) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "update", interrupt)
    assert main(["synth", "--preset", "small", "-o", str(tmp_path / "s.gguf")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "flashv41: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_write_synthetic_interrupted_leaves_no_file(tmp_path: Path) -> None:
    def interrupt(name: str, done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic(tmp_path / "s.gguf", "small", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_info_refuses_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory" in one_error_line(capsys)


@pytest.mark.parametrize("option", ["--max-seq", "--max-tokens"])
def test_info_checks_sizes_before_printing(option: str, tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tiny_path), option, "0"]) == 2
    assert one_error_line(capsys) == f"flashv41: error: argument {option}: must be at least 1, got 0"


def test_info_refuses_max_seq_as_the_engine_does(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        with pytest.raises(CapacityError) as refused:
            flashv41.Engine(model, max_seq=100000)
    finally:
        model.close()
    assert main(["info", str(tiny_path), "--max-seq", "100000"]) == 2
    assert one_error_line(capsys) == f"flashv41: error: {refused.value}"
    assert "100000" in str(refused.value) and "context length 256" in str(refused.value)


def test_info_estimates_with_the_default_chunk(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tiny_path)]) == 0
    assert f"max_seq 256, max_tokens {DEFAULT_MAX_TOKENS}," in capsys.readouterr().out
    assert inspect.signature(make_runner).parameters["max_tokens"].default == DEFAULT_MAX_TOKENS


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--reps", "3"]) == 2
    assert one_error_line(capsys) == "flashv41: error: argument --reps: must be at least 20, got 3"
    assert main([]) == 2
    assert one_error_line(capsys) == "flashv41: error: the following arguments are required: COMMAND"
    assert main(["info", "--max-seq", "many"]) == 2
    assert one_error_line(capsys) == "flashv41: error: argument --max-seq: takes an integer, got 'many'"


def test_info_defaults_to_the_builtin_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`flashv41 info` without a file describes the built-in model, as `flashv41 run` runs it."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert main(["info"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{BUILTIN_NAME}: ") and "layer roles" in captured.out
    assert "wrote the built-in tiny model" in captured.err


def test_bench_defaults_are_the_benchs() -> None:
    """The CLI writes the bench's defaults out so that `bench --help` need not import Numba: they
    must be the bench's own."""
    from flashv41.bench import MIN_REPS, BenchOptions

    defaults = BenchOptions()
    assert (cli.BENCH_MIN_REPS, cli.BENCH_DEFAULT_WEIGHT_TYPES, cli.BENCH_DEFAULT_WORKDIR) == (
        MIN_REPS, defaults.weight_types, defaults.workdir) and defaults.reps == MIN_REPS


# what each command line may import before it answers: --help and --version nothing but the
# standard library; a subcommand's help and argument errors NumPy and gguf-py, never Numba
QUICK_ANSWERS = [
    (["--help"], ("numpy", "numba")),
    (["--version"], ("numpy", "numba")),
    (["nope"], ("numpy", "numba")),
    (["run", "--help"], ("numba",)),
    (["run", "--seed", "x"], ("numba",)),
    (["run", "--tokens", "1,x"], ("numba",)),
    (["info", "--help"], ("numba",)),
    (["synth", "--help"], ("numba",)),
    (["synth", "--type-map", "nope=Q8_0", "-o", "x.gguf"], ("numba",)),
    (["bench", "--help"], ("numba",)),
    (["bench", "--reps", "3"], ("numba",)),
]


@pytest.mark.parametrize(("argv", "absent"), QUICK_ANSWERS, ids=[" ".join(a) for a, _ in QUICK_ANSWERS])
def test_quick_answers_import_nothing_slow(argv: list[str], absent: tuple[str, ...], tmp_path: Path) -> None:
    """`flashv41 --help` answers in a Python start-up's time because it imports nothing heavy (the
    test counts imports, not seconds: a loaded machine would make any time limit flaky)."""
    code = ("import sys\n"
            "from flashv41.cli import main\n"
            f"status = main({argv!r})\n"
            "print('imported:', sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'numba', 'gguf')))\n"
            "sys.exit(status)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode in (0, 2), done.stderr
    imported = done.stdout.splitlines()[-1]
    for name in absent:
        assert f"'{name}'" not in imported and f"'{name}." not in imported, imported
    assert "Traceback" not in done.stderr, done.stderr


def test_a_closed_pipe_ends_quietly(tiny_path: Path) -> None:
    """`flashv41 info FILE | head`: once the reader is gone, the command ends with the status of a
    process stopped by a closed pipe (141), printing nothing (no "Broken pipe", no traceback)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "flashv41", "info", str(tiny_path)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (cli.BROKEN_PIPE, "")


def test_a_closed_pipe_in_process(tiny_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert main(["info", str(tiny_path)]) == cli.BROKEN_PIPE
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("where", ["build_parser", "Parser.declared"])
def test_interrupted_before_any_work(where: str, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the parser is built or a subcommand declared (its imports): one line, 130."""
    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    owner, _, name = where.rpartition(".")
    monkeypatch.setattr(getattr(cli, owner) if owner else cli, name, interrupt)
    assert main(["run", "--oracle"]) == cli.INTERRUPTED
    assert capsys.readouterr().err == "flashv41: interrupted\n"


def test_bench_help_points_into_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any width
    assert "docs/performance.md" in out and (ROOT / "docs/performance.md").is_file()


def test_code_names_only_files_in_the_repository() -> None:
    """Every Markdown file a docstring, comment or message names is one the repository holds."""
    named: dict[str, list[str]] = {}
    for folder in ("flashv41", "host", "stages", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in re.findall(r"[\w./-]+\.md\b", path.read_text()):
                named.setdefault(name, []).append(str(path.relative_to(ROOT)))
    missing = {name: where for name, where in named.items() if not (ROOT / name).is_file()}
    assert not missing, missing


def test_progress_off_a_terminal() -> None:
    """Off a terminal: the work is named once, then a line with its rate and what is left only
    every log_every_s seconds (here 0: every update), never a bar's carriage returns."""
    stream = io.StringIO()
    with Progress("decode", 3, "step", "steps", stream=stream, log_every_s=0) as progress:
        for _ in range(3):
            progress.update()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "decode: 3 steps" and len(lines) == 4 and "\r" not in stream.getvalue()
    assert re.fullmatch(r"decode: 3/3 steps \[00:00<00:00, .+step/s\]", lines[-1]), lines[-1]
    quiet = io.StringIO()
    with Progress("prefill of 1 token", 1, "chunk", "chunks", stream=quiet) as progress:
        progress.update()
    assert quiet.getvalue() == "prefill of 1 token: 1 chunk\n"  # a short piece of work: its name only
