"""The loopback transport's segment copies (blink/transport/host_copy.py and host_copy.c):
the C loop moves exactly the bytes the Python reference does, with threads splitting
segments mid-way, and refuses segments that leave their source or the region."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from blink.transport import TransportError, host_copy


def _case(rng: np.random.Generator, n: int, length: int):
    sources = [rng.integers(0, 256, size=length * 64, dtype=np.uint8) for _ in range(3)]
    # n segments of varied lengths into disjoint slots of the destination
    lengths = rng.integers(1, length, size=n)
    slots = rng.permutation(n)
    segments = np.stack([rng.integers(0, 3, size=n),
                         rng.integers(0, length * 63, size=n),
                         slots * length, lengths], axis=1)
    return sources, segments, np.zeros(n * length, dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 3])
def test_c_loop_equals_the_python_reference(threads):
    assert host_copy.load() == "c", "the C loop did not build (no cc?)"
    rng = np.random.default_rng(0)
    # > 3 MiB in all, so three threads run and their byte ranges split segments
    sources, segments, want = _case(rng, 400, 12 << 10)
    got = want.copy()
    assert host_copy.copy_segments_python(want, sources, segments) == int(segments[:, 3].sum())
    assert host_copy.copy_segments(got, sources, segments, threads) == int(segments[:, 3].sum())
    assert want.any() and np.array_equal(got, want)


def test_segments_outside_a_source_or_the_region_are_refused():
    rng = np.random.default_rng(1)
    sources, segments, dst = _case(rng, 8, 64)
    for column, value in ((0, 3), (1, len(sources[0])), (2, dst.nbytes), (3, -1)):
        bad = segments.copy()
        bad[0, column] = value
        with pytest.raises(TransportError, match="outside"):
            host_copy.copy_segments(dst, sources, bad)
    with pytest.raises(TransportError, match="flat contiguous uint8"):
        host_copy.copy_segments(dst, [s.view(np.int16) for s in sources], segments)
    assert not dst.any()  # nothing was copied by a refused call


def test_without_the_c_loop_the_python_one_does_the_copies():
    code = ("import numpy as np; from blink.transport import host_copy as h; "
            "d = np.zeros(8, np.uint8); s = [np.arange(8, dtype=np.uint8)]; "
            "h.copy_segments(d, s, np.array([[0, 2, 0, 4]])); "
            "assert h.load() == 'python' and list(d[:4]) == [2, 3, 4, 5], d; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "BLINK_HOST_COPY": "python"})
    assert out.stdout.strip() == "ok", out.stderr


def test_a_prepared_copy_list_writes_row_ranges_and_dies_with_its_transport():
    from blink.transport import LoopbackRegion, LoopbackTransport

    rng = np.random.default_rng(2)
    sources, segments, want = _case(rng, 40, 256)
    host_copy.copy_segments_python(want, sources, segments)
    with LoopbackRegion(want.nbytes) as region:
        transport = LoopbackTransport(region.name, want.nbytes)
        prepared = transport.prepare_segments(sources, segments)
        moved = sum(transport.write_prepared(prepared, a, a + 7, threads=2) for a in range(0, 40, 7))
        got = np.frombuffer(region.buffer, dtype=np.uint8)[: want.nbytes].copy()
        assert moved == int(segments[:, 3].sum()) and np.array_equal(got, want)
        transport.close()
        with pytest.raises(TransportError, match="closed"):
            transport.write_prepared(prepared, 0, 1)
