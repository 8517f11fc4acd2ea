"""Find the ops a CUDA graph cannot hold, on any device (the CPU suite included).

A captured CUDA graph replays the kernels it recorded, nothing else. Four kinds of torch code
break that, and none of them fails on CPU tensors, where everything "just works":

- **tensors built from Python data** (``torch.tensor([...])``, ``t[i] = 3``): the values are
  copied host → device at capture time; a replay reuses the stale copy, or the capture fails
  on the pageable copy. Shows up as ``aten.lift_fresh``.
- **host reads of device values** (``.item()``, ``int(t)``, ``bool(t)``, ``torch.equal``): a
  sync, illegal during capture. ``aten._local_scalar_dense`` / ``item`` / ``is_nonzero`` /
  ``equal``.
- **data-dependent output shapes** (``nonzero``, boolean-mask indexing, ``masked_select``,
  ``unique``, ``repeat_interleave`` with tensor repeats, one-argument ``torch.where``): the
  output size must be read back to allocate it.
- **copies across devices** (``.cpu()``, ``.to("cuda")`` inside the step, pinning).

:class:`CaptureAudit` is a ``TorchDispatchMode`` that records every such op with a short
stack, while the code still runs. The suite runs the scheduler, the model phase and the
sampler exactly as the GPU tiers capture them under it (``tests/test_capture_audit.py``).
``torch.compile(fullgraph=True, backend="eager")`` is no substitute: it folds
``torch.tensor([...])`` into a constant and so passes code that a capture rejects.

The dispatch mode only sees ops that reach the dispatcher: ``Tensor.tolist()`` and
``.numpy()`` on a CPU tensor read memory directly, and a device move on a single-device
machine is a no-op. :func:`on_meta` closes that gap: it runs the same code over tensors of
a second device that hold no data, where a host read raises and any mix of devices fails.
"""
from __future__ import annotations

import dataclasses
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: aten op (overload packet) names a graph cannot hold, by reason.
FORBIDDEN: dict[str, str] = {
    "lift_fresh": "tensor built from Python data (host->device copy at capture time)",
    "lift_fresh_copy": "tensor built from Python data (host->device copy at capture time)",
    "_local_scalar_dense": "host read of a device value (sync)",
    "item": "host read of a device value (sync)",
    "is_nonzero": "host read of a device value (bool(tensor))",
    "equal": "host read of a device value (torch.equal)",
    "nonzero": "data-dependent output shape",
    "argwhere": "data-dependent output shape",
    "masked_select": "data-dependent output shape",
    "masked_scatter": "data-dependent read count",
    "unique": "data-dependent output shape",
    "_unique": "data-dependent output shape",
    "_unique2": "data-dependent output shape",
    "unique_dim": "data-dependent output shape",
    "unique_consecutive": "data-dependent output shape",
    "bincount": "data-dependent output shape",
    "_pin_memory": "host memory pinning inside the step",
    "pin_memory": "host memory pinning inside the step",
}

#: ops that take tensor "repeats"/indices whose values set the output shape.
_SHAPE_FROM_VALUES = {"repeat_interleave"}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
_MOVES = {"to", "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One capture-unsafe op: the op, why, and where it was called from."""

    op: str
    reason: str
    where: str

    def __str__(self) -> str:
        return f"{self.op}: {self.reason}\n    at {self.where}"


def _tensors(x: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor)]


_THIS_FILE = __file__.replace("\\", "/")


def _caller() -> str:
    """The innermost project frame that issued the op (file:line function)."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        if "/torch/" in path or path == _THIS_FILE or "/contextlib" in path:
            continue
        short = "/".join(path.rsplit("/", 3)[-3:])
        return f"{short}:{f.lineno} {f.name}"
    return "?"


class CaptureAudit(TorchDispatchMode):
    """Record (and still run) every op a CUDA graph capture cannot hold.

    ``violations`` lists them in order, ``ops`` counts every op seen (so a test can show the
    audit saw the code at all). Use as a context manager around the code a graph captures;
    ``check()`` raises with the list when there is any."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[Violation] = []
        self.ops: dict[str, int] = {}

    def _flag(self, name: str, reason: str) -> None:
        self.violations.append(Violation(name, reason, _caller()))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket.__name__
        name = str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        if packet in FORBIDDEN:
            self._flag(name, FORBIDDEN[packet])
        elif packet in _SHAPE_FROM_VALUES and func._overloadname != "self_int":
            self._flag(name, "data-dependent output shape (tensor repeats)")
        elif packet in _INDEXING and any(t.dtype == torch.bool for t in _tensors(args[1:2])):
            self._flag(name, "boolean-mask indexing (data-dependent shape: nonzero)")
        elif packet in _MOVES:
            self._check_move(name, args, kwargs)
        self._check_devices(name, args, kwargs)
        return func(*args, **kwargs)

    def _check_move(self, name: str, args: tuple, kwargs: dict) -> None:
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device = kwargs.get("device")
        if device is None and len(args) > 1 and isinstance(args[1], (torch.device, str)):
            device = args[1]
        if src is not None and device is not None and torch.device(device) != src.device:
            self._flag(name, f"copy across devices ({src.device} -> {torch.device(device)})")
        if name.startswith("aten.copy_") and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and src is not None and args[1].device != src.device:
            self._flag(name, f"copy across devices ({args[1].device} -> {src.device})")
        if kwargs.get("pin_memory"):
            self._flag(name, "host memory pinning inside the step")

    def _check_devices(self, name: str, args: tuple, kwargs: dict) -> None:
        # A CPU tensor next to device tensors is read by the host at launch: a replay would
        # reuse the value seen at capture. (On a CPU-only run every tensor is on one device.)
        devices = {t.device for t in _tensors((args, kwargs))}
        if len(devices) > 1:
            self._flag(name, "tensors on several devices in one op: "
                       + ", ".join(sorted(str(d) for d in devices)))

    def check(self, what: str = "the captured code") -> None:
        """Raise ``AssertionError`` listing every violation (none: return)."""
        if self.violations:
            lines = "\n".join(f"  {v}" for v in self.violations[:40])
            more = len(self.violations) - 40
            raise AssertionError(f"{len(self.violations)} capture-unsafe op(s) in {what}:\n{lines}"
                                 + (f"\n  ... and {more} more" if more > 0 else ""))


def audit(fn: Callable[[], Any], into: CaptureAudit) -> Callable[[], Any]:
    """``fn`` wrapped so that each call runs under ``into`` (for code run on another thread,
    since dispatch modes are per thread)."""

    def run() -> Any:
        with into:
            return fn()

    return run


# ------------------------------------------------------------ a second device, no data


@contextmanager
def on_meta(*objects: Any) -> Iterator[None]:
    """Move ``objects`` to the ``meta`` device for the body: a second device whose tensors
    have shapes but no data (no GPU needed).

    Every tensor reachable from the objects (attributes of project objects, dataclasses,
    dicts, lists, ``nn.Module`` parameters and buffers) is replaced in place by a meta tensor
    of the same shape, dtype and strides. A host read (``tolist``, ``item``, ``numpy``)
    raises there, and so does an op mixing a CPU tensor with the others: the two things a
    CPU-only dispatch audit cannot see. (A fake ``cuda`` device would be closer, but Python
    indexing of fake CUDA tensors needs a CUDA-enabled torch build.) The objects are unusable
    afterwards."""
    # id -> (the tensor, its meta twin): the tensor is kept so that its id is not reused by
    # another one while the objects are converted (a replaced view may be freed at once)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            seen[id(t)] = (t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        return seen[id(t)][1]

    def convert(obj: Any, depth: int = 0) -> Any:
        if depth > 6 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return obj
        if isinstance(obj, torch.Tensor):
            return meta(obj)
        if isinstance(obj, torch.nn.Module):
            for mod in obj.modules():
                for name, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[name] = meta(p)  # type: ignore[assignment]
                for name, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[name] = meta(b)
                convert_attributes(mod, depth)
            return obj
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                obj[k] = convert(v, depth + 1)
            return obj
        if isinstance(obj, list):
            obj[:] = [convert(v, depth + 1) for v in obj]
            return obj
        if isinstance(obj, tuple):
            items = [convert(v, depth + 1) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        if hasattr(obj, "__dict__") and type(obj).__module__.startswith("blink"):
            convert_attributes(obj, depth)
        return obj

    def convert_attributes(obj: Any, depth: int) -> None:
        skip = {"_parameters", "_buffers", "_modules"} if isinstance(obj, torch.nn.Module) else set()
        for k, v in list(vars(obj).items()):
            if k in skip or (callable(v) and not isinstance(v, torch.nn.Module)):
                continue
            new = convert(v, depth + 1)
            if new is not v:
                object.__setattr__(obj, k, new)

    for obj in objects:
        convert(obj)
    yield
