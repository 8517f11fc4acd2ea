"""Disaggregated prefill/decode: the KV-cache region a decode engine exposes, and the sender a
prefill engine runs after each step (docs/disaggregation.md).

The KV region is one contiguous array ``[layers, 2 (K, V), num_blocks + 1, block_size,
kv_heads, head_dim]`` of the engine dtype (:class:`KVLayout`). A decode engine allocates its
KV cache inside a transport region (loopback: a shared-memory segment; verbs: a registered
memory region) and the executor's per-layer caches are views of it, so a prefill engine can
write a block straight into the place the decode engine's attention reads it from: no copy on
the decode side, no host work there at all (its scheduler admits the row when the ring's
``kv_ready_seq`` says so, :meth:`blink.engine.sched.scheduler.Scheduler._admit_kv_ready`).

The prefill side (:class:`KVSender`) is host code of the CPU loop: a row whose request
carries ``kv_mode = KV_SEND`` gets its prompt's blocks written into the decode engine's
reserved blocks — per layer, K then V, one piece per run of consecutive source and
destination blocks, a layer's pieces in one copy-list call where the transport has one —
then the first token and the ``kv_ready_seq`` word, in that order, with a fence between.
Layer by layer during the forward of the step that completes the prompt, when that step also
finishes the request (``max_tokens == 1``, :meth:`KVSender.before_forward`); otherwise whole,
after its last step. The blocks move whole: ``ceil(prompt_len / block_size)`` blocks, i.e.
``2 * layers * kv_heads * head_dim * dtype_bytes * block_size * ceil(prompt_len /
block_size)`` bytes. With ARK on (``--fabric``) each transfer's writes run under a path lease
(``path_selector``), released when they end.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from blink.errors import BlinkError
from blink.ring import (
    CONTROL_WORDS,
    C_TOTAL_BYTES,
    C_STAT_KV_BYTES_SENT,
    C_STAT_KV_TRANSFERS,
    FINISH_LENGTH,
    FINISH_STOP,
    KV_NONE,
    KV_SEND,
    RingLayout,
    read_header,
)
from blink.engine.sched.state import (
    KV_ROUTE_MODE,
    KV_ROUTE_PEER,
    KV_ROUTE_SEQ,
    KV_ROUTE_SLOT,
    ROW_RELEASING,
)
from blink.transport import TransportError, host_copy
from blink.transport.base import HandshakeError, Transport

log = logging.getLogger("blink.engine.kv")


@functools.lru_cache(maxsize=None)
def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


@dataclass(frozen=True)
class KVLayout:
    """The byte layout of a KV region; both engines must have the same one."""

    num_layers: int
    num_blocks: int  # usable blocks; the region holds num_blocks + 1 (the scratch block)
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch."

    @property
    def element_size(self) -> int:
        return _element_size(self.dtype)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.kv_heads * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        return max(self.num_layers * 2 * (self.num_blocks + 1) * self.block_nbytes, 1)

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of block ``block`` of layer ``layer``'s K (kv=0) or V (kv=1)."""
        return ((layer * 2 + kv) * (self.num_blocks + 1) + block) * self.block_nbytes

    def bytes_for(self, num_tokens: int) -> int:
        """Bytes a transfer of ``num_tokens`` prompt tokens moves (whole blocks)."""
        blocks = -(-num_tokens // self.block_size)
        return 2 * self.num_layers * blocks * self.block_nbytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "KVLayout":
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise HandshakeError(f"the decode engine's kv_layout is malformed: {data!r}") from exc

    @classmethod
    def of_executor(cls, executor: Any, dtype: torch.dtype) -> "KVLayout":
        caches = executor.kv_caches
        if not caches:  # the null model: no KV at all
            return cls(0, executor.num_blocks, executor.block_size, 1, 1, str(dtype).removeprefix("torch."))
        blocks, block_size, heads, dim = caches[0][0].shape
        return cls(len(caches), blocks - 1, block_size, heads, dim, str(caches[0][0].dtype).removeprefix("torch."))


def share_kv_cache(executor: Any, layout: KVLayout, buffer: Any) -> torch.Tensor:
    """Decode role: make the executor's KV caches views of ``buffer`` (the KV region), laid
    out as ``layout``. Returns the whole region as one tensor."""
    shape = (layout.num_layers, 2, layout.num_blocks + 1, layout.block_size, layout.kv_heads,
             layout.head_dim)
    count = layout.num_layers * 2 * (layout.num_blocks + 1) * layout.block_nbytes
    if count == 0:
        return torch.empty(0)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=count)
    region = raw.view(getattr(torch, layout.dtype)).view(shape)
    executor.kv_caches = [(region[layer, 0], region[layer, 1]) for layer in range(layout.num_layers)]
    return region


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) runs where both sides' block ids go up by one: each run is
    one transport write per layer and K/V instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def transfer_segments(layout: KVLayout, runs: Sequence[tuple[int, int, int]],
                      layers: Sequence[int]) -> np.ndarray:
    """The copy list of a transfer: one row ``(cache index, source byte offset, region byte
    offset, length)`` per layer of ``layers``, K then V, and run of consecutive blocks, where
    cache index ``2 * i + kv`` is the i-th layer's K (kv=0) or V (kv=1) cache."""
    nb = layout.block_nbytes
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    # region offset of block 0 of each (layer, kv): layout.offset, for every cache at once
    starts = ((np.asarray(layers, dtype=np.int64)[:, None] * 2 + np.arange(2)) * (layout.num_blocks + 1) * nb)
    seg = np.empty((len(starts), 2, len(r), 4), dtype=np.int64)
    seg[..., 0] = np.arange(2 * len(starts)).reshape(-1, 2, 1)
    seg[..., 1] = r[:, 0] * nb
    seg[..., 2] = starts[:, :, None] + r[:, 1] * nb
    seg[..., 3] = r[:, 2] * nb
    return seg.reshape(-1, 4)


def cache_sources(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> host_copy.Sources:
    """A flat byte view of every cache, layer-major, K then V (cache index ``2 * layer + kv``),
    with their addresses. Views, not copies: made once, they stay valid as long as the caches."""
    return host_copy.Sources([cache.view(torch.uint8).numpy().reshape(-1) for pair in caches for cache in pair])


class BlockWrite:
    """One transfer's pieces, laid out (and, where the transport can, checked) once; written
    whole or one layer at a time (layer-by-layer streaming), one transport call each.

    One piece per layer, K/V and run of consecutive blocks (:func:`transfer_segments`, layer
    major). Where the transport takes a copy list (loopback's ``prepare_segments`` /
    ``write_prepared``) a write is one call that moves each byte once, over the engine's torch
    thread count: a fragmented pool's thousands of 6 KiB pieces cost no Python each.
    Otherwise (verbs) one ``write`` per piece. ``sources``: the caches' :func:`cache_sources`.
    """

    def __init__(self, transport: Transport, layout: KVLayout, sources: host_copy.Sources,
                 src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        self.transport, self.layout, self.sources = transport, layout, sources
        runs = block_runs(src_blocks, dst_blocks)
        self.per_layer = 2 * len(runs)  # rows of the copy list per layer
        self.segments = transfer_segments(layout, runs, range(layout.num_layers))
        prepare = getattr(transport, "prepare_segments", None)
        self.prepared = prepare(sources, self.segments) if prepare is not None else None

    def write(self, layers: range | None = None) -> int:
        """Write the pieces of ``layers`` (default: all); returns the bytes written."""
        layers = range(self.layout.num_layers) if layers is None else layers
        start, stop = layers.start * self.per_layer, layers.stop * self.per_layer
        if self.prepared is not None:
            return self.transport.write_prepared(self.prepared, start, stop, torch.get_num_threads())
        rows = self.segments[start:stop]
        for index, src_off, dst_off, length in rows.tolist():
            self.transport.write(dst_off, self.sources[index][src_off : src_off + length])
        return int(rows[:, 3].sum())


def write_blocks(transport: Transport, layout: KVLayout, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: range | None = None,
                 sources: host_copy.Sources | None = None) -> int:
    """Write the blocks ``src_blocks`` of ``caches`` (the prefill engine's per-layer K/V) into
    blocks ``dst_blocks`` of the remote KV region, for ``layers`` (default: all); returns the
    bytes written (:class:`BlockWrite`). ``sources``: the caches' :func:`cache_sources`, if
    the caller keeps them."""
    sources = cache_sources(caches) if sources is None else sources
    return BlockWrite(transport, layout, sources, src_blocks, dst_blocks).write(layers)


@dataclass
class _Transfer:
    """One row's KV on its way to a decode engine: where, which blocks, its path lease, and
    how far it got."""

    row: int
    route: list[int]
    peer: "_Peer"
    src: list[int]
    dst: list[int]
    blocks: BlockWrite
    lease: Any  # the path_selector's lease, None once released (or without ARK)
    layers_sent: int = 0
    moved: int = 0
    streamed: bool = False  # sent layer by layer during the forward (KVSender.before_forward)
    failed: bool = False


class _Peer:
    """One decode engine as a prefill engine reaches it: its ring (the kv_* slot words) and its
    KV region, both by one-sided writes."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ring: Transport | None = None
        self.kv: Transport | None = None
        self.layout: KVLayout | None = None
        self.ring_layout: RingLayout | None = None
        self.next_try = 0.0

    def close(self) -> None:
        for t in (self.ring, self.kv):
            if t is not None:
                t.close()
        self.ring = self.kv = None


class KVSender:
    """Prefill role: send the KV of rows whose prompt is done, layer by layer during the
    forward or whole after the step (module docstring). ``peers``: the decode engines' bootstrap addresses (``--kv-peer``), indexed as
    the requests' ``kv_peer``; connected on first use and again after a failure (a restarted
    decode engine has a new region)."""

    #: seconds between two attempts to reach a peer that failed
    retry_interval_s = 0.5

    def __init__(self, scheduler: Any, executor: Any, dtype: torch.dtype, control: np.ndarray,
                 peers: Sequence[str], secret: bytes | None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.layout = KVLayout.of_executor(executor, dtype)
        self.control = control
        self.secret = secret
        self.peers = [_Peer(a) for a in peers]
        #: (the executor's cache list, its cache_sources), made at first use
        self._sources: tuple[Any, host_copy.Sources] | None = None
        host_copy.load()  # the loopback copy loop is built (once per machine) now, not mid-transfer
        self.bytes_sent = 0
        self.transfers = 0
        self.failures = 0
        #: transfers sent layer by layer during their prompt's last forward
        self.streamed = 0
        #: layer-by-layer streaming (before_forward); False: every transfer after its step
        self.stream_layers = True
        self._streams: list[_Transfer] = []  # this step's streamed transfers
        self._hooked: tuple[Any, Any] | None = None  # (model, its own on_layer) while hooked
        self._next_layer = 0
        #: test hook: seconds to wait between the KV blocks and the ready word
        self.delay_before_ready_s = 0.0
        #: ARK path selection (``--fabric``, :class:`blink.fabric.kv_paths.ArkPathSelector`):
        #: ``path_selector(peer_index, kv_transport, nbytes)`` before a transfer's first write,
        #: returning a lease (or None: no reservation) whose ``release()`` runs once the
        #: transfer is over, written or failed. Over verbs the selector puts the chosen RoCE
        #: source port on the transport's queue pair. None: the transport's default path.
        self.path_selector: Callable[[int, Transport, int], Any] | None = None

    def pending(self) -> torch.Tensor:
        st = self.scheduler.state
        return (st.kv_route[:, KV_ROUTE_MODE] == KV_SEND) & (st.status == ROW_RELEASING)

    # -- layer-by-layer streaming (docs/disaggregation.md, "The handshake") -----------------

    def before_forward(self, batch: Any) -> None:
        """After ``schedule()``, before the forward (``run_step``'s ``on_scheduled``): open a
        transfer for every KV_SEND row whose prompt this step completes and that finishes with
        this step's token (``max_tokens == 1``, what the router sends), and hook the model's
        per-layer callback so each layer's blocks go as soon as the forward has computed them.
        Other KV_SEND rows are sent whole after their last step (:meth:`after_step`)."""
        model = getattr(self.executor, "model", None)
        if not self.stream_layers or not hasattr(model, "on_layer"):
            return
        st = self.scheduler.state
        new = batch.num_new_tokens
        n = new.shape[0]  # the batch's rows: the scheduler's row window, [0, n)
        completes = ((st.kv_route[:n, KV_ROUTE_MODE] == KV_SEND) & (new > 0)
                     & (st.num_computed[:n] + new == st.num_prompt[:n])
                     & (st.sampling["max_tokens"][:n] == 1))
        if not bool(completes.any()):
            return
        for row in torch.nonzero(completes).flatten().tolist():
            route = st.kv_route[row].tolist()
            st.kv_route[row, KV_ROUTE_MODE] = KV_NONE  # once, whatever happens below
            t = self._guarded(row, route, lambda: self._open(row, route, int(st.num_computed[row] + new[row])))
            if t is not None:
                t.streamed = True
                self._streams.append(t)
        if self._streams:
            previous = model.on_layer
            self._hooked = (model, previous)
            self._next_layer = 0

            def on_layer() -> None:
                if previous is not None:
                    previous()
                self._layer_done()

            model.on_layer = on_layer

    def _layer_done(self) -> None:
        """One more layer's K/V is in the cache for every row of the step: send it."""
        layer = self._next_layer
        self._next_layer += 1
        for t in self._streams:
            if t.failed or layer >= self.layout.num_layers:
                continue
            try:
                t.moved += t.blocks.write(range(layer, layer + 1))
                t.layers_sent += 1
            except (TransportError, OSError, BlinkError) as exc:
                self._fail(t, exc)

    def after_step(self) -> None:
        """Host code, between two steps: finish the step's streamed transfers (fence, release
        the path, publish "KV ready"), then send every other finished KV_SEND row's KV whole."""
        if self._hooked is not None:
            model, previous = self._hooked
            model.on_layer, self._hooked = previous, None
        streams, self._streams = self._streams, []
        finish = self.scheduler.ring["finish_reason"]
        for t in streams:
            if t.failed:
                continue
            if int(finish[t.row]) not in (FINISH_STOP, FINISH_LENGTH):
                # refused in the step: the frontend frees the reservation itself, and only
                # after it saw the finish, i.e. after every write above had landed
                self._release(t)
                continue
            self._guarded(t.row, t.route, lambda: self._complete(t), t)
        pending = self.pending()
        if not bool(pending.any()):
            return
        st = self.scheduler.state
        for row in torch.nonzero(pending).flatten().tolist():
            route = st.kv_route[row].tolist()
            st.kv_route[row, KV_ROUTE_MODE] = KV_NONE  # once, whatever happens below
            if int(finish[row]) not in (FINISH_STOP, FINISH_LENGTH):
                continue  # aborted or refused: the frontend frees the reservation itself
            t = self._guarded(row, route, lambda: self._open(row, route, int(st.num_computed[row])))
            if t is not None:
                self._guarded(row, route, lambda: self._complete(t), t)

    def _guarded(self, row: int, route: list[int], work: Callable[[], Any],
                 transfer: "_Transfer | None" = None) -> Any:
        """``work()``, or None after a logged failure: the transfer's path released, its peer
        closed (a restarted decode engine has a new region), nothing published."""
        try:
            return work()
        except (TransportError, OSError, BlinkError) as exc:
            if transfer is not None:
                self._fail(transfer, exc)
                return None
            self.failures += 1
            peer = route[KV_ROUTE_PEER]
            log.warning("KV transfer of slot %d to decode peer %s failed: %s", row,
                        self.peers[peer].address if 0 <= peer < len(self.peers) else peer, exc)
            if 0 <= peer < len(self.peers):
                self.peers[peer].close()
            return None

    def _fail(self, t: "_Transfer", exc: BaseException) -> None:
        t.failed = True
        self.failures += 1
        log.warning("KV transfer of slot %d to decode peer %s failed: %s", t.row, t.peer.address, exc)
        self._release(t)
        t.peer.close()

    @staticmethod
    def _release(t: "_Transfer") -> None:
        lease, t.lease = t.lease, None
        if lease is not None:
            lease.release()

    def _connect(self, peer: _Peer) -> None:
        """Two bootstraps with the decode engine, both one-sided and lease-free: ``kv_writer``
        (its ring, for the ready words) and ``kv_region`` (its KV region); whatever transport
        it serves (loopback here, verbs RDMA WRITE on a queue pair of its own in production)."""
        from blink.transport.bootstrap import connect

        if time.monotonic() < peer.next_try:
            raise TransportError(f"decode peer {peer.address} failed recently; not retried yet")
        peer.next_try = time.monotonic() + self.retry_interval_s
        host, _, port = peer.address.rpartition(":")
        info, ring = connect(host, int(port), secret=self.secret, role="kv_writer", timeout_s=5.0)
        kv = None
        try:
            layout = KVLayout.from_dict(info.connection.get("kv_layout"))
            if layout != self.layout:
                raise HandshakeError(f"decode peer {peer.address} has KV layout {layout}, this "
                                     f"prefill engine {self.layout}: start both with the same "
                                     f"model, dtype, block size and KV cache size")
            _, kv = connect(host, int(port), secret=self.secret, role="kv_region", timeout_s=5.0)
            if kv.total_bytes < layout.total_bytes:
                raise HandshakeError(f"decode peer {peer.address}: KV region of {kv.total_bytes} "
                                     f"bytes, the layout needs {layout.total_bytes}")
            header = ring.read(0, CONTROL_WORDS * 8)
            full = np.zeros(int(header.view("<i8")[C_TOTAL_BYTES]), dtype=np.uint8)  # lazy pages
            full[: header.size] = header
            peer.ring_layout = RingLayout(read_header(full))
            peer.ring, peer.kv, peer.layout = ring, kv, layout
            log.info("KV peer %s attached (%s transport)", peer.address, info.transport)
        except BaseException:
            ring.close()
            if kv is not None:
                kv.close()
            raise

    def _peer(self, index: int) -> _Peer:
        if not 0 <= index < len(self.peers):
            raise BlinkError(f"request names KV peer {index}; this engine has {len(self.peers)} "
                             f"(--kv-peer)")
        peer = self.peers[index]
        alive = getattr(peer.ring, "peer_alive", None)
        if peer.ring is not None and alive is not None and alive() is False:
            peer.close()  # the decode engine went away: its successor has a new region
        if peer.ring is None:
            self._connect(peer)
        return peer

    def _cache_sources(self) -> host_copy.Sources:
        caches = self.executor.kv_caches
        if self._sources is None or self._sources[0] is not caches:  # made once per cache list
            self._sources = (caches, cache_sources(caches))
        return self._sources[1]

    def _open(self, row: int, route: list[int], computed: int) -> "_Transfer":
        """Reach the peer, check the destination, reserve the path (``path_selector``).
        ``computed``: the row's prompt tokens in the cache once the writes run."""
        st = self.scheduler.state
        peer = self._peer(route[KV_ROUTE_PEER])
        assert peer.ring is not None and peer.kv is not None and peer.ring_layout is not None
        prompt = int(st.num_prompt[row])
        n = -(-prompt // self.layout.block_size)
        src = st.block_table[row, :n].tolist()
        dst = st.kv_dest_blocks[row, :n].tolist()
        if any(not 0 <= d < self.layout.num_blocks for d in dst) or computed < prompt:
            raise BlinkError(f"slot {row}: bad KV destination {dst} (or prompt not computed)")
        if not 0 <= route[KV_ROUTE_SLOT] < peer.ring_layout.config.n_slots:
            raise BlinkError(f"slot {row}: bad decode slot {route[KV_ROUTE_SLOT]}")
        lease = None
        if self.path_selector is not None:  # the lease ends with the writes (_release)
            lease = self.path_selector(route[KV_ROUTE_PEER], peer.kv, self.layout.bytes_for(prompt))
        try:
            blocks = BlockWrite(peer.kv, self.layout, self._cache_sources(), src, dst)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return _Transfer(row, route, peer, src, dst, blocks, lease)

    def _complete(self, t: "_Transfer") -> None:
        """The layers not sent yet (all of them when not streamed), the fence, the path
        released; then "KV ready"."""
        try:
            layers = self.layout.num_layers
            if t.layers_sent < layers:
                t.moved += t.blocks.write(range(t.layers_sent, layers))
                t.layers_sent = layers
            t.peer.kv.fence()
        finally:
            self._release(t)
        self._publish(t)

    def _publish(self, t: "_Transfer") -> None:
        """The first token, fence, the ready word: the decode engine admits the row."""
        st, peer = self.scheduler.state, t.peer
        if self.delay_before_ready_s:
            time.sleep(self.delay_before_ready_s)
        slot, seq = t.route[KV_ROUTE_SLOT], t.route[KV_ROUTE_SEQ]
        fields = peer.ring_layout.fields
        first = np.asarray(int(st.tokens[t.row, int(st.num_prompt[t.row])]), dtype="<i4")
        peer.ring.write(fields["kv_first_token"].element_offset(slot), first)
        peer.ring.fence()  # the token before the word that publishes it
        peer.ring.write(fields["kv_ready_seq"].element_offset(slot), np.asarray(seq, dtype="<i8"))
        self.bytes_sent += t.moved
        self.transfers += 1
        self.streamed += t.streamed
        self.control[C_STAT_KV_BYTES_SENT] = self.bytes_sent
        self.control[C_STAT_KV_TRANSFERS] = self.transfers

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        close_selector = getattr(self.path_selector, "close", None)
        if close_selector is not None:
            close_selector()
