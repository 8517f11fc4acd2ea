"""Load-time chunks side by side (blink.shared.load_chunks): every chunk runs once, on
several threads where there are cores, and a chunk's error reaches the caller."""
from __future__ import annotations

import threading

import pytest

from blink.shared import load_chunks


@pytest.mark.parametrize("workers", [1, 3])
def test_every_chunk_runs_once_and_errors_reach_the_caller(monkeypatch, workers):
    monkeypatch.setattr(load_chunks, "load_workers", lambda: workers)
    seen: list[int] = []
    threads: set[str] = set()
    lock = threading.Lock()

    def work(start: int) -> None:
        with lock:
            seen.append(start)
            threads.add(threading.current_thread().name)

    load_chunks.run_chunks(work, range(0, 100, 10))
    assert sorted(seen) == list(range(0, 100, 10))
    assert all(name.startswith("blink-load") for name in threads) == (workers > 1)

    def failing(start: int) -> None:
        if start == 30:
            raise ValueError("chunk 30")

    with pytest.raises(ValueError, match="chunk 30"):
        load_chunks.run_chunks(failing, range(0, 100, 10))
    load_chunks.run_chunks(work, [])  # nothing to do
