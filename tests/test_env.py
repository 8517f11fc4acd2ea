"""Every BLINK_* environment variable is in blink/env.py's registry (issue 31), read through
it, and listed by ``blink --help-env``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from blink import env as blink_env
from blink.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("blink", "dpu", "kernels", "benchmarks")
NAME = re.compile(r"\bBLINK_[A-Z0-9_]*[A-Z0-9]\b")
#: a direct read of the environment naming a BLINK_ variable or an ``*_ENV`` constant
DIRECT_READ = re.compile(r"(os\.environ|getenv)\b.*(\bBLINK_|[A-Z]_ENV\b)")
#: files that still read their variable straight from os.environ (registered all the same),
#: and why
DIRECT_READ_ALLOWED = {
    "blink/env.py": "the registry itself",
    "benchmarks/peers.py": "also runs as the transformers peer's server, without blink",
    "benchmarks/": "scripts: they set variables for the processes they start",
}


def _sources():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh", ".c", ".h", ".cu", ".cuh"):
                yield path, path.relative_to(ROOT).as_posix()


def _names_in(path: Path) -> set[str]:
    text = path.read_text(errors="replace")
    if path.suffix in (".c", ".h", ".cu", ".cuh"):  # C: macros are not variables; getenv is
        return {m for call in re.findall(r"getenv\(\s*\"([^\"]+)\"", text) for m in NAME.findall(call)}
    return set(NAME.findall(text))


def test_every_blink_variable_in_the_code_is_registered():
    unknown: dict[str, list[str]] = {}
    for path, rel in _sources():
        for name in _names_in(path) - set(blink_env.REGISTRY) - set(blink_env.NOT_ENVIRONMENT):
            unknown.setdefault(name, []).append(rel)
    assert not unknown, f"BLINK_ names not in blink/env.py's registry: {unknown}"


def test_every_registered_variable_is_still_read_somewhere():
    seen: set[str] = set()
    for path, rel in _sources():
        if rel != "blink/env.py":
            seen |= _names_in(path)
    # (test hooks may move out of the scanned folders: only the product's names must be there)
    stale = sorted(n for n, v in blink_env.REGISTRY.items() if n not in seen and v.kind != "test")
    assert not stale, f"registered in blink/env.py but no longer in the code: {stale}"


def test_the_registry_is_complete_per_entry():
    for v in blink_env.VARIABLES:
        assert v.kind in {k for k, _ in blink_env.KINDS}, v.name
        assert v.meaning and v.default and v.readers, v.name
        assert v.type in ("bool", "str", "path", "int", "float", "pid", "choice"), v.name
        assert bool(v.values) == (v.type == "choice"), v.name


def test_blink_variables_are_read_through_the_registry():
    offenders = []
    for path, rel in _sources():
        if path.suffix != ".py" or any(rel == allowed or allowed.endswith("/") and
                                       rel.startswith(allowed) for allowed in DIRECT_READ_ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT_READ.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "read BLINK_* variables through blink.env:\n" + "\n".join(offenders)


def test_an_unregistered_name_is_refused(monkeypatch):
    monkeypatch.setenv("BLINK_NOT_A_KNOB", "1")
    with pytest.raises(KeyError, match="registry"):
        blink_env.get("BLINK_NOT_A_KNOB")
    monkeypatch.setenv("BLINK_CPU_BF16", "off")
    assert blink_env.is_true("BLINK_CPU_BF16", default=True) is False
    monkeypatch.delenv("BLINK_CPU_BF16")
    assert blink_env.is_true("BLINK_CPU_BF16", default=True) is True


def test_help_env_lists_every_variable(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help-env"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in blink_env.REGISTRY:
        assert name in out
    assert "docs/threads.md" in out


def test_serve_help_points_to_help_env():
    out = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "blink --help-env" in out
