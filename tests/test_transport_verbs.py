"""The verbs transport without a NIC: clean failure at start, handshake encoding, and the verbs
objects (queue pair attributes, work requests) built exactly as real hardware would get them.

Needs Debian's python3-pyverbs made visible to this interpreter (see .ci/run); the tests that
need pyverbs itself skip with the reason when it is missing.
"""
from __future__ import annotations

import socket
import sys
import threading
from types import SimpleNamespace

import pytest

from blink.ring import LAYOUT_VERSION
from blink.transport import HandshakeError, TransportError, connect, create_region
from blink.transport import verbs as V
from blink.transport.auth import engine_proof, new_nonce
from blink.transport.bootstrap import EngineInfo
from blink.transport.framing import recv_message, send_message

try:
    PV = V.load_pyverbs()
except TransportError as exc:  # pragma: no cover - depends on the machine
    PV = None
    PYVERBS_MISSING = str(exc)
needs_pyverbs = pytest.mark.skipif(PV is None, reason="pyverbs is not installed (apt-get install python3-pyverbs)")

SECRET = b"0123456789abcdef-test-secret"
EP = dict(qp_num=0x1234, psn=0xABCDE, lid=7, gid="fe80:0000:0000:0000:0202:c9ff:fe00:0001", mtu=3)


def _has_rdma_device() -> bool:
    try:
        V.list_devices()
    except TransportError:
        return False
    return True


no_device = pytest.mark.skipif(PV is None or _has_rdma_device(), reason="needs pyverbs and no RDMA device")


# -- clean failure without a device -----------------------------------------------------------


@no_device
def test_engine_region_fails_at_start_naming_loopback():
    with pytest.raises(TransportError) as exc:
        create_region("verbs", 1 << 20)
    msg = str(exc.value)
    assert "no RDMA device" in msg and "--transport loopback" in msg


@no_device
def test_frontend_fails_cleanly_after_a_verbs_welcome():
    """An engine offering verbs to a frontend host without a NIC: a clear error, no traceback
    from pyverbs, and the bootstrap socket is closed."""
    lsock = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()

    def fake_engine():
        conn, _ = lsock.accept()
        with conn:
            hello = recv_message(conn)
            nonce = new_nonce()
            send_message(conn, {"type": "challenge", "nonce": nonce,
                                "proof": engine_proof(SECRET, hello["nonce"], nonce)})
            recv_message(conn)  # the frontend's proof
            info = EngineInfo(LAYOUT_VERSION, "verbs", 1 << 20, "m", 64, "t",
                              {"addr": 0x7F0000000000, "rkey": 0x1F, "memory": "host-pinned", **EP})
            send_message(conn, info.to_message())
            if conn.recv(1) == b"":
                closed.set()

    threading.Thread(target=fake_engine, daemon=True).start()
    with pytest.raises(TransportError, match="--transport loopback"):
        connect(*lsock.getsockname(), secret=SECRET, timeout_s=2.0)
    assert closed.wait(2.0)
    lsock.close()


def test_missing_pyverbs_is_a_clear_error(monkeypatch):
    for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    with pytest.raises(TransportError, match="python3-pyverbs.*--transport loopback"):
        create_region("verbs", 4096)


def test_unknown_transport_kind():
    with pytest.raises(TransportError, match="unknown transport 'tcp'"):
        create_region("tcp", 4096)


# -- handshake encoding -----------------------------------------------------------------------


def test_endpoint_roundtrip_and_validation():
    ep = V.VerbsEndpoint(**EP)
    assert V.VerbsEndpoint.from_dict(ep.to_dict()) == ep and ep.is_global
    assert not V.VerbsEndpoint(**{**EP, "gid": ":".join(["0000"] * 8)}).is_global
    for bad, match in [
        ({"qp_num": 1 << 24}, "qp_num must be a 24-bit"),
        ({"psn": -1}, "psn must be a 24-bit"),
        ({"lid": True}, "lid must be a 16-bit"),
        ({"mtu": 6}, "mtu must be an ibv_mtu"),
        ({"gid": "fe80::1"}, "gid must look like"),
    ]:
        with pytest.raises(HandshakeError, match=match):
            V.VerbsEndpoint.from_dict({**EP, **bad})
    with pytest.raises(HandshakeError, match="lacks gid, mtu"):
        V.VerbsEndpoint.from_dict({"qp_num": 1, "psn": 1, "lid": 1})
    with pytest.raises(HandshakeError, match="must be an object"):
        V.VerbsEndpoint.from_dict(None)


def test_remote_region_from_welcome():
    r = V.RemoteRegion.from_connection({"addr": 1 << 40, "rkey": 99, "memory": "gpu-dmabuf"}, 4096)
    assert (r.addr, r.rkey, r.total_bytes, r.memory) == (1 << 40, 99, 4096, "gpu-dmabuf")
    with pytest.raises(HandshakeError, match="rkey must be a 32-bit"):
        V.RemoteRegion.from_connection({"addr": 0, "rkey": 1 << 32}, 1)
    with pytest.raises(HandshakeError, match="addr"):
        V.RemoteRegion.from_connection({"rkey": 1}, 1)


# -- verbs objects, built without a device ----------------------------------------------------


@needs_pyverbs
def test_queue_pair_attributes():
    e = PV.enums
    init = V.qp_init_attr(PV, None, 64)
    assert init.qp_type == e.IBV_QPT_RC and init.cap.max_send_wr == 64 and init.sq_sig_all == 0
    to_init = V.qp_reset_to_init_attr(PV, port=2)
    assert to_init.port_num == 2 and to_init.qp_state == e.IBV_QPS_INIT
    flags = to_init.qp_access_flags
    assert flags & e.IBV_ACCESS_REMOTE_WRITE and flags & e.IBV_ACCESS_REMOTE_READ

    local = V.VerbsEndpoint(**{**EP, "qp_num": 11, "psn": 22, "mtu": 5})
    remote = V.VerbsEndpoint(**EP)
    attr = V.qp_connect_attr(PV, 1, 3, local, remote)
    assert attr.dest_qp_num == remote.qp_num and attr.rq_psn == remote.psn and attr.sq_psn == 22
    assert attr.path_mtu == 3  # the smaller of both ends
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer) == (14, 7, 7, 12)
    assert attr.max_rd_atomic == attr.max_dest_rd_atomic == 1
    ah = attr.ah_attr
    assert ah.is_global == 1 and ah.dlid == 7 and ah.port_num == 1 and ah.sgid_index == 3
    assert str(ah.dgid) == remote.gid

    ib_only = V.VerbsEndpoint(**{**EP, "gid": ":".join(["0000"] * 8)})
    assert V.qp_connect_attr(PV, 1, 0, local, ib_only).ah_attr.is_global == 0


@needs_pyverbs
def test_rdma_work_requests():
    e = PV.enums
    w = V.rdma_work_request(PV, write=True, wr_id=5, local_addr=0x1000, length=64, lkey=3,
                            remote_addr=0x2000, rkey=9)
    assert w.opcode == e.IBV_WR_RDMA_WRITE and w.wr_id == 5 and w.num_sge == 1
    assert w.send_flags == e.IBV_SEND_SIGNALED
    sges = []  # what went into the scatter-gather element
    spy = SimpleNamespace(**vars(PV))
    spy.wr = SimpleNamespace(SendWR=PV.wr.SendWR, SGE=lambda *a: sges.append(a) or PV.wr.SGE(*a))
    V.rdma_work_request(spy, write=True, wr_id=1, local_addr=0x1000, length=64, lkey=3,
                        remote_addr=0x2000, rkey=9)
    assert sges == [(0x1000, 64, 3)]
    r = V.rdma_work_request(PV, write=False, wr_id=6, local_addr=0x1000, length=8, lkey=3,
                            remote_addr=0x2000, rkey=9)
    assert r.opcode == e.IBV_WR_RDMA_READ


def test_host_view_addresses_process_memory():
    import ctypes

    buf = (ctypes.c_char * 16)()
    view = V.host_view(ctypes.addressof(buf), 16)
    view[3] = 42
    assert buf.raw[3] == 42
