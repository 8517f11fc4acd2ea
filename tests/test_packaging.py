"""The installed package (a wheel, as Docker and ``pip install blink-serve`` get it, not the
editable checkout the tests run from) holds every Python package of the source tree."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _declared() -> tuple[set[str], dict[str, str]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(tool["packages"]), dict(tool["package-dir"])


def _source_packages(package_dir: dict[str, str]) -> set[str]:
    """Every folder with an ``__init__.py`` under a mapped root, as its installed name."""
    found: set[str] = set()
    for name, folder in package_dir.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            if "__pycache__" in rel or any(p.startswith(".") for p in rel):
                continue
            found.add(".".join((name, *rel)))
    return found


def test_every_source_package_is_declared():
    packages, package_dir = _declared()
    missing = _source_packages(package_dir) - packages
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"


def test_every_declared_package_exists():
    packages, package_dir = _declared()
    for name in packages:
        base = max((k for k in package_dir if name == k or name.startswith(k + ".")), key=len)
        folder = ROOT / package_dir[base] / Path(*name[len(base):].lstrip(".").split(".") if name != base else ())
        assert folder.is_dir(), f"{name} -> {folder} does not exist"


def test_files_a_module_reads_beside_itself_are_package_data():
    """A source file a module opens beside itself (``Path(__file__).with_name("x.c")``: the
    C loops built at first use) must match its package's package-data globs, or an installed
    wheel falls back to the slow path without it."""
    import fnmatch
    import re

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, package_dir = _declared()
    data = tool["package-data"]
    checked = 0
    for name, folder in package_dir.items():
        for module in (ROOT / folder).rglob("*.py"):
            for beside in re.findall(r'with_name\("([^"]+)"\)', module.read_text()):
                rel = module.parent.relative_to(ROOT / folder).parts
                package = ".".join((name, *rel))
                if package not in packages:
                    continue
                assert (module.parent / beside).is_file(), f"{module} reads a missing {beside}"
                globs = data.get(package, [])
                assert any(fnmatch.fnmatch(beside, g) for g in globs), \
                    f"{package}: {beside} (read by {module.name}) is not in package-data {globs}"
                checked += 1
    assert checked >= 2  # host_copy.c, cpu/attention.c
