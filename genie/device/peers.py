"""Copies between two remote devices, sent as commands: the bytes never pass through this client.

Devices of one node share this client's session with it: ``CMD_DEVICE_COPY`` copies inside it.
Devices of two nodes: the destination's session gives this client, once, its peer listener's port
(with the node's proof of it) and a ticket secret (``CMD_PEER_OPEN``, one round trip per session);
each copy then mints a one-time receive ticket for the destination storage and queues
``CMD_PEER_RECV`` on the destination and ``CMD_PEER_SEND`` on the source, both fire-and-forget:
the source's worker sends the bytes straight to the destination's (:mod:`genie.server.peer_copy`).
A failed copy raises at the next sync point of the device that saw it, naming both devices.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
import weakref

import attrs
import msgpack
import torch

from genie.device import dispatch
from genie.device.connection import NodeConnection
from genie.device.registry import RemoteDevice
from genie.errors import ProtocolError
from genie.wire import messages as wm
from genie.wire.values import dtype_code, tensor_ext

#: Seconds a receive ticket is valid for (the node refuses longer ones: genie.server.peer_copy.TICKET_LIFETIME).
TICKET_LIFETIME = 120.0


@attrs.frozen
class Endpoint:
    """What a destination session told this client about its peer listener."""

    port: int
    proof: bytes
    secret: bytes = attrs.field(repr=False)
    clock_offset: float  #: the node's clock minus this one's (tickets expire on the node's clock)


_endpoints: weakref.WeakKeyDictionary[NodeConnection, Endpoint] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def endpoint(conn: NodeConnection, device: str) -> Endpoint:
    """The destination session's peer listener (asked once per session: a round trip)."""
    with _lock:
        known = _endpoints.get(conn)
    if known is not None:
        return known
    asked = time.time()
    answer = conn.request([wm.CMD_PEER_OPEN, 0], device=device)
    if not (isinstance(answer, dict) and isinstance(answer.get("port"), int) and isinstance(answer.get("proof"), bytes)
            and isinstance(answer.get("secret"), bytes) and isinstance(answer.get("time"), float)):
        raise ProtocolError(f"node {conn.node_id} answered CMD_PEER_OPEN with {answer!r:.80}")
    offset = answer["time"] - (asked + time.time()) / 2
    found = Endpoint(answer["port"], answer["proof"], answer["secret"], offset)
    with _lock:
        _endpoints[conn] = found
    return found


def mint_ticket(ep: Endpoint, storage_id: int, nbytes: int) -> list[object]:
    """A one-time receive ticket for ``nbytes`` into storage ``storage_id`` of the endpoint's session."""
    nonce = os.urandom(16)
    expires = float(time.time() + ep.clock_offset + TICKET_LIFETIME)
    body = msgpack.packb([nonce, storage_id, nbytes, expires], use_bin_type=True)
    mac = hmac.new(ep.secret, b"genie-peer-ticket\0" + body, "sha256").digest()
    return [nonce, storage_id, nbytes, expires, mac]


def copy_between(dst: torch.Tensor, src: torch.Tensor, dst_device: RemoteDevice, src_device: RemoteDevice) -> None:
    """Queue ``dst.copy_(src)`` for tensors on two different remote devices (same shape after broadcasting)."""
    if src.is_conj() or src.is_neg():  # descriptors carry no conj/neg bit: materialize on the source first
        src = src.resolve_conj().resolve_neg()
    label = (f"copy from {src_device.label} (node {src_device.node_id}) to {dst_device.label} "
             f"(node {dst_device.node_id})")
    src_desc, dst_desc = dispatch.descriptor(src), dispatch.descriptor(dst)
    if dst_device.connection is src_device.connection:
        dst_device.connection.command([wm.CMD_DEVICE_COPY, dst_device.local_index, tensor_ext(dst_desc),
                                       src_device.local_index, tensor_ext(src_desc), label])
        return
    dst_conn, src_conn = dst_device.connection, src_device.connection
    ep = endpoint(dst_conn, dst_device.label)
    nbytes = src.numel() * src.element_size()
    ticket = mint_ticket(ep, int(dst_desc[0]), nbytes)
    # The destination's half goes out first: the source's worker waits for it to take the bytes.
    dst_conn.command([wm.CMD_PEER_RECV, dst_device.local_index, tensor_ext(dst_desc), ticket[0],
                      dtype_code(src.dtype), list(src.shape), src_device.node_id, label])
    dst_conn.flush()
    src_conn.command([wm.CMD_PEER_SEND, src_device.local_index, tensor_ext(src_desc), dst_device.node_id, ep.port,
                      ep.proof, ticket, label])
    src_conn.flush()
