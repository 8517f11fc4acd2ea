"""The installed Blink version, for ``blink --version`` and ``GET /version``. Imports nothing
of Blink (the frontend and the CLI both use it)."""
from __future__ import annotations

from functools import lru_cache

DISTRIBUTION = "blink-serve"


@lru_cache(maxsize=1)
def blink_version() -> str:
    """The installed distribution's version; ``0+unknown`` from a checkout that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"
