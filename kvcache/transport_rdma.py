"""Payload mover over RDMA (pyverbs): the fetcher RDMA-READs the owner's registered buffer.

Only the payload uses verbs. The handshake runs on the TCP control connection of peer.py, so
keys, epochs, digests, deadlines and failure reasons are the very code the TCP transport uses:
    fetcher: creates an RC QP (INIT) and sends {qpn, psn, gid, lid} in its fetch offer;
    owner:   creates its QP, moves it to RTS towards the fetcher, replies with its own QP
             info and the entry's memory region (addr, rkey);
    fetcher: moves its QP to RTS, posts RDMA READs into its registered buffer, polls the CQ
             from the event loop (non-blocking poll + short sleeps), then sends {op: done};
    owner:   waits for done (bounded), destroys its QP and releases the entry.
Every store buffer is registered as a memory region when it is allocated (HostStore.registrar).

pyverbs is imported lazily: Debian's python3-pyverbs lives in /usr/lib/python3/dist-packages,
outside a virtualenv's path, so we load just that package from there when a plain import fails.
The mover is built only when `discover()` finds an active port.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import logging
import random
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .protocol import PROTOCOL, TIMEOUT, Deadline, FetchError, TreeHasher, recv_frame, send_frame
from .store import Entry, HostBuffer

log = logging.getLogger("dsuf.kvcache.rdma")

DEBIAN_DIST = "/usr/lib/python3/dist-packages"
READ_CHUNK = 1 << 30  # bytes per RDMA READ work request (below every HCA's max_msg_sz)
MAX_OUTSTANDING = 16  # READs in flight; max_qp_rd_atom is 16 on common HCAs


def import_pyverbs() -> Any:
    """The pyverbs package, or raise ImportError saying why."""
    try:
        import pyverbs  # noqa: F401

        return sys.modules["pyverbs"]
    except ImportError:
        pass
    spec = importlib.machinery.PathFinder.find_spec("pyverbs", [DEBIAN_DIST])
    if spec is None or spec.loader is None:
        raise ImportError(f"pyverbs is not installed (apt-get install python3-pyverbs puts it in {DEBIAN_DIST})")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules["pyverbs"]
        raise
    return mod


@dataclass
class RdmaPort:
    device: str
    port: int
    gid_index: int
    gid: str
    lid: int
    link_layer: str
    mtu: int  # ibv_mtu enum value


def discover(device: str | None = None, port: int | None = None, gid_index: int | None = None
             ) -> tuple[list[RdmaPort], str]:
    """Active RDMA ports (filtered by the flags), and a reason when there are none."""
    try:
        import_pyverbs()
        import pyverbs.device as d
        import pyverbs.enums as e
    except Exception as exc:
        return [], f"pyverbs unavailable: {exc}"
    try:
        devs = d.get_device_list()
    except Exception as exc:  # no kernel support: "Failed to get devices list"
        return [], f"no RDMA devices ({exc})"
    out: list[RdmaPort] = []
    for dev in devs:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        if device and name != device:
            continue
        try:
            ctx = d.Context(name=name)
            nports = ctx.query_device().phys_port_cnt
            for p in range(1, nports + 1):
                if port and p != port:
                    continue
                pa = ctx.query_port(p)
                if pa.state != e.IBV_PORT_ACTIVE:
                    continue
                eth = pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
                idx = gid_index if gid_index is not None else _pick_gid(ctx, p, pa.gid_tbl_len, eth, e)
                if idx is None:
                    continue
                gid = ctx.query_gid(p, idx).gid
                out.append(RdmaPort(name, p, idx, gid, int(pa.lid), "ethernet" if eth else "infiniband",
                                    int(pa.active_mtu)))
            ctx.close()
        except Exception as exc:
            log.warning("RDMA device %s unusable: %s", name, exc)
    if not out:
        return [], "no active RDMA port" + (f" matching {device}:{port}" if device or port else "")
    return out, ""


def _pick_gid(ctx: Any, port: int, n: int, eth: bool, e: Any) -> int | None:
    """InfiniBand: GID 0. RoCE: prefer a RoCE v2 IPv4-mapped GID (routable), else any non-zero."""
    if not eth:
        return 0
    best = None
    for i in range(min(n, 64)):
        try:
            gid = ctx.query_gid(port, i).gid
        except Exception:
            continue
        if gid.replace(":", "").strip("0") == "":
            continue
        try:
            v2 = ctx.query_gid_type(port, i) == e.IBV_GID_TYPE_ROCE_V2
        except Exception:
            v2 = False
        if v2 and gid.startswith("0000:0000:0000:0000:0000:ffff"):
            return i
        if best is None:
            best = i
    return best


def rts_attr(rp: RdmaPort, psn: int, peer: dict) -> Any:
    """QP attributes for INIT -> RTR -> RTS towards `peer` ({qpn, psn, gid, lid, mtu}); builds
    plain structs only, so it runs (and is tested) without a device."""
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=rp.port)
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
    attr.path_mtu = min(rp.mtu, int(peer["mtu"]))
    attr.dest_qp_num, attr.rq_psn, attr.sq_psn = int(peer["qpn"]), int(peer["psn"]), psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = MAX_OUTSTANDING
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    gr = GlobalRoute(dgid=GID(str(peer["gid"])), sgid_index=rp.gid_index)
    attr.ah_attr = AHAttr(port_num=rp.port, is_global=1, gr=gr, dlid=int(peer["lid"]))
    return attr


def read_wrs(local_addr: int, size: int, lkey: int, remote_addr: int, rkey: int) -> list[Any]:
    """Signaled RDMA READ work requests covering [0, size) in READ_CHUNK pieces (no device needed)."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    out = []
    for i, off in enumerate(range(0, size, READ_CHUNK)):
        ln = min(READ_CHUNK, size - off)
        wr = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(local_addr + off, ln, lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote_addr + off)
        out.append((off + ln, wr))
    return out


class _Verbs:
    """One opened device: protection domain, and the memory regions of every buffer."""

    def __init__(self, rp: RdmaPort):
        import pyverbs.device as d
        import pyverbs.enums as e
        import pyverbs.pd as pd

        self.e, self.rp = e, rp
        self.ctx = d.Context(name=rp.device)
        self.pd = pd.PD(self.ctx)

    def register(self, buf: HostBuffer) -> Any:
        from pyverbs.mr import MR

        e = self.e
        return MR(self.pd, buf.size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ, address=buf.addr)

    def new_qp(self) -> tuple[Any, Any, int]:
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self.e
        cq = CQ(self.ctx, MAX_OUTSTANDING * 2, None, None, 0)
        cap = QPCap(max_send_wr=MAX_OUTSTANDING, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.rp.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        qp = QP(self.pd, init, attr)  # RC + qp_attr: returned in INIT
        return qp, cq, random.getrandbits(24)

    def to_rts(self, qp: Any, psn: int, peer: dict) -> None:
        qp.to_rts(rts_attr(self.rp, psn, peer))

    def qp_info(self, qp: Any, psn: int) -> dict:
        return {"qpn": qp.qp_num, "psn": psn, "gid": self.rp.gid, "lid": self.rp.lid, "mtu": self.rp.mtu}

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class RdmaMover:
    name = "rdma"

    def __init__(self, rp: RdmaPort):
        self.rp = rp
        self.verbs = _Verbs(rp)

    def advert(self) -> dict:
        return {"device": self.rp.device, "port": self.rp.port, "gid": self.rp.gid}

    def registrar(self, buf: HostBuffer) -> Any:
        return self.verbs.register(buf)

    # ---- fetcher side ----------------------------------------------------------------------
    async def open(self) -> tuple[Any, dict]:
        qp, cq, psn = self.verbs.new_qp()
        return (qp, cq, psn), self.verbs.qp_info(qp, psn)

    async def receive(self, sock: socket.socket, buf: HostBuffer, reply: dict, ctx: Any, deadline: Deadline,
                      hasher: TreeHasher) -> None:
        qp, cq, psn = ctx
        e = self.verbs.e
        try:
            peer, raddr, rkey = reply["rdma"], int(reply["rdma"]["addr"]), int(reply["rdma"]["rkey"])
        except (KeyError, TypeError, ValueError):
            raise FetchError(PROTOCOL, "RDMA reply lacks the memory region") from None
        self.verbs.to_rts(qp, psn, peer)
        wrs = read_wrs(buf.addr, buf.size, buf.reg.lkey, raddr, rkey)
        posted = done = 0
        idle = 0.0
        while done < len(wrs):
            while posted < len(wrs) and posted - done < MAX_OUTSTANDING:
                qp.post_send(wrs[posted][1])
                posted += 1
            npolled, wcs = cq.poll(MAX_OUTSTANDING)
            for wc in wcs[:npolled]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise FetchError(PROTOCOL, f"RDMA READ failed (wc status {wc.status})")
                done += 1
            if npolled:
                idle = 0.0
                hasher.advance(wrs[done - 1][0])  # an RC send queue completes in order: hash what landed
                continue
            if deadline.remaining() <= 0:
                raise FetchError(TIMEOUT, "RDMA READ did not complete before the deadline")
            idle = min(idle * 2 or 5e-5, 2e-3)  # poll from the loop without spinning it
            await asyncio.sleep(idle)
        await send_frame(sock, {"op": "done"}, deadline)

    def close_client(self, ctx: Any) -> None:
        qp, cq, _ = ctx
        qp.close()
        cq.close()

    # ---- owner side --------------------------------------------------------------------------
    async def serve(self, sock: socket.socket, entry: Entry, offer: dict, reply: dict, deadline: Deadline,
                    seal: Callable[[dict], dict]) -> None:
        if entry.buf.reg is None:
            raise FetchError(PROTOCOL, "entry is not registered for RDMA")
        qp, cq, psn = self.verbs.new_qp()
        try:
            self.verbs.to_rts(qp, psn, offer)
            reply = {**reply, "rdma": {**self.verbs.qp_info(qp, psn), "addr": entry.buf.addr,
                                       "rkey": entry.buf.reg.rkey}}
            await send_frame(sock, seal(reply), deadline)  # the handshake's proof covers the region too
            msg = await recv_frame(sock, deadline)  # the fetcher's reads are done (or it went away)
            if msg.get("op") != "done":
                raise FetchError(PROTOCOL, "expected done after RDMA READ")
        finally:
            qp.close()
            cq.close()


def make_mover(transport: str, device: str | None, port: int | None, gid_index: int | None
               ) -> tuple[RdmaMover | None, str]:
    """The RDMA mover if wanted and possible, else None with the reason (TCP is then used)."""
    if transport == "tcp":
        return None, "TCP chosen by configuration"
    ports, why = discover(device, port, gid_index)
    if not ports:
        if transport == "rdma":
            raise RuntimeError(f"--kv-transport rdma: {why}")
        return None, why
    try:
        return RdmaMover(ports[0]), f"RDMA on {ports[0].device} port {ports[0].port} gid {ports[0].gid_index}"
    except Exception as exc:
        if transport == "rdma":
            raise
        return None, f"RDMA device {ports[0].device} failed to open: {exc}"
