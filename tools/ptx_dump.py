"""Record the PTX of every kernel a pytest selection compiles, and compare two such records.

A refactor that moves device functions between modules (no arithmetic touched) should leave
every kernel's PTX as it was, once the names are normalised. This tool proves it:

    python tools/ptx_dump.py dump OUT -- tests/test_linear.py tests/test_linear_tc.py ...
    python tools/ptx_dump.py compare BASE OUT

A record may also be a folder of records (one a pytest run, say one a test file, so that no process
holds every kernel of the selection at once): `compare` merges the records it finds under it.
Compile-check mode runs the `gpu` tests too, whose flash-sized arrays are NumPy arrays on the host
(one process over several such files grew past 16 GB): `-m "not gpu"` keeps to the CI shapes.

`dump` runs pytest in the project's compile-check mode (tests/compile_check.py: every kernel a
test launches is typed, lowered and compiled to sm_90 PTX through NVVM, not run) and records
each compiled kernel's PTX under OUT, one file per (module, kernel qualname, signature) and
instance (factories make many kernels of one qualname and signature: one per closure), named
`<module>--<qualname>--<signature hash>--<n>.ptx`, with `index.json` listing every file's
module, qualname, full signature, normalised-PTX hash and the test that compiled it. The PTX
written is the normalised one.

Normalisation (`normalise`), the only change made to NVVM's output:
- every Numba-mangled symbol (`_ZN...`: the kernel entry, every non-inlined device function and
  its declarations and calls, Numba's error-code globals) has its namespace path (the module's
  dotted name), its unique-id and ABI-tag suffixes and its argument-type codes dropped: what is
  left is the function's own name (the last component of its qualname), numbered by first
  appearance among the symbols of that name (`dequant_q8_0#0`). A function moved to another
  module, or compiled in another order in the session, keeps its name;
- Numba's shared and local array names (`_cudapy_smem_<n>`: a counter over the whole session)
  are numbered by first appearance in the kernel;
- Numba's environment globals (`NumbaEnv.<function>`: one `.common .global .u64` declaration a
  function, which the code never reads) lose their number and their declarations are listed
  sorted after `.address_size`: they come in the order the functions' code libraries are linked,
  which follows the modules the functions live in. Should one be referenced by an instruction,
  the declarations are left where they are (and a move shows as a difference);
- `.file` directives (source paths; absent without line info) are dropped.
Nothing else: instruction bodies, register declarations, parameters and comments are compared
as NVVM wrote them.

`compare` pairs the two records' kernels by (qualname, signature), whatever their module, and
compares per pair the multisets of normalised PTX (sorted hashes: instances of one factory come
in whatever order the tests compile them). It prints the kernels compared, those identical,
moved ones (other module, same PTX) and every difference, and exits 1 on any difference or
kernel present on one side only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

MANGLED = re.compile(r"_ZN[A-Za-z0-9_]+")
ENV = re.compile(r"NumbaEnv\.[A-Za-z0-9_]+(#\d+)?")
SHARED = re.compile(r"_cudapy_([sl]mem)_\d+")  # Numba's shared / local array names: a session-wide counter
COMPONENT = re.compile(r"(\d+)")
CC = (9, 0)


def demangled_components(symbol: str) -> list[str]:
    """The length-prefixed name components of a Numba-mangled symbol `_ZN<len><name>...`, up to the
    first thing that is not one (the ABI tags `B...`, the end `E` and the argument codes)."""
    parts, i = [], 3
    while i < len(symbol):
        m = COMPONENT.match(symbol, i)
        if not m:
            break
        n = int(m.group(1))
        start = m.end()
        if start + n > len(symbol):
            break
        parts.append(symbol[start:start + n])
        i = start + n
    return parts


def short_name(symbol: str) -> str:
    """The function's own name in a mangled symbol: its last name component (Numba's escapes, `_3c`
    for '<', kept), `NumbaEnv.` before it for the function's environment global, and a kernel
    parameter's `_param_<n>` after it."""
    parts = demangled_components(symbol)
    if not parts:
        return "sym"
    name = ("NumbaEnv." if parts[0] == "NumbaEnv" else "") + parts[-1]
    param = re.search(r"_param_\d+$", symbol)
    return name + (param.group(0) if param else "")


def normalise(ptx: str) -> str:
    """NVVM's PTX with the mangled symbols renamed (module docstring) and `.file` lines dropped."""
    names: dict[str, str] = {}
    counts: dict[str, int] = defaultdict(int)

    def rename(m: re.Match) -> str:
        symbol = m.group(0)
        if symbol not in names:
            short = short_name(symbol)
            names[symbol] = f"{short}#{counts[short]}"
            counts[short] += 1
        return names[symbol]

    arrays: dict[str, str] = {}

    def rename_array(m: re.Match) -> str:
        return arrays.setdefault(m.group(0), f"_cudapy_{m.group(1)}#{len(arrays)}")

    lines = [line for line in ptx.splitlines() if not line.lstrip().startswith(".file")]
    return sorted_environments(SHARED.sub(rename_array, MANGLED.sub(rename, "\n".join(lines)))) + "\n"


def sorted_environments(ptx: str) -> str:
    """The NumbaEnv declarations (module docstring) without numbers, sorted after `.address_size`,
    unless an instruction names one. Idempotent: `compare` applies it to stored records again."""
    lines = [ENV.sub(lambda m: m.group(0).split("#")[0], line) for line in ptx.rstrip("\n").splitlines()]
    declared = [i for i, line in enumerate(lines) if line.startswith(".common .global") and "NumbaEnv." in line]
    if any("NumbaEnv." in line for i, line in enumerate(lines) if i not in set(declared)):
        return ptx.rstrip("\n")
    envs = sorted(lines[i] for i in declared)
    rest = [line for i, line in enumerate(lines) if i not in set(declared)]
    at = next((i + 1 for i, line in enumerate(rest) if line.startswith(".address_size")), 0)
    return "\n".join(rest[:at] + envs + rest[at:])


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Recorder:
    """A pytest plugin that wraps numba-cuda's kernel compile (`_Kernel.__init__`, what a
    compile-check launch calls once per dispatcher and argument types) and writes what it made."""

    def __init__(self, out: Path):
        self.out = out
        self.index: list[dict] = []
        self.seen: set[tuple[str, str, str, str]] = set()
        self.instances: dict[tuple[str, str, str], int] = defaultdict(int)
        self.test = ""  # the test running (the index names the first to compile each kernel)

    def pytest_runtest_setup(self, item) -> None:
        self.test = item.nodeid

    def pytest_configure(self, config) -> None:
        from numba.cuda import dispatcher

        original = dispatcher._Kernel.__init__
        recorder = self

        def init(kernel, py_func, argtypes, *args, **kwargs):
            original(kernel, py_func, argtypes, *args, **kwargs)
            recorder.record(py_func, argtypes, kernel.inspect_asm(CC))

        dispatcher._Kernel.__init__ = init

    def record(self, py_func, argtypes, ptx: str) -> None:
        module, qualname = py_func.__module__, py_func.__qualname__
        signature = ", ".join(str(t) for t in argtypes)
        text = normalise(ptx)
        h = digest(text)
        key = (module, qualname, signature)
        if key + (h,) in self.seen:  # the same kernel again (a factory cache rebuilt by a mutant test)
            return
        self.seen.add(key + (h,))
        n = self.instances[key]
        self.instances[key] += 1
        name = f"{safe(module)}--{safe(qualname)}--{digest(signature)[:12]}--{n}.ptx"
        (self.out / name).write_text(text)
        self.index.append({"file": name, "module": module, "qualname": qualname, "signature": signature,
                           "hash": h, "test": self.test})

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        (self.out / "index.json").write_text(json.dumps(self.index, indent=1) + "\n")


def dump(out: Path, pytest_args: list[str]) -> int:
    os.environ["FLASHV41_COMPILE_CHECK"] = "1"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.ptx"):
        old.unlink()
    import pytest

    recorder = Recorder(out)
    status = pytest.main(pytest_args, plugins=[recorder])
    print(f"ptx_dump: {len(recorder.index)} kernels recorded in {out}")
    return int(status)


def load(record: Path) -> dict[tuple[str, str], list[dict]]:
    """A record's kernels (or those of the records in its folders) by (qualname, signature), each
    hashed again after normalising its stored text once more (idempotent: a record written by an
    earlier normalisation compares the same). A kernel two runs compiled alike counts once."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    seen: set[tuple[str, str, str, str]] = set()
    for index in sorted(record.rglob("index.json")):
        for entry in json.loads(index.read_text()):
            text = sorted_environments((index.parent / entry["file"]).read_text()) + "\n"
            key = (entry["module"], entry["qualname"], entry["signature"], digest(text))
            if key not in seen:
                seen.add(key)
                groups[key[1:3]].append({**entry, "file": str(index.parent / entry["file"]), "hash": key[3]})
    return groups


def compare(base: Path, new: Path) -> int:
    a, b = load(base), load(new)
    compared = identical = 0
    moved: set[tuple[str, str]] = set()
    problems: list[str] = []
    for key in sorted(set(a) | set(b)):
        ea, eb = a.get(key, []), b.get(key, [])
        if not ea or not eb:
            side = "base" if ea else "new"
            problems.append(f"only in {side}: {key[0]} ({len(ea or eb)} kernel(s)) [{key[1][:80]}]")
            continue
        ha, hb = sorted(e["hash"] for e in ea), sorted(e["hash"] for e in eb)
        compared += len(ea)
        mods_a, mods_b = {e["module"] for e in ea}, {e["module"] for e in eb}
        if mods_a != mods_b:
            moved.add((f"{key[0]}: {sorted(mods_a)} -> {sorted(mods_b)}", key[1][:60]))
        if ha == hb:
            identical += len(ea)
            continue
        only_a = [e for e in ea if e["hash"] not in hb]
        only_b = [e for e in eb if e["hash"] not in ha]
        problems.append(f"differs: {key[0]} [{key[1][:80]}]: base {[e['file'] for e in only_a]} "
                        f"new {[e['file'] for e in only_b]}")
    for m, sig in sorted(moved):
        print(f"moved (same qualname and signature): {m} [{sig}]")
    for p in problems:
        print(p)
    print(f"ptx_dump compare: {compared} kernels compared, {identical} identical, {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="run pytest in compile-check mode and record every kernel's PTX")
    d.add_argument("out", type=Path)
    d.add_argument("pytest_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare", help="compare two records")
    c.add_argument("base", type=Path)
    c.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        return dump(args.out, rest)
    return compare(args.base, args.new)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
