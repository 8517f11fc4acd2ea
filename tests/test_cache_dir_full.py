"""A cache directory on a full disk (issue 34, item 6). Before: the CPU C kernels were built
at the first request, in the engine's loop thread, each trying its native flags and then its
fallback flags against the full disk (and every start repeated it), so the first request took
~20 s with /health at 503. Now the engine builds or loads them before it reports ready, with a
progress line; a full cache directory is met once (no retry with other flags, no further build
in this process; libraries already cached still load), said once, and the slower fallbacks
run. The compile cache (--compile) likewise: checked once, said once, eager for this start.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from blink.shared import native_build
from blink.shared.native_build import NativeLibrary, prepare_libraries

SOURCE = "int blink_answer(void) { return 42; }\n"
ENOSPC_TEXT = os.strerror(28)  # "No space left on device"


def _full_disk_compiler(tmp_path: Path, full: bool = True) -> tuple[Path, Path, Path]:
    """The system compiler until the disk is "full" (the returned flag file exists), then one
    that fails like ld on a full disk, counting those calls in a file (``--version``, which
    writes nothing, always answers)."""
    calls, flag = tmp_path / "cc-calls", tmp_path / "disk-full"
    cc = tmp_path / "full-disk-cc"
    real = shutil.which("cc") or shutil.which("gcc")
    cc.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then exec {real} --version; fi\n"  # (no disk needed)
                  f"if [ -e {flag} ]; then\n  echo x >> {calls}\n"
                  f"  echo '/usr/bin/ld: final link failed: {ENOSPC_TEXT}' >&2\n  exit 1\n"
                  f"fi\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    if full:
        flag.touch()
    return cc, calls, flag


def _calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@pytest.fixture
def clean_cache_state():
    native_build.forget_cache_dir_failure()
    yield
    native_build.forget_cache_dir_failure()


def _library(tmp_path: Path, name: str, log: logging.Logger) -> NativeLibrary:
    source = tmp_path / f"{name}.c"
    source.write_text(SOURCE.replace("answer", name))
    return NativeLibrary(source, what=f"the {name} kernel", fallback="the torch path runs",
                         logger=log, flags=("-O2", "-march=native"), fallback_flags=("-O2",))


def test_full_cache_dir_is_met_once_said_once_and_cached_libraries_still_load(
        tmp_path, monkeypatch, caplog, clean_cache_state):
    log = logging.getLogger("blink.test.cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cc, calls, full = _full_disk_compiler(tmp_path, full=False)
    monkeypatch.setenv("CC", str(cc))
    cached = _library(tmp_path, "cached", log)
    assert cached.get() is not None  # built before the disk fills
    cached.reset()
    full.touch()
    first, second = _library(tmp_path, "first", log), _library(tmp_path, "second", log)
    with caplog.at_level(logging.INFO, logger="blink.test.cache"):
        report = prepare_libraries([cached, first, second], log=log)
        assert first.get() is None and second.get() is None  # decided: no build at first use
    assert report == {"cached.c": None, "first.c": first.failure, "second.c": second.failure}
    assert cached.get() is not None  # loading a cached library needs no space
    assert _calls(calls) == 1  # not native + fallback flags, not once per library
    assert ENOSPC_TEXT in native_build.cache_dir_failure()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert ENOSPC_TEXT in warnings[0] and "the first kernel" in warnings[0] \
        and "the second kernel" in warnings[0] and "XDG_CACHE_HOME" in warnings[0]
    assert any("building or loading 3 C libraries" in r.getMessage() for r in caplog.records)
    # a library first used later in this start does not try again, and says nothing more
    third = _library(tmp_path, "third", log)
    assert third.get() is None and _calls(calls) == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_full_compile_cache_runs_eager_said_once(tmp_path, monkeypatch, caplog):
    from blink.engine import compiled, runners

    real_statvfs = os.statvfs
    monkeypatch.setattr(compiled.os, "statvfs", lambda p: os.statvfs_result(
        (*real_statvfs(p)[:4], 3, *real_statvfs(p)[5:])))  # 3 blocks free: a full disk
    monkeypatch.setattr(compiled, "_cache_problems", {})

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled despite a full compile cache")

    monkeypatch.setattr(runners, "CompiledModelPhase", no_compiling)
    parts = SimpleNamespace(executor=SimpleNamespace(model=object()), sampler=None, scheduler=None)
    made = [runners.CompiledRunner(parts, cache_dir=str(tmp_path / "inductor"), scheduler_buckets=(1,),
                                   max_rows=1, suppress_width=1, max_logit_bias=0) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="blink.engine"):
        for runner in made:  # a second engine in the process: said once
            runner.prepare()
    assert all(runner.compiled is None for runner in made)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MiB free" in warnings[0] and "eager" in warnings[0], warnings


ENGINE_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    sys.path.insert(0, sys.argv[1])
    from test_engine import BASE, tiny_model_dir
    from blink.engine.engine import EngineConfig
    from blink.engine.factory import create_engine
    from blink.shared.native_build import _REGISTRY
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    engine = create_engine(EngineConfig(model=str(tiny_model_dir(sys.argv[2])), **BASE),
                           loop="cpu")
    engine.start()  # returns at READY
    # (a build another CPU runs, e.g. quant_linear's Arm one here, is not wanted: not built)
    print(json.dumps({"decided": [lib.decided or not lib.is_wanted() for lib in _REGISTRY],
                      "unwanted": sum(not lib.is_wanted() for lib in _REGISTRY),
                      "libraries": len(_REGISTRY)}), flush=True)
    engine.close()
""")


def test_engine_builds_its_kernels_before_ready_and_meets_a_full_disk_once(tmp_path):
    cc, calls, _ = _full_disk_compiler(tmp_path)
    env = {**os.environ, "CC": str(cc), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "BLINK_CPU_ATTENTION": "", "BLINK_CPU_FUSED": "", "BLINK_CPU_Q4": ""}
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(Path(__file__).parent),
                           str(tmp_path / "model")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["libraries"] >= 2 and all(result["decided"]) and result["unwanted"] >= 1, result
    assert _calls(calls) == 1, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    cache_lines = [line for line in warnings if ENOSPC_TEXT in line]
    assert len(cache_lines) == 1, warnings
    assert "CPU kernels: building or loading" in done.stderr
