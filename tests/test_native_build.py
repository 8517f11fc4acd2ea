"""blink.shared.native_build: a C source built once per machine and cached by everything that
shapes the binary (its headers too), loaded once per process, and a clear fallback."""
from __future__ import annotations

import ctypes
import logging

import pytest

from blink.shared import native_build
from blink.shared.native_build import NativeBuildError, NativeLibrary, build_library

SOURCE = '#include "answer.h"\nint blink_answer(void) { return ANSWER; }\n'


@pytest.fixture
def sources(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "answer.c").write_text(SOURCE)
    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")
    return tmp_path / "answer.c", tmp_path / "answer.h"


def test_builds_once_and_a_header_change_rebuilds(sources):
    source, header = sources
    assert build_library(source, headers=(header,)).blink_answer() == 42
    built = sorted((native_build.cache_dir()).glob("answer-*.so"))
    assert len(built) == 1
    assert build_library(source, headers=(header,)).blink_answer() == 42  # cached: no new file
    assert sorted(native_build.cache_dir().glob("answer-*.so")) == built
    header.write_text("#define ANSWER 7\n")
    assert build_library(source, headers=(header,)).blink_answer() == 7
    assert len(list(native_build.cache_dir().glob("answer-*.so"))) == 2


def test_fallback_flags_when_the_first_compile_fails(sources):
    source, header = sources
    lib = build_library(source, flags=("-O2", "-fno-such-flag-anywhere"), fallback_flags=("-O2",),
                        headers=(header,))
    assert lib.blink_answer() == 42
    with pytest.raises(NativeBuildError, match="failed"):
        build_library(source, flags=("-fno-such-flag-anywhere",), headers=(header,))


def test_native_library_decides_once_warns_once_and_honours_its_switch(sources, monkeypatch, caplog):
    source, header = sources
    log = logging.getLogger("blink.test")

    def declare(library):
        library.blink_answer.restype = ctypes.c_int

    library = NativeLibrary(source, what="the answer", fallback="none instead", logger=log,
                            headers=(header,), env="BLINK_TEST_ANSWER", setup=declare)
    assert library.get().blink_answer() == 42 and library.get() is library.get()
    monkeypatch.setenv("BLINK_TEST_ANSWER", "torch")
    library.reset()
    with caplog.at_level("WARNING", logger="blink.test"):
        assert library.get() is None  # switched off: no warning
    monkeypatch.delenv("BLINK_TEST_ANSWER")
    monkeypatch.setenv("CC", str(source.parent / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(source.parent / "empty"))
    library.reset()
    with caplog.at_level("WARNING", logger="blink.test"):
        assert library.get() is None and library.get() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the answer (answer.c) is not available" in warnings[0] \
        and warnings[0].endswith("none instead")
    missing = NativeLibrary(source, what="a missing symbol", fallback="x", logger=log, headers=(header,),
                            setup=lambda lib: lib.blink_no_such_function)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("XDG_CACHE_HOME", str(source.parent / "cache"))
    assert missing.get() is None  # a missing symbol counts as a failed build


def test_using_runs_another_build_in_the_block_and_puts_the_decision_back(sources):
    """``using(other)``: :meth:`get` returns ``other`` (or None: the fallback) inside the block
    and this library's own decision after it, an exception in the block too."""
    source, header = sources
    library = NativeLibrary(source, what="the answer", fallback="none", logger=logging.getLogger("blink.test"),
                            headers=(header,))
    own = library.get()
    header.write_text("#define ANSWER 7\n")
    other = build_library(source, headers=(header,))
    with library.using(other):
        assert library.get().blink_answer() == 7
    assert library.get() is own and own.blink_answer() == 42
    with pytest.raises(RuntimeError), library.using(None):
        assert library.get() is None
        raise RuntimeError("in the block")
    assert library.get() is own


def _fake_cc(folder, version: str):
    """A compiler at a fixed path that reports ``version`` and hands everything else to cc."""
    import os
    import shutil
    import stat

    real = shutil.which("cc") or shutil.which("gcc")
    script = folder / "fake-cc"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
                      f'exec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    native_build.compiler_version.cache_clear()
    os.environ["CC"] = str(script)
    return script


def test_the_compiler_version_is_in_the_cache_key(sources, monkeypatch):
    """An upgraded compiler at the same path builds anew instead of loading the old build."""
    source, header = sources
    monkeypatch.setenv("CC", "")
    _fake_cc(source.parent, "cc (Fake) 12.2.0")
    try:
        assert native_build.compiler_version(native_build.find_compiler()) == "cc (Fake) 12.2.0"
        assert build_library(source, headers=(header,)).blink_answer() == 42
        _fake_cc(source.parent, "cc (Fake) 13.1.0")
        assert build_library(source, headers=(header,)).blink_answer() == 42
        assert len(list(native_build.cache_dir().glob("answer-*.so"))) == 2
    finally:
        native_build.compiler_version.cache_clear()


def test_a_library_that_needs_a_newer_compiler_says_so(sources, monkeypatch, caplog):
    """A source whose compiler is too old: the warning names the requirement and the compiler
    found (as the paged attention does for GCC < 12), then the fallback."""
    source, header = sources
    source.write_text('#error "needs GCC >= 99"\n')
    monkeypatch.setenv("CC", "")
    _fake_cc(source.parent, "cc (Fake) 11.4.0")
    log = logging.getLogger("blink.test")
    library = NativeLibrary(source, what="the answer", fallback="none instead", logger=log,
                            headers=(header,), requires="GCC >= 99 or clang")
    try:
        with caplog.at_level("WARNING", logger="blink.test"):
            assert library.get() is None
    finally:
        native_build.compiler_version.cache_clear()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "it needs GCC >= 99 or clang, the C compiler here: cc (Fake) 11.4.0" in warning
    assert warning.endswith("; none instead")


def test_prepare_leaves_a_build_the_process_will_not_use_unbuilt(sources, caplog):
    """One build among several of a source (the CPU chooses one): prepare_libraries builds the
    wanted one and neither builds nor warns about the others, which get() still builds."""
    source, header = sources
    log = logging.getLogger("blink.test")
    used = NativeLibrary(source, what="the used build", fallback="x", logger=log, headers=(header,))
    other = NativeLibrary(source, what="another CPU's build", fallback="x", logger=log, headers=(header,),
                          flags=("-O2", "-fno-such-flag-anywhere"), wanted=lambda: False)
    with caplog.at_level("INFO", logger="blink.test"):
        report = native_build.prepare_libraries([used, other], log=log)
    assert report == {"answer.c": None} and used.decided and not other.decided
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert other.get() is None and other.decided  # asked for: built (here it fails)


def test_the_start_builds_only_the_quantized_kernels_build_the_cpu_runs(monkeypatch):
    """quant_linear's five builds (the x86 ones and the Arm one): at start only the one
    variant() chose while the model loaded is wanted; a CPU none runs on, or a model without
    quantized projections (no choice made), wants none."""
    from blink.kernels.cpu import quant_linear

    monkeypatch.setattr(quant_linear, "_chosen", ["avx2_int8"])
    assert [n for n, lib in quant_linear.LIBRARIES.items() if lib.wanted()] == ["avx2_int8"]
    for chosen in ([None], []):
        monkeypatch.setattr(quant_linear, "_chosen", chosen)
        assert not any(lib.wanted() for lib in quant_linear.LIBRARIES.values())
