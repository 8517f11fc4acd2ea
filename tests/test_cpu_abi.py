"""The CPU kernel libraries' ctypes declarations (blink.kernels.cpu.abi) against their C.

ctypes calls a function with whatever argument types it was told: one argument missing, or an
``int`` where the C takes an ``int64_t``, reads garbage registers or stack with no error. This
test parses each library's C source (and the local headers it includes) for its exported
function definitions, and checks the Python table: the same functions, and for each the
return type and the arguments' count, order, names and types. No compiler needed.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from blink.kernels.cpu import abi

CPU_DIR = Path(abi.__file__).parent

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# a definition's head at the start of a line: return type, name, "(" (static ones are private)
_HEAD = re.compile(r"^(?!static\b|typedef\b)([A-Za-z_][\w ]*?[\w*])\s*\b(blink_\w+)\s*\(", re.M)
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)
_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "double": ctypes.c_double}


def _param(text: str) -> tuple[str, type]:
    """One C parameter -> (name, ctype); every pointer (function pointers too) is c_void_p."""
    text = " ".join(text.split())
    function_pointer = re.fullmatch(r".*\(\s*\*\s*(\w+)\s*\)\s*\(.*\)", text)
    if function_pointer:
        return function_pointer.group(1), ctypes.c_void_p
    ctype, name = re.fullmatch(r"(.*?)\s*\b(\w+)", text).groups()
    if "*" in ctype:
        return name, ctypes.c_void_p
    return name, _CTYPES[ctype.replace("const", "").strip()]


def _split(params: str) -> list[str]:
    """A parameter list split at its top-level commas (function pointers hold their own)."""
    parts, depth, current = [], 0, ""
    for ch in params:
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        current += ch
    parts.append(current)
    return [] if [p.strip() for p in parts] in (["void"], [""]) else parts


def exported(text: str) -> list[tuple[str, abi.Signature]]:
    """Every non-static ``blink_*`` function definition in C ``text``, in order (a function
    defined under both branches of an ``#if`` appears twice)."""
    text = _COMMENT.sub(" ", text)
    found = []
    for head in _HEAD.finditer(text):
        depth, i = 1, head.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if not text[i:].lstrip().startswith("{"):
            continue  # a prototype
        ret = head.group(1).strip()
        restype = None if ret == "void" else ctypes.c_void_p if "*" in ret else _CTYPES[ret]
        args = tuple(_param(p) for p in _split(text[head.end():i - 1]))
        found.append((head.group(2), abi.Signature(restype, args)))
    return found


def library_source(source: str) -> str:
    """The C file and, before it, the local headers it includes."""
    text = (CPU_DIR / source).read_text()
    headers = [(CPU_DIR / h).read_text() for h in _INCLUDE.findall(text) if (CPU_DIR / h).is_file()]
    return "\n".join([*headers, text])


def mismatches(table: dict[str, abi.Signature], text: str) -> list[str]:
    """What differs between a Python table and the C definitions in ``text``."""
    problems = []
    defined = exported(text)
    names = {name for name, _ in defined}
    problems += [f"{n}: declared in Python, not defined in C" for n in sorted(set(table) - names)]
    problems += [f"{n}: exported by C, missing from the table" for n in sorted(names - set(table))]
    for name, c in defined:
        py = table.get(name)
        if py is None:
            continue
        if py.restype is not c.restype:
            problems.append(f"{name}: returns {c.restype} in C, {py.restype} in Python")
        if len(py.args) != len(c.args):
            problems.append(f"{name}: {len(c.args)} arguments in C, {len(py.args)} in Python")
        for k, (c_arg, py_arg) in enumerate(zip(c.args, py.args)):
            if c_arg != py_arg:
                problems.append(f"{name}: argument {k} is {c_arg} in C, {py_arg} in Python")
    return problems


@pytest.mark.parametrize("source", sorted(abi.LIBRARIES))
def test_each_table_matches_its_c_source(source):
    assert mismatches(abi.LIBRARIES[source], library_source(source)) == []


def test_every_c_source_has_a_table():
    assert sorted(p.name for p in CPU_DIR.glob("*.c")) == sorted(abi.LIBRARIES)


def test_the_checker_sees_a_wrong_table():
    """A planted mismatch of each kind is reported (the parser is not vacuous)."""
    text = library_source("attention.c")
    good = abi.ATTENTION["blink_paged_attention"]
    assert len(good.args) == 24 and dict(exported(text))["blink_paged_attention"] == good
    int_for_int64 = good.args[:1] + (("q_stride_t", ctypes.c_int),) + good.args[2:]
    for bad in (abi.Signature(good.restype, good.args[:-1]),  # one argument short
                abi.Signature(good.restype, int_for_int64),  # a type
                abi.Signature(good.restype, good.args[:2][::-1] + good.args[2:]),  # the order
                abi.Signature(None, good.args)):  # the return type
        assert mismatches({**abi.ATTENTION, "blink_paged_attention": bad}, text)
    assert mismatches({k: v for k, v in abi.ATTENTION.items() if k != "blink_paged_attention"}, text)
    assert mismatches({**abi.ATTENTION, "blink_gone": abi.Signature(ctypes.c_int)}, text)


def test_a_function_pointer_parameter_is_a_pointer():
    text = "int blink_pool_split(void *(*run)(void *), const void *args, int64_t items, int threads, int64_t parts) {}"
    assert exported(text) == [("blink_pool_split", abi.POOL["blink_pool_split"])]


def test_replay_c_is_what_the_tables_generate():
    """replay.c is generated (its thunks call each signature through its exact prototype):
    after a table changes, `python -m blink.kernels.cpu.abi > kernels/cpu/replay.c`."""
    assert (CPU_DIR / "replay.c").read_text() == abi.replay_source()


def test_every_kernel_signature_has_a_replay_thunk():
    """Each table's functions map to a thunk whose C prototype is its own: the generated
    prototype, parsed back like the C sources, is the table's signature."""
    text = abi.replay_source()
    for i, (restype, argtypes) in enumerate(abi.replay_signatures()):
        head = re.search(rf"static int64_t thunk_{i}\(.*?\n(?:    \(void\)a;\n)?    (?:return \(int64_t\))?"
                         rf"\(\((\w+) \(\*\)\(([^)]*)\)\)fn\)", text)
        assert head, i
        ret, params = head.groups()
        assert (None if ret == "void" else _CTYPES[ret]) is restype
        parsed = [] if params == "void" else [ctypes.c_void_p if "*" in p else _CTYPES[p.strip()]
                                              for p in params.split(",")]
        assert parsed == list(argtypes)
    for source, table in abi.LIBRARIES.items():
        for signature in table.values():
            recorded = (signature.restype, tuple(signature.argtypes)) in abi.replay_signatures()
            assert recorded or source in abi.NOT_RECORDED
