"""The verbs transport: RDMA over an RC queue pair (pyverbs), for a frontend on another host
(the BlueField DPU).

- Engine (:class:`VerbsRegion`): registers the ring memory as a memory region with remote
  read/write access: GPU memory through a dma-buf MR (GPUDirect RDMA) when the caller gives a
  device pointer and the driver/NIC allow it, pinned host memory otherwise. It makes one RC queue
  pair per connected frontend (during the bootstrap handshake) and never posts anything: every
  transfer is one-sided, driven by the frontend's NIC.
- Frontend (:class:`VerbsTransport`): ``write`` copies into a registered staging buffer and posts
  RDMA WRITE; ``read`` posts RDMA READ into staging and waits for it; ``fence`` waits for the
  completions of every posted write (an RC completion means the data was placed in the engine's
  memory), so a state word written after ``fence()`` can never land before its payload.

pyverbs comes from rdma-core (Debian: ``apt-get install python3-pyverbs``; PyPI's ``pyverbs``
does not work). Without an RDMA device everything fails at start, with a message that points to
``--transport loopback``. numpy only: importing this module imports neither torch nor pyverbs.
"""
from __future__ import annotations

import ctypes
import logging
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from blink.transport.base import Bytes, HandshakeError, TransportError, as_byte_array, check_range
from blink.transport.framing import recv_message, send_message

logger = logging.getLogger(__name__)

LOOPBACK_HINT = (
    "to run the frontend on the engine's machine without RDMA use --transport loopback"
)
PYVERBS_HINT = (
    "the verbs transport needs pyverbs from rdma-core (Debian/Ubuntu: apt-get install "
    "python3-pyverbs, made visible to this interpreter; PyPI's 'pyverbs' does not work)"
)

# RC connection parameters (the values of ibv_rc_pingpong and rdma-core's tests).
MIN_RNR_TIMER = 12
TIMEOUT = 14  # 4.096 us * 2**14 = 67 ms local ACK timeout
RETRY_CNT = 7
RNR_RETRY = 7
MAX_RD_ATOMIC = 1  # outstanding RDMA READs; the frontend issues one at a time
DEFAULT_DEPTH = 128  # send queue / completion queue depth
DEFAULT_STAGING_BYTES = 1 << 20
COMPLETION_TIMEOUT_S = 5.0

_GID_RE = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_ZERO_GID = ":".join(["0000"] * 8)


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules this transport uses, or :class:`TransportError` naming the fix."""
    try:
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.enums
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.pyverbs_error
        import pyverbs.qp
        import pyverbs.wr
    except ImportError as exc:
        raise TransportError(f"{PYVERBS_HINT}; {LOOPBACK_HINT} ({exc})") from None
    return SimpleNamespace(
        addr=pyverbs.addr, cq=pyverbs.cq, device=pyverbs.device, enums=pyverbs.enums,
        mr=pyverbs.mr, pd=pyverbs.pd, qp=pyverbs.qp, wr=pyverbs.wr,
        PyverbsError=pyverbs.pyverbs_error.PyverbsError,
    )


def list_devices() -> list[str]:
    """Names of the RDMA devices on this machine; :class:`TransportError` if there are none."""
    pv = load_pyverbs()
    reason = "the device list is empty"
    try:
        devices = pv.device.get_device_list()
    except pv.PyverbsError as exc:  # no uverbs device at all: ibv_get_device_list fails
        devices, reason = [], str(exc)
    if not devices:
        raise TransportError(
            f"verbs transport: no RDMA device on this machine ({reason}; is there an "
            f"InfiniBand/RoCE NIC with its driver loaded? see `ibv_devices`); {LOOPBACK_HINT}"
        )
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def open_device(name: str | None = None) -> Any:
    """An opened ``pyverbs.device.Context`` for ``name`` (default: the first device)."""
    pv = load_pyverbs()
    names = list_devices()
    if name is not None and name not in names:
        raise TransportError(f"verbs transport: no RDMA device {name!r} (found: {', '.join(names)})")
    try:
        return pv.device.Context(name=name or names[0])
    except pv.PyverbsError as exc:
        raise TransportError(f"verbs transport: cannot open RDMA device {name or names[0]}: {exc}") from exc


# -- what each side tells the other -----------------------------------------------------------


def _check_uint(value: Any, bits: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < (1 << bits):
        raise HandshakeError(f"verbs handshake: {what} must be a {bits}-bit unsigned integer, got {value!r}")
    return value


@dataclass(frozen=True)
class VerbsEndpoint:
    """One end of an RC connection: what the peer needs to move its queue pair to RTR."""

    qp_num: int  # 24 bits
    psn: int  # initial packet sequence number, 24 bits
    lid: int  # port LID (InfiniBand), 0 on RoCE
    gid: str  # 8 groups of 4 hex digits; all zeros when the fabric routes by LID only
    mtu: int  # ibv_mtu enum value (1 = 256 bytes ... 5 = 4096 bytes)

    def __post_init__(self) -> None:
        _check_uint(self.qp_num, 24, "qp_num")
        _check_uint(self.psn, 24, "psn")
        _check_uint(self.lid, 16, "lid")
        if not isinstance(self.mtu, int) or not 1 <= self.mtu <= 5:
            raise HandshakeError(f"verbs handshake: mtu must be an ibv_mtu value 1..5, got {self.mtu!r}")
        if not isinstance(self.gid, str) or not _GID_RE.match(self.gid):
            raise HandshakeError(f"verbs handshake: gid must look like fe80:0000:...:0001, got {self.gid!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "VerbsEndpoint":
        if not isinstance(data, dict):
            raise HandshakeError(f"verbs handshake: endpoint must be an object, got {data!r}")
        missing = [k for k in ("qp_num", "psn", "lid", "gid", "mtu") if k not in data]
        if missing:
            raise HandshakeError(f"verbs handshake: endpoint lacks {', '.join(missing)}")
        return cls(qp_num=data["qp_num"], psn=data["psn"], lid=data["lid"], gid=data["gid"], mtu=data["mtu"])

    @property
    def is_global(self) -> bool:
        """Whether packets need a global route header (always on RoCE)."""
        return self.gid != _ZERO_GID


@dataclass(frozen=True)
class RemoteRegion:
    """The engine's memory region as the frontend addresses it."""

    addr: int  # remote virtual address (host MR) or iova (dma-buf MR) of byte 0
    rkey: int
    total_bytes: int
    memory: str  # "host-pinned" or "gpu-dmabuf"

    @classmethod
    def from_connection(cls, info: dict[str, Any], total_bytes: int) -> "RemoteRegion":
        return cls(
            addr=_check_uint(info.get("addr"), 64, "addr"),
            rkey=_check_uint(info.get("rkey"), 32, "rkey"),
            total_bytes=total_bytes,
            memory=str(info.get("memory", "host-pinned")),
        )


# -- verbs object construction (no device needed: unit-tested) -------------------------------


def remote_access_flags(pv: SimpleNamespace) -> int:
    e = pv.enums
    return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)


def qp_init_attr(pv: SimpleNamespace, cq: Any, depth: int) -> Any:
    """RC queue pair attributes: ``depth`` send WRs of one SGE; no receives are ever posted."""
    cap = pv.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def qp_reset_to_init_attr(pv: SimpleNamespace, port: int) -> Any:
    """RESET -> INIT: the port, and remote read/write allowed on this queue pair."""
    attr = pv.qp.QPAttr(qp_state=pv.enums.IBV_QPS_INIT, port_num=port)
    attr.pkey_index = 0
    attr.qp_access_flags = remote_access_flags(pv)
    return attr


def qp_connect_attr(
    pv: SimpleNamespace, port: int, gid_index: int, local: VerbsEndpoint, remote: VerbsEndpoint
) -> Any:
    """INIT -> RTR -> RTS towards ``remote`` (``QP.to_rts`` takes one attr for both steps)."""
    attr = pv.qp.QPAttr(port_num=port)
    attr.qp_access_flags = remote_access_flags(pv)
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.sq_psn = local.psn
    attr.max_dest_rd_atomic = MAX_RD_ATOMIC
    attr.max_rd_atomic = MAX_RD_ATOMIC
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    if remote.is_global:
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(remote.gid), sgid_index=gid_index)
        attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, is_global=1, port_num=port, gr=gr)
    else:
        attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, is_global=0, port_num=port)
    return attr


def rdma_work_request(
    pv: SimpleNamespace, *, write: bool, wr_id: int, local_addr: int, length: int, lkey: int,
    remote_addr: int, rkey: int,
) -> Any:
    """A signaled RDMA WRITE (local -> remote) or READ (remote -> local) of one SGE."""
    e = pv.enums
    sge = pv.wr.SGE(local_addr, length, lkey)
    opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
    wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


def host_view(address: int, nbytes: int) -> np.ndarray:
    """uint8 numpy view of ``nbytes`` of process memory at ``address`` (a registered MR)."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)


# -- both sides: an RC queue pair ------------------------------------------------------------


class QueuePair:
    """An RC queue pair with its own completion queue, in INIT state until :meth:`connect`."""

    def __init__(self, pv: SimpleNamespace, ctx: Any, pd: Any, *, port: int, gid_index: int,
                 depth: int = DEFAULT_DEPTH) -> None:
        self.pv, self.port, self.gid_index, self.depth = pv, port, gid_index, depth
        try:
            self.cq = pv.cq.CQ(ctx, depth, None, None, 0)
            # Given an attr, pyverbs takes an RC queue pair RESET -> INIT right away.
            self.qp = pv.qp.QP(pd, qp_init_attr(pv, self.cq, depth), qp_reset_to_init_attr(pv, port))
            port_attr = ctx.query_port(port)
            gid = str(ctx.query_gid(port, gid_index)) if gid_index >= 0 else _ZERO_GID
        except pv.PyverbsError as exc:
            raise TransportError(f"verbs transport: cannot create an RC queue pair: {exc}") from exc
        self.endpoint = VerbsEndpoint(
            qp_num=self.qp.qp_num, psn=secrets.randbits(24), lid=int(port_attr.lid),
            gid=gid.lower(), mtu=int(port_attr.active_mtu),
        )

    def connect(self, remote: VerbsEndpoint) -> None:
        try:
            self.qp.to_rts(qp_connect_attr(self.pv, self.port, self.gid_index, self.endpoint, remote))
        except self.pv.PyverbsError as exc:
            raise TransportError(
                f"verbs transport: cannot connect queue pair {self.endpoint.qp_num} to remote "
                f"queue pair {remote.qp_num} (lid {remote.lid}, gid {remote.gid}): {exc}"
            ) from exc

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.debug("verbs: close failed", exc_info=True)


# -- engine side ------------------------------------------------------------------------------


def cuda_dmabuf_fd(device_ptr: int, nbytes: int) -> int:
    """A dma-buf file descriptor for ``nbytes`` of CUDA device memory (engine side only).

    Uses cuda-bindings' ``cuMemGetHandleForAddressRange`` (CUDA >= 11.7, open kernel modules
    or a driver with dma-buf support); imported lazily, so the frontend never needs it.
    """
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
        except ImportError:
            raise TransportError("GPUDirect RDMA needs cuda-bindings (pip install cuda-bindings)") from None
    handle_type = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    err, fd = driver.cuMemGetHandleForAddressRange(device_ptr, nbytes, handle_type, 0)
    if int(err) != 0:
        raise TransportError(f"cuMemGetHandleForAddressRange failed: {err} (no dma-buf support?)")
    return int(fd)


class VerbsRegion:
    """Engine side: the ring memory registered for remote access.

    ``gpu_ptr`` (a CUDA device pointer to ``total_bytes`` of page-aligned memory) asks for
    GPUDirect: the NIC then reads and writes HBM directly. When that is impossible (no
    cuda-bindings, no dma-buf support, a NIC that refuses) the region falls back to pinned host
    memory and says so in ``memory`` and the log; ``buffer`` is ``None`` for a GPU region (the
    engine owns that memory itself) and a writable host buffer otherwise.
    """

    kind = "verbs"

    def __init__(self, total_bytes: int, *, device: str | None = None, port: int = 1,
                 gid_index: int = 0, gpu_ptr: int | None = None, depth: int = DEFAULT_DEPTH) -> None:
        pv = load_pyverbs()
        self.pv, self.port, self.gid_index, self.depth = pv, port, gid_index, depth
        self.total_bytes = total_bytes
        self.ctx = open_device(device)
        self.pd = pv.pd.PD(self.ctx)
        access = remote_access_flags(pv)
        self._buffer: Any = None
        self.mr: Any = None
        if gpu_ptr is not None:
            try:
                fd = cuda_dmabuf_fd(gpu_ptr, total_bytes)
                self.mr = pv.mr.DmaBufMR(self.pd, total_bytes, access, dmabuf=fd, offset=0)
                self.addr = 0  # pyverbs registers a dma-buf MR with iova = offset
                self.memory = "gpu-dmabuf"
            except (TransportError, pv.PyverbsError) as exc:
                logger.warning("verbs: GPUDirect registration failed (%s); using pinned host memory", exc)
        if self.mr is None:
            try:
                # pyverbs allocates page-aligned memory and registers it (which pins it).
                self.mr = pv.mr.MR(self.pd, total_bytes, access)
            except pv.PyverbsError as exc:
                raise TransportError(f"verbs: cannot register {total_bytes} bytes of host memory: {exc}") from exc
            self.addr = int(self.mr.buf)
            self.memory = "host-pinned"
            self._buffer = (ctypes.c_char * total_bytes).from_address(self.mr.buf)
            ctypes.memset(self._buffer, 0, total_bytes)

    @property
    def buffer(self) -> Any:
        return self._buffer

    def session_offer(self, hello: dict[str, Any]) -> tuple[dict[str, Any], QueuePair]:
        qp = QueuePair(self.pv, self.ctx, self.pd, port=self.port, gid_index=self.gid_index, depth=self.depth)
        offer = {"addr": self.addr, "rkey": int(self.mr.rkey), "memory": self.memory, **qp.endpoint.to_dict()}
        return offer, qp

    def session_complete(self, session: QueuePair, message: dict[str, Any]) -> dict[str, Any]:
        session.connect(VerbsEndpoint.from_dict(message.get("endpoint")))
        return {}

    def session_close(self, session: QueuePair) -> None:
        session.close()

    def close(self) -> None:
        for obj in (self.mr, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.debug("verbs: close failed", exc_info=True)


# -- frontend side ----------------------------------------------------------------------------


class VerbsTransport:
    """Frontend side: one-sided RDMA to the engine's region over an RC queue pair.

    Created by :func:`blink.transport.bootstrap.connect` with the bootstrap socket after the
    welcome (its transport fields, ``connection``, and the region's ``total_bytes``); it
    finishes the handshake (connect/ready) and keeps the socket open.
    """

    kind = "verbs"

    def __init__(self, sock: socket.socket, connection: dict[str, Any], total_bytes: int, *,
                 device: str | None = None, port: int = 1, gid_index: int = 0,
                 depth: int = DEFAULT_DEPTH, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 timeout_s: float = 10.0) -> None:
        pv = load_pyverbs()
        self.pv, self.depth = pv, depth
        self.remote = RemoteRegion.from_connection(connection, total_bytes)
        remote_ep = VerbsEndpoint.from_dict(connection)
        self.total_bytes = total_bytes
        self._sock = sock
        self._closed = False
        self._wpos = 0  # next free byte in the write staging half
        self._outstanding = 0  # signaled WRs posted and not yet completed
        self._wr_id = 0
        self._half = staging_bytes  # staging: first half for outgoing writes, second for reads
        self.ctx = self.pd = self.mr = self.qp = None
        try:
            self.ctx = open_device(device)
            #: the RDMA device's name (ARK: mlx5 devices take a UDP source port past RTR)
            self.device_name = device or list_devices()[0]
            self.pd = pv.pd.PD(self.ctx)
            self.mr = pv.mr.MR(self.pd, 2 * staging_bytes, int(pv.enums.IBV_ACCESS_LOCAL_WRITE))
            self._staging = host_view(int(self.mr.buf), 2 * staging_bytes)
            self.qp = QueuePair(pv, self.ctx, self.pd, port=port, gid_index=gid_index, depth=depth)
            self.qp.connect(remote_ep)
            send_message(sock, {"type": "connect", "endpoint": self.qp.endpoint.to_dict()})
            sock.settimeout(timeout_s)
            reply = recv_message(sock, "engine")
            if reply["type"] != "ready":
                raise HandshakeError(
                    f"the engine did not accept the RDMA connection: {reply.get('error', reply)}"
                )
        except pv.PyverbsError as exc:
            self._release()
            raise TransportError(f"verbs transport: setup failed: {exc}") from exc
        except BaseException:
            self._release()
            raise

    # -- posting and completions -------------------------------------------------------------

    def _post(self, write: bool, local_off: int, length: int, remote_off: int) -> None:
        if self._closed:
            raise TransportError("verbs transport is closed")
        if self._outstanding >= self.depth:
            self._drain()
        self._wr_id += 1
        wr = rdma_work_request(
            self.pv, write=write, wr_id=self._wr_id, local_addr=int(self.mr.buf) + local_off,
            length=length, lkey=int(self.mr.lkey), remote_addr=self.remote.addr + remote_off,
            rkey=self.remote.rkey,
        )
        try:
            self.qp.qp.post_send(wr)
        except self.pv.PyverbsError as exc:
            raise TransportError(f"verbs transport: post_send failed: {exc}") from exc
        self._outstanding += 1

    def _drain(self) -> None:
        """Wait until every posted work request has completed (RC completes them in order)."""
        deadline = time.monotonic() + COMPLETION_TIMEOUT_S
        while self._outstanding:
            n, wcs = self.qp.cq.poll(self._outstanding)
            for wc in wcs:
                if wc.status != self.pv.enums.IBV_WC_SUCCESS:
                    self._outstanding = 0
                    raise TransportError(
                        f"verbs transport: RDMA operation failed: "
                        f"{self.pv.cq.cqe_status_to_str(wc.status)} (is the engine still running?)"
                    )
            self._outstanding -= n
            if self._outstanding and time.monotonic() > deadline:
                raise TransportError(
                    f"verbs transport: {self._outstanding} RDMA operations did not complete in "
                    f"{COMPLETION_TIMEOUT_S} s"
                )
        self._wpos = 0

    # -- Transport ---------------------------------------------------------------------------

    def write(self, offset: int, data: Bytes) -> None:
        src = as_byte_array(data)
        check_range(offset, src.size, self.total_bytes, "write")
        pos = 0
        while pos < src.size:
            n = min(src.size - pos, self._half)
            if self._wpos + n > self._half:
                self._drain()  # staging full: wait until the NIC has sent what it holds
            self._staging[self._wpos : self._wpos + n] = src[pos : pos + n]
            self._post(True, self._wpos, n, offset + pos)
            self._wpos += n
            pos += n

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        check_range(offset, nbytes, self.total_bytes, "read")
        out = np.empty(nbytes, dtype=np.uint8)
        pos = 0
        while pos < nbytes:
            n = min(nbytes - pos, self._half)
            self._post(False, self._half, n, offset + pos)
            self._drain()
            out[pos : pos + n] = self._staging[self._half : self._half + n]
            pos += n
        return out

    def fence(self) -> None:
        self._drain()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._drain()
        except TransportError:
            pass
        self._release()
        self._sock.close()  # the engine then destroys its queue pair for us

    def _release(self) -> None:
        self._closed = True
        self._staging = None  # type: ignore[assignment]
        for obj in (self.qp, self.mr, self.pd, self.ctx):
            if obj is None:
                continue
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.debug("verbs: close failed", exc_info=True)
