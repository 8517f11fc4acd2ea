"""The weights and KV cache in 2 MB pages (blink.huge_pages): the same values in mappings the
kernel may back with transparent huge pages, freed with their tensors, off by
``$BLINK_CPU_HUGE_PAGES=0``, and the executor's logits unchanged by it."""
from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from blink import huge_pages
from blink.executor import ModelExecutor
from blink.loader import open_model

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402
from helpers_models import make_tiny_model  # noqa: E402
from test_loader_gguf import export_to_gguf  # noqa: E402

needs_thp = pytest.mark.skipif(huge_pages.unavailable_reason() is not None,
                               reason=f"no 2 MB pages here: {huge_pages.unavailable_reason()}")


def mapping_of(address: int) -> dict[str, str] | None:
    """This process's /proc/self/smaps entry holding ``address`` (its fields), None if none."""
    entry: dict[str, str] | None = None
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if found is not None:
                return found
            start, end = (int(v, 16) for v in head.split("-"))
            entry = {}
            found = entry if start <= address < end else None
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return found


def huge_page_eligible(tensor: torch.Tensor) -> bool:
    entry = mapping_of(tensor.data_ptr())
    return entry is not None and entry.get("THPeligible") == "1"


def advised_huge(tensor: torch.Tensor) -> bool | None:
    """Whether ``tensor``'s mapping is marked ``MADV_HUGEPAGE`` (smaps' ``hg`` flag), None where
    the kernel shows no flags. What this process asked for, unlike ``THPeligible``: a kernel whose
    policy backs some page sizes of every mapping (multi-size THP "always") calls torch's own
    memory eligible too."""
    entry = mapping_of(tensor.data_ptr())
    if entry is None or "VmFlags" not in entry:
        return None
    return "hg" in entry["VmFlags"].split()


@needs_thp
def test_placed_tensors_keep_their_values_in_huge_page_mappings():
    arena = huge_pages.HugePageArena()
    small = torch.randn(300, 70)
    big = torch.randint(-100, 100, (3000, 4096), dtype=torch.int8)  # its own mapping
    transposed = torch.randn(64, 48).t()  # input-major fp32 weights are stored so
    # Memory the arena does not own keeps its mark. (torch's heap memory can carry one from
    # before: numpy marks its large arrays' pages, which glibc may carve from the same heap.)
    small_marked = advised_huge(small)
    placed = [arena.place(t) for t in (small, big, transposed)]
    for before, after in zip((small, big, transposed), placed):
        assert torch.equal(before, after) and after.dtype == before.dtype and after.stride() == before.stride()
        assert after.data_ptr() != before.data_ptr() and after.data_ptr() % huge_pages.ALIGN == 0
        if "THPeligible" in (mapping_of(after.data_ptr()) or {}):
            assert huge_page_eligible(after)
        assert advised_huge(after) in (True, None)
    assert advised_huge(small) == small_marked
    # and the marking is the arena's mappings', not the process's: a fresh mapping has none
    fresh = mmap.mmap(-1, 4 * huge_pages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fresh_tensor = torch.frombuffer(fresh, dtype=torch.uint8)
    assert advised_huge(fresh_tensor) in (False, None)
    del fresh_tensor
    assert arena.placed_bytes == sum(t.numel() * t.element_size() for t in placed)
    zeros = arena.zeros((4, 16, 2, 8), torch.bfloat16)
    assert zeros.dtype == torch.bfloat16 and not zeros.any() and arena.holds(zeros)
    # what cannot be moved, or is there already, is given back as it is
    empty, gappy = torch.empty(0), torch.randn(8, 8)[:, ::2]
    assert arena.place(empty) is empty and arena.place(gappy) is gappy
    made = arena.empty((5, 7), torch.int16)  # (a weight packed straight into the arena)
    assert made.shape == (5, 7) and made.dtype == torch.int16 and arena.holds(made)
    assert arena.place(made) is made and arena.place(placed[0]) is placed[0] and not arena.holds(small)


@needs_thp
def test_a_mapping_is_unmapped_with_its_last_tensor():
    arena = huge_pages.HugePageArena()
    big = arena.place(torch.ones(huge_pages.CHUNK // 4))
    address = big.data_ptr()
    assert mapping_of(address) is not None
    del big, arena
    gc.collect()
    assert mapping_of(address) is None


def test_the_switch_and_the_kernels_mode_say_why_not(monkeypatch, tmp_path):
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.unavailable_reason() == f"{huge_pages.ENV}=0"
    monkeypatch.delenv(huge_pages.ENV)
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_MODE", mode)
    if sys.platform.startswith("linux"):
        assert huge_pages.thp_mode() == "never" and "off" in huge_pages.unavailable_reason()
        mode.write_text("always [madvise] never\n")
        assert huge_pages.thp_mode() == "madvise" and huge_pages.unavailable_reason() is None
    monkeypatch.setattr(huge_pages, "_THP_MODE", tmp_path / "missing")
    assert huge_pages.thp_mode() is None and huge_pages.unavailable_reason() is not None


def _decode_logits(ex: ModelExecutor) -> torch.Tensor:
    prompts = [([3 + 5 * r + j for j in range(6)], 0, [r]) for r in range(2)]
    ex.execute(*build_metadata(ex, prompts))
    return ex.execute(*build_metadata(ex, [([7 + r], 6, [r]) for r in range(2)]))


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_executors_weights_and_kv_cache_move_and_give_the_same_logits(tmp_path, monkeypatch, dtype):
    from gguf import GGMLQuantizationType as Q

    files = open_model(export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "m.gguf", Q.Q4_1))
    kw = dict(dtype=dtype, num_blocks=32, max_model_len=64)
    moved = ModelExecutor(files, **kw)
    assert moved.pages.startswith("weights and KV cache in 2 MB pages")
    monkeypatch.setenv(huge_pages.ENV, "0")
    # Off means no 2 MB mapping at all. (Checked on the mechanism, not on the kept KV cache's
    # mark: torch's heap memory can carry one from numpy, which marks its large arrays' pages.)
    mapped: list[int] = []
    real_mapping = huge_pages._mapping
    monkeypatch.setattr(huge_pages, "_mapping", lambda nbytes: mapped.append(nbytes) or real_mapping(nbytes))
    kept = ModelExecutor(files, **kw)
    monkeypatch.setattr(huge_pages, "_mapping", real_mapping)
    assert kept.pages.endswith(f"({huge_pages.ENV}=0)") and mapped == []
    assert torch.equal(_decode_logits(moved), _decode_logits(kept))
    # Each KV cache a tensor of its own, as torch.zeros makes one (no view, storage offset 0):
    # --compile compiles the paged attention kernel once for every layer's cache, and dynamo
    # guards an input's storage offset (views at their chunk's offsets recompiled per layer).
    assert all(t._base is None and t.storage_offset() == 0 for pair in moved.kv_caches for t in pair)
    if "THPeligible" not in (mapping_of(moved.kv_caches[0][0].data_ptr()) or {}):
        return  # (a kernel without the field: the values above are what can be checked)
    assert huge_page_eligible(moved.kv_caches[0][0]) and advised_huge(moved.kv_caches[0][0]) in (True, None)
    layer = moved.model.model.layers[0]
    streamed = (layer.mlp.down_proj.int4.parts[0].codes if layer.mlp.down_proj.int4 is not None
                and layer.mlp.down_proj.int4.parts is not None else layer.mlp.down_proj.weight)
    if streamed.layout == torch.strided and streamed.numel():  # (oneDNN's packed weights stay)
        assert huge_page_eligible(streamed)
    assert huge_page_eligible(moved.model.model.norm.weight)
