"""blink.gc_freeze: a process's start-up objects leave the collector's scans, and the collector
still frees what is allocated afterwards (a request's reference cycles)."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected():
    # in a child process: freezing is for the life of a process, not for pytest's
    script = textwrap.dedent("""
        import gc, logging, weakref
        from blink.gc_freeze import freeze_startup_heap

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        startup = [[i] for i in range(50_000)]  # the loaded model's Python objects, say
        frozen = freeze_startup_heap(logging.getLogger("t"), "engine")
        assert frozen >= 50_000 and gc.get_freeze_count() == frozen, frozen

        class Request:
            pass

        a, b = Request(), Request()
        a.other, b.other = b, a  # a cycle made after the freeze
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None, "a cycle made after the freeze was not collected"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "engine: " in done.stderr and "start-up objects moved out of the garbage collector's scans" in done.stderr
