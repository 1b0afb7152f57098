"""The staged data path for vLLM's push-mode NixlConnector (``NixlPushConnector``).

In push mode D tells P where to write (a ``PUSH_REG`` NIXL notification carrying D's
block ids) and P's ``nixl-push-writer`` thread WRITEs its blocks there, one descriptor
per block x layer, into D's kvcached memory. The staged path keeps that control plane
and changes only what the WRITE moves:

prefill (P)
  scheduler  as in pull mode: reserve an extent when the prefill completes, hand its
             description to D in ``kv_transfer_params``, free it when vLLM frees P's
             blocks (the WRITE done, or the lease expired);
  worker     ``wait_for_save``: pack the request into the extent (and remember it);
             writer thread, ``_do_start_push_kv``: note D's offer from the registration;
             ``_xfer_blocks_for_req``: when D offered staging and P packed the request,
             WRITE the extent into D's staging with a few large descriptors and a
             notification marked as staged; otherwise vLLM's per-block WRITE.
decode (D)
  worker     ``start_load_kv``: for a request whose ``kv_transfer_params`` describe a
             packed extent in a compatible format, reserve an extent of D's staging and
             add it to the registration (``OFFER_FIELD``); no room now -> hold the
             registration until there is (as pull mode waits to READ);
             the writer thread's completion notifications pass through
             :class:`StagedNotifQueue`, which records which requests arrived staged;
             ``get_finished``: a request done *and* arrived staged is unpacked into D's
             blocks before vLLM reports it; one that arrived by vLLM's per-block WRITE
             is left alone, and its extent freed.

Why the marked notification: only P knows, at WRITE time, which path it took (it may
have no packed extent, or run without kvcached-pd and ignore the offer). Unpacking an
extent P never wrote would overwrite correct blocks, so D unpacks only on P's word.
A request that fails on D after its offer went out keeps its extent out of use until
``hold_s`` (vLLM's KV lease plus a margin) after the offer: P could still WRITE into it
until its lease ends, and P's lease began before the offer (D offers only for requests
carrying P's packed extent, so P had finished them).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from kvcached_pd.transport.staged import (
    STAT_FALLBACKS,
    WorkerStaging,
    packed_extent,
    post_extent_transfer,
    record_stat,
    reserve_decode_extent,
)
from kvcached_pd.transport.trace import trace

logger = logging.getLogger("kvcached_pd")

OFFER_FIELD = "kvcached_pd_staged"  # in D's PUSH_REG registration: {offset, nbytes}
STAGED_NOTIF_PREFIX = b"KVPD_STAGED:"  # P's completion notification for a staged WRITE


class StagedNotifQueue(queue.Queue):
    """D's ``_pending_completion_notifs``: strips P's staged mark off a completion
    notification, and records the request, before vLLM's main thread can see it."""

    def __init__(self, arrived: set[str]):
        super().__init__()
        self.arrived = arrived

    def put(self, item, block=True, timeout=None):
        if isinstance(item, bytes) and item.startswith(STAGED_NOTIF_PREFIX):
            item = item[len(STAGED_NOTIF_PREFIX):]
            self.arrived.add(item.decode("utf-8").rsplit(":", 1)[0])
        super().put(item, block, timeout)


def install_notif_queue(worker: Any, st: WorkerStaging) -> None:
    """Swap D's notification queue for the marking one (before the writer starts)."""
    old = worker._pending_completion_notifs
    new = StagedNotifQueue(st.push_arrived)
    while True:
        try:
            new.put(old.get_nowait())
        except queue.Empty:
            break
    worker._pending_completion_notifs = new


# ------------------------------------------------------------------------------ D side
def offer_staging(worker: Any, st: WorkerStaging, req_id: str, reg: dict[str, Any]) -> str:
    """Add D's staging extent to a registration: "offered", "wait" (no room now) or
    "direct" (P packed nothing, or cannot be served; vLLM's push path then)."""
    info = st.recv_info.get(req_id)
    if info is None:
        return "direct"  # P packed nothing (no kvcached-pd there, or its staging full)
    extent, reason = reserve_decode_extent(worker, st, req_id, info, req_id in st.push_waiting)
    if extent is None and reason is None:
        return "wait"
    nbytes = int(info["nbytes"])
    st.recv_info.pop(req_id, None)
    if reason is not None:
        st.stats["fallbacks"] += 1
        record_stat(worker, STAT_FALLBACKS, 1)
        logger.warning("kvcached-pd: request %s travels by vLLM's push path: %s", req_id, reason)
        return "direct"
    reg[OFFER_FIELD] = {"offset": int(extent.offset), "nbytes": nbytes}
    st.pending[req_id] = (extent, {**info, "push": True}, time.perf_counter())
    trace("push_offered", req_id, remote_req=info.get("remote_req"), bytes=nbytes)
    return "offered"


def offer_for_registrations(worker: Any, st: WorkerStaging, registrations: dict) -> None:
    """D's ``start_load_kv``: offer staging in this step's registrations; hold back the
    ones that must wait for room (they are sent by :func:`send_waiting_registrations`)."""
    for req_id in list(registrations):
        if st.push_waiting or offer_staging(worker, st, req_id, registrations[req_id]) == "wait":
            st.push_waiting[req_id] = registrations.pop(req_id)  # keep arrival order


def send_waiting_registrations(worker: Any, st: WorkerStaging) -> None:
    """Registrations that waited for room go out, in arrival order, once it is there."""
    st.reap(worker)
    sent = False
    for req_id, reg in list(st.push_waiting.items()):
        if offer_staging(worker, st, req_id, reg) == "wait":
            break
        del st.push_waiting[req_id]
        worker._reg_send_inbox.put((req_id, reg))
        sent = True
    if sent:
        worker._push_writer_wake.set()


# ------------------------------------------------------------------------------ P side
def start_staged_write(worker: Any, st: WorkerStaging, req_id: str, meta: Any) -> bool:
    """Writer thread: WRITE the packed extent into the staging D offered. False means
    "use vLLM's per-block WRITE" (D then sees an unmarked notification)."""
    offer = st.push_offers.pop(req_id, None)
    if offer is None:
        return False
    engine_id = meta.remote.engine_id
    packed = packed_extent(st, req_id)  # waits for the pack to finish on the device
    peer = st.remote.get(engine_id)
    reason = None
    if packed is None:
        reason = "this side packed no extent for it"
    elif peer is None:
        reason = "the decode side published no staging in its handshake"
    elif int(offer["nbytes"]) != packed["nbytes"]:
        reason = f"D offered {offer['nbytes']} bytes for a {packed['nbytes']}-byte extent"
    elif int(offer["offset"]) + packed["nbytes"] > int(peer["nbytes"]):
        reason = "D's offer lies outside its staging region"
    if reason is not None:
        logger.warning("kvcached-pd: request %s is pushed by vLLM's per-block path: %s",
                       req_id, reason)
        return False
    nbytes = packed["nbytes"]
    notif = STAGED_NOTIF_PREFIX + f"{meta.remote.request_id}:{worker.world_size}".encode()
    try:
        handle, descs = post_extent_transfer(worker, "WRITE", st, packed["offset"], peer,
                                             int(offer["offset"]), nbytes, engine_id, notif)
    except Exception as exc:  # noqa: BLE001 - vLLM's own path is still correct
        logger.error("kvcached-pd: staged WRITE for %s failed to start (%s); vLLM's "
                     "per-block path takes it", req_id, exc)
        return False
    with worker._sending_transfers_lock:  # published whole, as vLLM does
        worker._sending_transfers[req_id].append(handle)
    st.stats["writes"] += 1
    trace("write_posted", req_id, remote_req=meta.remote.request_id, bytes=nbytes, descs=descs)
    return True


def forget_finished(st: WorkerStaging, done_sending) -> None:
    """P: a request whose WRITE completed (or lease expired) is never written again."""
    for req_id in done_sending or ():
        st.packed.pop(req_id, None)
        st.push_offers.pop(req_id, None)
