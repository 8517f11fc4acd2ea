"""A CPU graph: the C kernel calls of a piece of eager code, recorded once and replayed
without the Python that made them. The CPU loop's counterpart of a CUDA graph.

A decode step of SmolLM2-135M makes ~270 calls into the C kernels (projections, norms,
rotary embedding, KV-cache write, attention), and the Python around them (module calls,
argument checks, tensor allocation, ctypes conversions) cost ~10 of a 16-row step's 36 ms
(measured: the same calls replayed from a list took 26.5 ms). Like a CUDA graph, a recording
fixes every address and every shape: the caller records with inputs in buffers it keeps,
writes each new step's inputs into those buffers, and replays. The replay makes the calls
from C in one call (``replay.c``, :data:`REPLAY`) where it builds, else from Python.

:func:`record` runs the code once and keeps what the replay needs:

- every call into a kernel library's ``kernels`` (:class:`blink.shared.native_build.NativeLibrary`),
  with its arguments as passed;
- every tensor the code allocates (the kernels' outputs and scratch), so that the addresses
  the calls hold stay valid. Memory the code has let go of (no tensor refers to it any more:
  a layer's scratch once the next layer runs) is handed to the code's later allocations, as
  the eager allocator would: the replay makes the same calls in the same order, so a buffer
  is reused only after its last reader, and a graph keeps about one layer's activations
  instead of every layer's.

It refuses code it could not replay: a torch op that computes (anything but allocating
uninitialised memory or taking a view) or a call into a library function that is neither a
declared kernel nor a query. Those raise :class:`GraphRecordingError`, and the caller runs
eagerly instead.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from blink.kernels.cpu import abi
from blink.shared.native_build import NativeLibrary, recording_calls

aten = torch.ops.aten
log = logging.getLogger("blink.kernels")

#: replay.c (generated from abi.py: ``python -m blink.kernels.cpu.abi``): a graph's calls made
#: from C in one call. Without it (no compiler) the replay makes them from Python, one ctypes
#: call each, with the same arguments in the same order.
REPLAY = NativeLibrary(
    Path(__file__).with_name("replay.c"), what="the CPU graphs' replay in C", logger=log,
    fallback="CPU graphs make their calls from Python", flags=("-O2",),
    setup=lambda library: abi.declare(library, abi.REPLAY), queries=("blink_replay",))
#: the thunk of each (restype, argtypes) in replay.c
_THUNKS = {signature: i for i, signature in enumerate(abi.replay_signatures())}


class _CallArrays(NamedTuple):
    """A graph's calls as replay.c's arrays (``blink_call_t[n]``, ``blink_arg_t[...]``)."""

    calls: ctypes.Array
    args: ctypes.Array
    n: int


class _CCall(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("thunk", ctypes.c_int64), ("checked", ctypes.c_int64),
                ("first", ctypes.c_int64)]


class _CArg(ctypes.Union):
    _fields_ = [("p", ctypes.c_void_p), ("i", ctypes.c_int64), ("f", ctypes.c_float)]

# Allocations of uninitialised memory: no values are computed, so nothing is lost by not
# replaying them (the recording keeps the tensor they made).
_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                          aten.new_empty.default})


class GraphRecordingError(RuntimeError):
    """The recorded code did something a replay would not repeat."""


class _Call(NamedTuple):
    function: Callable[..., Any]
    args: tuple
    name: str
    checked: bool  # returns a status (0: done) that the replay checks


class CpuGraph:
    """The recorded calls, in order, and the tensors they address (see the module's doc)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        # kept alive: the calls hold their addresses. Each is an alias of its own (not the
        # tensor the code got), so that its storage's use count tells whether the code still
        # refers to the memory (_unreferenced)
        self._tensors: list[torch.Tensor] = []
        #: the calls as replay.c's arrays, made at the first replay; False: a call replay.c
        #: cannot make (an argument of a type it does not take), which replays from Python
        self._arrays: _CallArrays | bool | None = None

    def replay(self) -> None:
        """Make the recorded calls again with the same arguments, from C in one call where
        replay.c is built (else one ctypes call each). A call that returns a failure status
        (a block id outside the cache, a position outside the rotary table: bad inputs
        written into the buffers) raises, as the eager code would have; no later call runs."""
        if self._arrays is None:
            self._arrays = _call_arrays(self.calls)
        arrays, library = self._arrays, REPLAY.get()
        if not arrays or library is None:
            for function, args, name, checked in self.calls:
                status = function(*args)
                if checked and status != 0:
                    raise RuntimeError(f"CPU graph replay: {name} failed with status {status}")
            return
        status = ctypes.c_int64(0)
        failed = library.blink_replay(arrays.calls, arrays.n, arrays.args, ctypes.byref(status))
        if failed >= 0:
            raise RuntimeError(f"CPU graph replay: {self.calls[failed].name} failed with status {status.value}")

    def retarget(self, library: ctypes.CDLL, names: frozenset[str] | set[str]) -> None:
        """Point the recorded calls of the kernels ``names`` at ``library``'s functions of the
        same names (another build of the same source, declared alike), the arguments kept: a
        benchmark's A/B of two versions of a kernel in whole replayed steps. Retargeting at
        the first library undoes it."""
        for i, call in enumerate(self.calls):
            if call.name in names:
                self.calls[i] = call._replace(function=getattr(library, call.name))
        self._arrays = None  # replay.c's arrays hold the old addresses: made again at the next replay

    def _allocated(self, out: torch.Tensor) -> torch.Tensor:
        """``out``, just allocated by the recorded code, on memory the graph keeps: the
        smallest kept buffer the code no longer refers to that holds it, else its own."""
        need = out.untyped_storage().nbytes()
        best, best_bytes = None, None
        for keep in self._tensors:
            storage = keep.untyped_storage()
            size = storage.nbytes()
            if need <= size and (best_bytes is None or size < best_bytes) and _unreferenced(keep):
                best, best_bytes = storage, size
        if best is None:
            self._tensors.append(out.detach())
            return out
        return out.set_(best, 0, out.size(), out.stride())

    @property
    def kept_bytes(self) -> int:
        """Bytes of the tensors the recording keeps alive."""
        seen: dict[int, int] = {}
        for t in self._tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def _call_arrays(calls: list[_Call]) -> _CallArrays | bool:
    """``calls`` as replay.c's arrays: each function's address and thunk (by its declared
    restype and argtypes), its arguments converted as ctypes would convert them for that
    call. False where a call's signature or an argument is one replay.c does not take."""
    arrays = (_CCall * max(len(calls), 1))()
    args: list[_CArg] = []
    for i, (function, values, _, checked) in enumerate(calls):
        argtypes = tuple(function.argtypes or ())
        thunk = _THUNKS.get((function.restype, argtypes))
        if thunk is None or len(values) != len(argtypes):
            return False
        arrays[i] = _CCall(ctypes.cast(function, ctypes.c_void_p).value, thunk, int(checked), len(args))
        for ctype, value in zip(argtypes, values):
            arg = _c_arg(ctype, value)
            if arg is None:
                return False
            args.append(arg)
    return _CallArrays(arrays, (_CArg * max(len(args), 1))(*args), len(calls))


def _c_arg(ctype: type, value: Any) -> _CArg | None:
    """One recorded argument as replay.c takes it (ctypes' own conversion: a pointer from an
    int, None or a c_void_p; an integer truncated to the C type; a float), or None."""
    if ctype is abi.P:
        if isinstance(value, ctypes.c_void_p):
            value = value.value
        if value is None or isinstance(value, int):
            return _CArg(p=value or 0)
        return None
    if ctype in (abi.I64, abi.INT) and isinstance(value, int):
        return _CArg(i=ctype(value).value)
    if ctype is abi.F32 and isinstance(value, (int, float)):
        return _CArg(f=value)
    return None


class _LibraryView:
    """What a kernel library looks like to the recording thread: kernels recorded as they
    run, queries and plain attributes passed through, any other function refused."""

    def __init__(self, graph: CpuGraph, native: NativeLibrary, library: ctypes.CDLL) -> None:
        self._graph, self._native, self._library = graph, native, library

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._library, name)
        if name in self._native.queries or not callable(value):
            return value
        if name not in self._native.kernels:
            raise GraphRecordingError(f"{self._native.source.name}: {name} is neither a kernel nor a query")
        graph, checked = self._graph, value.restype is not None

        def recorded(*args: Any) -> Any:
            graph.calls.append(_Call(value, args, name, checked))
            return value(*args)

        return recorded


class _Recorder:
    def __init__(self, graph: CpuGraph) -> None:
        self.graph = graph

    def library_view(self, native: NativeLibrary, library: ctypes.CDLL) -> _LibraryView:
        return _LibraryView(self.graph, native, library)


class _NoComputeMode(TorchDispatchMode):
    """Lets through allocations (kept) and views; refuses any torch op that computes."""

    def __init__(self, graph: CpuGraph) -> None:
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap this mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
        whose first call imports ``torch._dynamo`` and with it Triton where it is installed. A
        recording is never compiled, and the CPU engine then never imports Triton: its nanobind
        module listed hundreds of "leaked" types and functions as every ``blink serve`` exited,
        and the import cost start time and memory for nothing."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            return self.graph._allocated(out)
        inputs = {_storage(t) for t in _tensors_in((args, kwargs))} - {None}
        if not all(_storage(t) in inputs for t in _tensors_in(out)):
            # (an op whose schema says "view" may still copy: contiguous(), reshape() and to()
            # return their input only when no work is needed)
            raise GraphRecordingError(f"the recorded code computes with torch ({func})")
        return out


# a storage's reference count (torch's private API; a torch without it: nothing is reused)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _unreferenced(keep: torch.Tensor) -> bool:
    """Whether only ``keep`` (a graph's own alias) refers to its storage: its use count is
    one per tensor on it plus one for the storage's Python object (which asking makes). (A
    bare storage object held without a tensor would not count: the recorded code holds none.)"""
    if _USE_COUNT is None:
        return False
    return _USE_COUNT(keep.untyped_storage()._cdata) <= 2


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one (oneDNN's packed weights)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


@contextmanager
def record() -> Iterator[CpuGraph]:
    """Record the C kernel calls of the code run inside (on this thread) into a
    :class:`CpuGraph`. The code runs for real. Raises :class:`GraphRecordingError` from the
    offending torch op or library lookup when the code could not be replayed."""
    graph = CpuGraph()
    with recording_calls(_Recorder(graph)), _NoComputeMode(graph):
        yield graph
