"""Payload mover over the control connection itself: for machines with no RDMA device.

Same handshake, checksum, deadlines and failure reasons as RDMA (protocol.py, peer.py); only
the bytes travel differently: the owner streams the buffer right after its reply and the
fetcher receives straight into its host buffer (sock_recv_into, no intermediate copy).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from .protocol import Deadline, TreeHasher, recv_exact, send_frame, send_payload
from .store import Entry, HostBuffer


class TcpMover:
    name = "tcp"

    def advert(self) -> dict:
        return {}

    # ---- fetcher side ----------------------------------------------------------------------
    async def open(self) -> tuple[Any, dict]:
        return None, {}

    async def receive(self, sock: socket.socket, buf: HostBuffer, reply: dict, ctx: Any, deadline: Deadline,
                      hasher: TreeHasher) -> None:
        await recv_exact(sock, buf.view(), deadline, "the state payload", hasher)  # verify while receiving

    def close_client(self, ctx: Any) -> None:
        pass

    # ---- owner side --------------------------------------------------------------------------
    async def serve(self, sock: socket.socket, entry: Entry, offer: dict, reply: dict, deadline: Deadline,
                    seal: Callable[[dict], dict]) -> None:
        await send_frame(sock, seal(reply), deadline)
        await send_payload(sock, entry.view(), deadline)
