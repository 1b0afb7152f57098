"""The decode side's worker half: READ P's extent (or map it), unpack, release; tell P.

Worker half (:class:`DecodeWorker`): ``start`` (``start_load_kv``) fetches P's rank
handshake once per peer (checking wire version and format once), reserves an extent
of D's staging (waiting for room when it is full, never falling back to the 0.5 GB/s
path) and posts one READ carrying the DONE notification; ``poll`` (``get_finished``)
scatters completed extents into the request's blocks on the compute stream and frees
the extent once that scatter has run. A READ that cannot start before half of P's
lease has passed fails the request's load instead: P frees the extent at its lease.

vLLM notices a finished load only at the next ``get_finished``, one engine step later;
for a READ that ends within a fraction of a millisecond that step is most of the
handoff. So ``poll`` first waits, at most ``spin_s`` (``KVCACHED_PD_READ_SPIN_US``),
for READs predicted to end inside that budget: on the host, at 94 MiB, the connector
without it saw a READ 2.43 ms (median) after posting it, the older hooks (which this
connector replaced) with it 0.53 ms.

From a P whose staging this process mapped over CUDA IPC (:mod:`.wires`) nothing is
READ: the unpack reads P's extent in place once the stream waited on P's pack event,
and the DONE goes to P once that unpack has run on the device; an idle mapping is
dropped by a thread (:data:`IDLE_UNMAP_S`), since only that lets the GPU free a dead
P's staging. A push request of a concurrent leg that the scheduler did not claim itself
is claimed here from P's listener, checked like the scheduler's claims
(:func:`~kvcached_pd.connector.decode_scheduler.claim_outcome`).

What it loads, and when, the scheduler half decides (:mod:`.decode_scheduler`) and
hands over as :class:`~kvcached_pd.connector.records.RecvOrder` each step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvcached_pd.connector.decode_scheduler import MAX_PEERS, claim_outcome, peer_key
from kvcached_pd.connector.records import RecvOrder
from kvcached_pd.connector.region import StagingRegion
from kvcached_pd.connector.side_channel import ClaimClient, fetch_handshake
from kvcached_pd.connector.tokens import check_tag, read_tag, read_tags
from kvcached_pd.connector.wires import WireClosed, choose_wire
from kvcached_pd.connector.wire import (
    CLAIM_WIRE_VERSION,
    Claim,
    Done,
    RankHandshake,
    StagedParams,
    WireError,
)
from kvcached_pd.transport.format import TAG_BYTES
from kvcached_pd.transport.pack import unpack_request
from kvcached_pd.transport.staging import EXPECTED_READ_BYTES_PER_S, Extent, StagingError
from kvcached_pd.transport.trace import trace

logger = logging.getLogger("kvcached_pd")
# An IPC peer's staging stays mapped (and so allocated on the GPU, even after P died:
# 2 GiB per P rank on the tiny model) until D drops it: after this long without a
# request from that peer; its next request maps it again (one handshake, ~ms).
IDLE_UNMAP_S = 30.0
# A failed handshake fails the requests of that peer that meet it; a new one is tried
# for requests that come this long after it failed (retrying at every engine step left
# them waiting for their deadline: half of P's lease, 240 s on vLLM 0.20).
HANDSHAKE_RETRY_S = 5.0


@dataclass
class _Read:
    order: RecvOrder
    params: StagedParams | None = None  # the order's, or claimed from P
    deadline: float = 0.0  # the READ must start before this (monotonic)
    extent: Extent | None = None  # in D's staging (NIXL wire)
    handle: Any = None  # the NIXL READ
    wire: Any = None  # the peer's wire (wires.py), once posted
    posted: float = 0.0
    waited: bool = False  # counted once as waiting for staging room
    tag_s: float = 0.0  # host time of the tag read it took part in (trace: tag_ms)
    # (start, nbytes) of P's extent this load moves, set once the params are checked:
    # the token slots from the first token D lacks, and the tag (packed format 3)
    window: tuple[int, int] = (0, 0)


class DecodeWorker:
    """D's worker half (see the module docstring)."""

    def __init__(self, region: StagingRegion, handshake_timeout_s: float = 5.0,
                 spin_s: float = 0.0, wire_policy: str = "auto",
                 idle_unmap_s: float = IDLE_UNMAP_S, secret: bytes | None = None) -> None:
        self.region = region
        self.idle_unmap_s = idle_unmap_s
        self.spin_s = spin_s
        self.wire_policy = wire_policy  # KVCACHED_PD_WIRE (wires.choose_wire)
        self.handshake_timeout_s = handshake_timeout_s
        self.secret = secret  # proves this D to P's listener (side_channel.sign)
        # (engine, host, port, P rank) -> that peer rank's wire
        self._peers: dict[tuple[str, str, int, int], Future] = {}
        self._counted: set[int] = set()  # wires whose IPC fallback was counted
        # IPC loads reported finished while their unpack may still read P's staging, and
        # those whose unpack has run since (DONE sent): the scheduler's hand-off waits
        self.unread: set[str] = set()
        self.read: set[str] = set()
        # (P engine, host, port, rank) -> its wire became IPC (True) or was unmapped,
        # since the last report (the scheduler's choice of synchronous loads)
        self.ipc_news: dict[tuple[str, str, int, int], bool] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcached-pd-hs")
        self._lock = threading.Lock()
        self.queued: dict[str, _Read] = {}  # waiting for a handshake or for room
        self.inflight: dict[str, _Read] = {}
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.invalid_blocks: set[int] = set()
        # (start event, end event, extent, (wire, DONE) or None): once the scatter has
        # run on the device, the extent is freed and the DONE sent (IPC wire)
        self.releasing: list[tuple[Any, Any, Extent | None, Any]] = []
        self.samples: dict[str, list[float]] = {}
        self._claims: ClaimClient | None = None  # started by the first claim
        # reads each extent's tag (.tokens) without waiting for the compute stream
        self._tag_stream = (torch.cuda.Stream(region.buffer.tensor.device)
                            if region.buffer.tensor.is_cuda else None)
        self._stopping = threading.Event()
        self._unmapper: threading.Thread | None = None  # started with the first IPC peer

    # ------------------------------------------------------------- vLLM's hooks
    def start(self, orders: dict[str, RecvOrder], cancelled: set[str]) -> None:
        now: list[tuple[str, _Read]] = []  # synchronous loads, unpacked below
        for req_id, order in orders.items():
            if order.failure:
                self._fail(req_id, _Read(order, order.params, order.deadline), order.failure)
                continue
            if order.sync:
                read = _Read(order, order.params, order.deadline)
                if self._post_now(req_id, read):
                    now.append((req_id, read))
                continue
            self.queued[req_id] = _Read(order, order.params, order.deadline)
            if order.params is not None:
                self._peer(order.params)
            else:
                if self._claims is None:
                    self._claims = ClaimClient(self.handshake_timeout_s, self.secret)
                target = order.claim
                self._claims.submit(req_id, target.host, target.port,
                                    Claim(CLAIM_WIRE_VERSION, target.key, target.engine_id))
                trace("claim_sent", req_id, key=target.key)
        self._unpack_ready(now)
        for req_id in cancelled:
            if req_id in self.queued and self.queued[req_id].order.notify_only:
                continue  # vLLM waits for nothing; P still gets its DONE
            if req_id in self.queued:  # not posted: nothing to wait for
                del self.queued[req_id]
                self.finished.add(req_id)
                if self._claims is not None:
                    self._claims.cancel(req_id)
            elif req_id in self.inflight:
                self.cancelled.add(req_id)
        self._post_queued()

    def poll(self) -> tuple[set[str], set[str], set[int]]:
        """Requests whose load finished (loaded, failed or cancelled), those of them
        that failed, and the blocks that failed to load, since the last call."""
        states = self._await_imminent()
        self._take_claims()
        ready: list[tuple[str, _Read]] = []  # to unpack, after one read of their tags
        for req_id, read in list(self.inflight.items()):
            state = states.get(req_id) or read.wire.state(read)
            if state == "PROC":
                continue
            del self.inflight[req_id]
            read.wire.settle(read, self.samples, state)
            if state == "DONE" and req_id not in self.cancelled:
                ready.append((req_id, read))
            else:
                if state != "DONE":
                    logger.error("kvcached-pd: staged READ of request %s failed (%s wire, "
                                 "state %s)", req_id, read.wire.name, state)
                    self.invalid_blocks.update(read.order.block_ids)
                    self.failed.add(req_id)
                # an aborted request is not unpacked; P may reuse its extent at once
                message = read.wire.done_message(read) if state == "DONE" else None
                self.releasing.append((None, None, read.extent,
                                       (read.wire, message, req_id) if message else None))
            self.cancelled.discard(req_id)
            self.finished.add(req_id)
        self._unpack_ready(ready)
        self._post_queued()
        self._reap()
        finished, self.finished = self.finished, set()
        failed, self.failed = self.failed, set()
        invalid, self.invalid_blocks = self.invalid_blocks, set()
        return finished, failed, invalid

    # ----------------------------------------------------------------- helpers
    def _post_now(self, req_id: str, read: _Read) -> bool:
        """Start a synchronous load (:meth:`DecodeScheduler._loads_now`); False when it
        failed. ``start`` then checks its tag and enqueues its unpack on the compute
        stream (:meth:`_unpack_ready`, one tag read for all of this step's), in
        ``start_load_kv``, so this step's forward reads the blocks after it. Its DONE
        goes to P once the unpack has run on the device (:meth:`_reap`), as on the
        asynchronous path. A failure is this step's invalid blocks (:meth:`_fail`)."""
        params = read.params
        if time.monotonic() > read.deadline:
            # The request waited in D's scheduler while vLLM had no KV room for it (its
            # claimed params' age, or, pulled, its time since it reached D, counts:
            # DecodeScheduler._read_deadline); past half of P's lease P may have freed
            # the extent and packed another request into it, and the tag, read before
            # the scatter runs on the device, would not tell. The asynchronous path
            # checks the same deadline before it posts (_post_queued).
            self._fail(req_id, read, "vLLM held it back past its READ deadline (half of "
                       f"prefill {params.engine_id}'s {params.lease_s:.0f} s lease): the "
                       "extent may hold another request's KV by now")
            return False
        wire = None
        try:
            for _ in range(2):  # once more when the mapping was dropped as idle just now
                wire = self._peer(params).result(timeout=self.handshake_timeout_s)
                if wire.name != "ipc":
                    raise WireError(f"prefill {params.engine_id} is served by the {wire.name} "
                                    "wire now, not by CUDA IPC")
                problem = self._extent_problem(params, wire.handshake)
                if problem is not None:
                    raise WireError(problem)
                read.window = self.region.fmt.window(params.n_tok_slots,
                                                     read.order.first_token)
                try:
                    wire.post(read)
                    break
                except WireClosed:
                    wire = None
            if wire is None:
                raise WireError(f"prefill {params.engine_id}'s staging was unmapped twice")
        except Exception as exc:  # noqa: BLE001 - the request's load fails, D lives
            self._fail(req_id, read, f"its synchronous load did not start: {exc}")
            return False
        read.wire = wire
        read.posted = time.perf_counter()
        self._moved(read.window[1], read.window[0])
        trace("read_posted", req_id, bytes=read.window[1], skipped=read.window[0],
              remote_req=params.request_id, wire=wire.name, sync=True)
        return True

    def _await_imminent(self) -> dict[str, str]:
        """Wait, at most ``spin_s``, for in-flight READs predicted to end within it;
        the states last seen (a READ that finished or failed stays so)."""
        if self.spin_s <= 0 or not self.inflight:
            return {}
        t0 = time.perf_counter()
        deadline = t0 + self.spin_s
        waiting = {req_id: read for req_id, read in self.inflight.items()
                   if req_id not in self.cancelled and read.wire.uses_staging and read.posted
                   + read.window[1] / EXPECTED_READ_BYTES_PER_S <= deadline}
        states: dict[str, str] = {}
        while waiting:
            for req_id, read in list(waiting.items()):
                states[req_id] = read.wire.state(read)
                if states[req_id] != "PROC":
                    del waiting[req_id]
            if time.perf_counter() >= deadline:
                break
        spent = time.perf_counter() - t0
        if spent > 0 and states:
            self.samples.setdefault("read_spin", []).append(spent)
        return {req_id: state for req_id, state in states.items() if state != "PROC"}

    def _take_claims(self) -> None:
        """Apply the claim replies that came (push mode, concurrent legs)."""
        if self._claims is None:
            return
        now = time.monotonic()
        for req_id, reply in self._claims.take().items():
            read = self.queued.get(req_id)
            if read is None or read.params is not None:
                continue
            params, deadline, failure = claim_outcome(
                req_id, read.order.claim, reply, self.region.digest,
                self.region.decode.allocator.capacity_bytes, read.order.num_tokens, now,
                by="worker")
            if params is None:
                del self.queued[req_id]
                self._fail(req_id, read, failure)
                continue
            read.params, read.deadline = params, deadline
            self._peer(read.params)

    def _peer(self, params: StagedParams) -> Future:
        key = (*peer_key(params), self.region.tp_rank)
        with self._lock:
            future = self._peers.get(key)
            failed_at = getattr(future, "done_at", None)  # set once it failed (_stamp)
            if future is None or (failed_at is not None and future.exception() is not None
                                  and time.monotonic() - failed_at > HANDSHAKE_RETRY_S):
                future = self._pool.submit(self._handshake, params)
                future.add_done_callback(_stamp)
                self._peers.pop(key, None)
                self._peers[key] = future
                if len(self._peers) > MAX_PEERS:
                    # failed handshakes only: a loaded peer stays in the NIXL agent
                    for old in [k for k, f in self._peers.items()
                                if f.done() and f.exception() is not None][:1]:
                        del self._peers[old]
        return future

    def _handshake(self, params: StagedParams):
        """The peer rank's wire (:func:`~kvcached_pd.connector.wires.choose_wire`)."""
        data = fetch_handshake(params.host, params.port, self.region.tp_rank,
                               self.handshake_timeout_s, self.secret)
        handshake = RankHandshake.decode(data)
        if handshake.engine_id != params.engine_id:
            raise WireError(f"{params.host}:{params.port} is prefill {handshake.engine_id}, "
                            f"not {params.engine_id}")
        handshake.check_compatible(self.region.fmt, self.region.digest)
        wire = choose_wire(self.wire_policy, self.region, handshake.agent_name, handshake)
        # the IPC wire only sends DONEs: P's agent without its memory (add_peer says why)
        self.region.agent.add_peer(handshake, notify_only=wire.name == "ipc")
        if wire.name == "ipc":
            with self._lock:
                self.ipc_news[(*peer_key(params), self.region.tp_rank)] = True
        logger.log(logging.WARNING if wire.fell_back else logging.INFO,
                   "kvcached-pd: staged peer %s rank %d: %d MiB staging, wire version %d, "
                   "wire %s (%s)", handshake.engine_id, handshake.tp_rank,
                   handshake.staging_bytes >> 20, handshake.wire_version, wire.name, wire.why)
        return wire

    def _start_unmapper(self) -> None:
        """D's engine steps only while it has requests, so an idle D would keep a dead
        P's mapping forever: a thread drops idle mappings (``idle_unmap_s``). It holds
        this worker weakly, so a worker nobody shut down can still be collected."""
        if self._unmapper is None:
            self._unmapper = threading.Thread(
                target=_unmap_loop, args=(weakref.ref(self), self._stopping), daemon=True,
                name="kvcached-pd-unmap")
            self._unmapper.start()

    def _unmap_idle_peers(self) -> None:
        """Forget IPC peers unused for ``idle_unmap_s``: their mapping is what keeps a
        dead P's staging allocated on the GPU. The log line says how much of the GPU's
        memory came back with it (only a dead P's staging does: a live P still holds
        its own), read on the GPU of P's staging. Up to 2026-11-26 it often said "rose
        by 0 MiB" after P was killed (2 x H200: pull mode; one H100: both modes): UCX
        had mapped P's staging a second time when D loaded P's whole NIXL agent
        (``StagingAgent.add_peer``); an IPC peer's agent is now loaded without it."""
        now = time.monotonic()
        dropped = []  # (wire, P's GPU's free memory before the drop and after it)
        with self._lock:
            wires = [(key, future.result()) for key, future in self._peers.items()
                     if future.done() and future.exception() is None]
            for key, wire in wires:
                if not wire.is_idle(self.idle_unmap_s, now):
                    continue
                # the GPU holding P's staging: D's own, or P's across GPUs (2026-11-26,
                # twice: reading D's GPU across two of them said 0 MiB whatever came
                # back; the mapped tensor names D's GPU, the wire names P's)
                device = wire.device
                before = _used_bytes(device)
                if wire.close_if_idle(self.idle_unmap_s, now):
                    del self._peers[key]
                    self.ipc_news[key] = False
                    dropped.append((wire, before, _used_bytes(device)))
        for wire, before, after in dropped:
            freed = ("" if before is None or after is None else
                     f"; the GPU's free memory rose by {(before - after) / (1 << 20):.0f} MiB")
            logger.info("kvcached-pd: unmapped prefill %s rank %d's staging after %.0f s "
                        "without requests (its next request maps it again)%s",
                        wire.handshake.engine_id, wire.handshake.tp_rank, self.idle_unmap_s,
                        freed)

    def _fail(self, req_id: str, read: _Read, reason: str, after: Any = None) -> None:
        """The request's load failed (its blocks reported invalid); its extent is freed
        once ``after`` (a CUDA event, or None: at once) has passed."""
        if read.order.notify_only:  # vLLM waits for nothing: P frees it at its lease
            logger.warning("kvcached-pd: request %s (a full prefix hit): no DONE sent to "
                           "prefill: %s", req_id, reason)
            return
        logger.error("kvcached-pd: request %s: staged load failed: %s", req_id, reason)
        self.invalid_blocks.update(read.order.block_ids)
        if not read.order.sync:
            # a synchronous load's invalid blocks alone say it failed, in this step's
            # output: vLLM awaits no finished load for it (reporting one would trip its
            # scheduler's assertion); its scheduler entry goes when vLLM ends it
            self.finished.add(req_id)
            self.failed.add(req_id)
        if read.wire is not None:
            read.wire.finished_with(read)
        if read.extent is not None:
            self.releasing.append((None, after, read.extent, None))

    def _post_queued(self) -> None:
        """Post queued READs in arrival order while there is room."""
        now = time.monotonic()
        for req_id, read in list(self.queued.items()):
            params = read.params
            if now > read.deadline:
                del self.queued[req_id]
                if params is None:
                    self._claims.cancel(req_id)
                    self._fail(req_id, read, f"prefill {read.order.claim.engine_id} had not "
                               "staged it within this instance's KV lease")
                else:
                    self._fail(req_id, read, "it waited past half of P's lease "
                               f"({params.lease_s:.0f} s) for KV room, a handshake or "
                               "staging room: the extent may hold another request's KV "
                               "by now")
                continue
            if params is None:
                continue  # its claim is not answered yet
            future = self._peer(params)
            if not future.done():
                continue
            if future.exception() is not None:
                del self.queued[req_id]
                self._fail(req_id, read, f"no handshake with prefill {params.engine_id}: "
                           f"{future.exception()}")
                continue
            wire = future.result()
            if wire.name == "ipc":
                self._start_unmapper()
            if wire.fell_back and id(wire) not in self._counted:
                self._counted.add(id(wire))
                self.samples.setdefault("wire_fallbacks", []).append(1)
            problem = self._extent_problem(params, wire.handshake)
            if problem is not None:
                del self.queued[req_id]
                self._fail(req_id, read, problem)
                continue
            if read.order.notify_only:
                del self.queued[req_id]
                self._send_done(req_id, read, wire)
                continue
            read.window = self.region.fmt.window(params.n_tok_slots, read.order.first_token)
            if wire.uses_staging and read.extent is None:
                try:
                    read.extent = self.region.decode.alloc(read.window[1], req_id)
                except StagingError as exc:  # no room on the device for D's staging
                    del self.queued[req_id]
                    self._fail(req_id, read, f"no decode staging to READ into: {exc}")
                    continue
                if read.extent is None:
                    if not read.waited:
                        read.waited = True
                        self.samples.setdefault("waits", []).append(1)
                        logger.info("kvcached-pd: decode staging full (%d MiB used); request "
                                    "%s waits for room",
                                    self.region.decode.allocator.used_bytes >> 20, req_id)
                    break  # keep arrival order
                self._usage_changed()
            try:
                wire.post(read)
            except WireClosed:
                continue  # unmapped as idle just now: the next step maps it again
            except Exception as exc:  # noqa: BLE001 - the request's load fails, D lives
                del self.queued[req_id]
                self._fail(req_id, read, f"the {wire.name} transfer did not start: {exc}")
                continue
            del self.queued[req_id]
            read.wire = wire
            read.posted = time.perf_counter()
            self.inflight[req_id] = read
            self._moved(read.window[1], read.window[0])
            trace("read_posted", req_id, bytes=read.window[1], skipped=read.window[0],
                  remote_req=params.request_id, wire=wire.name)

    def _moved(self, nbytes: int, skipped: int) -> None:
        """One staged load's bytes moved (READ, or unpacked from P's memory over IPC) and
        the bytes of P's extent D's prefix cache made unnecessary."""
        self.samples.setdefault("moved_bytes", []).append(nbytes)
        self.samples.setdefault("prefix_skipped_bytes", []).append(skipped)

    def _send_done(self, req_id: str, read: _Read, wire: Any) -> None:
        """A full prefix hit: P's extent is not read; the DONE alone frees it and P's
        blocks. vLLM waits for nothing, so a failure is only logged (P frees them when
        its lease runs out)."""
        params = read.params
        try:
            wire.send(Done(params.request_id, self.region.tp_rank, params.token).encode())
        except Exception as exc:  # noqa: BLE001 - P frees it at its lease
            logger.warning("kvcached-pd: could not send DONE for request %s (a full prefix "
                           "hit) to prefill %s: %s", req_id, params.engine_id, exc)
            return
        self._moved(0, params.nbytes - TAG_BYTES)
        trace("done_sent", req_id, remote_req=params.request_id, wire=wire.name,
              skipped=params.nbytes - TAG_BYTES)

    def _device_events(self) -> tuple[Any, Any, Any]:
        """The compute stream and a timing event pair for one unpack; Nones on the CPU,
        where the unpack has run when it returns."""
        tensor = self.region.buffer.tensor
        if not tensor.is_cuda:
            return None, None, None
        return (torch.cuda.current_stream(tensor.device), torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True))

    def _source(self, read: _Read) -> torch.Tensor:
        """The extent's bytes the unpack reads: D's staging (NIXL) or P's (IPC)."""
        return read.wire.source(read)

    def _extent_problem(self, params: StagedParams, handshake: RankHandshake) -> str | None:
        """Why this request's params cannot name an extent of this peer, or None: the
        packed size of its token slots, within the staging P advertised (NIXL would
        refuse a READ outside P's registration; one inside another request's extent is
        caught by the tag, :mod:`.tokens`)."""
        if params.nbytes != self.region.fmt.extent_bytes(params.n_tok_slots):
            return (f"its params say {params.nbytes} bytes, {params.n_tok_slots} token slots "
                    f"pack into {self.region.fmt.extent_bytes(params.n_tok_slots)}")
        if params.offset + params.nbytes > handshake.staging_bytes:
            return (f"its extent [{params.offset}, {params.offset + params.nbytes}) lies "
                    f"outside the {handshake.staging_bytes} bytes of staging prefill "
                    f"{params.engine_id} advertised")
        return None

    def _unpack_ready(self, ready: list[tuple[str, _Read]]) -> None:
        """Unpack the loads that completed in this poll, in order: first every tag with
        one device-to-host read (:func:`~kvcached_pd.connector.tokens.read_tags`, on the
        tag stream, after each extent's IPC pack event), then each request's check and
        scatter (:meth:`_unpack`). A request whose extent cannot be read, whose tag is not
        its own or whose unpack raises fails alone."""
        if not ready:
            return
        tags: dict[str, bytes | Exception] = {}
        sources: dict[str, torch.Tensor] = {}
        for req_id, read in ready:
            try:
                sources[req_id] = self._tag_source(read)
            except Exception as exc:  # noqa: BLE001 - this request fails in _unpack
                tags[req_id] = exc
        t0 = time.perf_counter()
        try:
            tags.update(zip(sources, read_tags(list(sources.values()), self._tag_stream)))
        except Exception:  # noqa: BLE001 - each request then reads its own tag
            pass
        tag_s = time.perf_counter() - t0
        for req_id, read in ready:
            read.tag_s = tag_s
            try:
                self._unpack(req_id, read, tags.get(req_id))
            except Exception as exc:  # noqa: BLE001 - this request fails, D lives
                self._fail(req_id, read, f"its unpack failed: {exc}")

    def _tag_source(self, read: _Read) -> torch.Tensor:
        """The extent's bytes, with the tag stream ordered after P's pack (IPC wire)."""
        src = self._source(read)
        if self._tag_stream is not None:
            read.wire.before_unpack(read, self._tag_stream)
        return src

    def _unpack(self, req_id: str, read: _Read, tag: bytes | Exception | None = None) -> None:
        """Check the extent's tag, then scatter it; a tag that is not the request's, or
        an unpack that raises, fails the request's load (the bytes are never used).
        ``tag``: the tag as read by :meth:`_unpack_ready` (None: read it here; an
        exception: reading it failed)."""
        params = read.params
        try:
            if isinstance(tag, Exception):
                raise tag
            if tag is None:
                t0 = time.perf_counter()
                tag = read_tag(self._tag_source(read), self._tag_stream)
                read.tag_s = time.perf_counter() - t0
            src = self._source(read)
            reason = check_tag(tag, params.token, params.offset, params.nbytes)
            if reason is None:
                self._scatter(req_id, read, src)
                return
        except Exception as exc:  # noqa: BLE001 - the request's load fails, D lives
            reason = f"unpacking raised {type(exc).__name__}: {exc}"
        after = None
        tensor = self.region.buffer.tensor
        if tensor.is_cuda:  # free the extent only after anything the unpack queued has run
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(tensor.device))
        self._fail(req_id, read, f"its extent from prefill {params.engine_id} was not "
                   f"unpacked: {reason}", after)

    def _scatter(self, req_id: str, read: _Read, src: torch.Tensor) -> None:
        region = self.region
        order, params = read.order, read.params
        t0 = time.perf_counter()
        stream, start, end = self._device_events()
        read.wire.before_unpack(read, stream)
        kernel_ids = region.kernel_ids(list(order.block_ids))
        kbs = region.kernel_block_size
        kernel_ids = kernel_ids[: math.ceil((params.num_tokens - order.first_token) / kbs)]
        if kernel_ids:
            # the device time starts after the host's checks, at the first device
            # operation (unpack_request's ``started``); host_ms below is the host's side
            unpack_request(region.layers, kernel_ids, src, region.fmt, params.num_tokens,
                           params.n_tok_slots, order.first_token, order.first_token,
                           started=start)
        elif start is not None:
            start.record(stream)
        if end is not None:
            end.record(stream)
        host_s = time.perf_counter() - t0
        handoff = time.perf_counter() - read.posted
        self.samples.setdefault("handoff_duration", []).append(handoff)
        trace("read_done", req_id, bytes=read.window[1], handoff_ms=round(1e3 * handoff, 3),
              wire=read.wire.name, host_ms=round(1e3 * host_s, 3),
              tag_ms=round(1e3 * read.tag_s, 3))
        message = read.wire.done_message(read)
        if message and not read.order.sync:  # a synchronous load is parked already
            self.unread.add(req_id)
        # last: _unpack's except frees the extent when anything above raised
        self.releasing.append((start, end, read.extent,
                               (read.wire, message, req_id) if message else None))

    def _reap(self) -> None:
        """Once a scatter has run on the device: free its extent of D's staging (NIXL
        wire) or tell P it may reuse its own (IPC wire: the DONE)."""
        still, freed = [], False
        for start, end, extent, notify in self.releasing:
            if end is not None and not end.query():
                still.append((start, end, extent, notify))
                continue
            if start is not None:
                self.samples.setdefault("unpack_duration", []).append(
                    start.elapsed_time(end) / 1e3)
            if extent is not None:
                self.region.decode.free(extent)
                freed = True
            if notify is not None:
                wire, message, req_id = notify
                self.read.add(req_id)
                wire.finished_with(None)
                try:
                    wire.send(message)
                except Exception as exc:  # noqa: BLE001 - P frees it at its lease
                    logger.warning("kvcached-pd: could not send DONE to prefill %s: %s",
                                   wire.handshake.engine_id, exc)
        self.releasing = still
        if freed:
            self._usage_changed()

    def _usage_changed(self) -> None:
        self.samples.setdefault("decode_staging_bytes", []).append(
            self.region.decode.allocator.used_bytes)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples

    def take_unread(self) -> tuple[set[str], set[str]]:
        """(loads still reading P's staging, loads whose unpack ran) since the last call."""
        unread, self.unread = self.unread, set()
        read, self.read = self.read, set()
        return unread, read

    def take_ipc_news(self) -> dict[tuple[str, str, int, int], bool]:
        """Peer ranks whose wire became CUDA IPC (True) or was unmapped, since the last
        call."""
        with self._lock:
            news, self.ipc_news = self.ipc_news, {}
        return news

    def close(self) -> None:
        self._stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._claims is not None:
            self._claims.close()


def _used_bytes(device: torch.device | None) -> int | None:
    """The memory in use on a GPU, all processes (None on the CPU, or when it cannot be
    read), through NVML, which opens no CUDA context there: across two GPUs the GPU read
    is P's, where ``cudaMemGetInfo`` would first give D a context of its own (hundreds
    of MiB of P's GPU for D's life) only for a log line's figure."""
    if device is None or device.type != "cuda":
        return None
    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # noqa: BLE001 - only a log line's figure (no NVML: no figure)
        return None


def _stamp(future: Future) -> None:
    future.done_at = time.monotonic()


def _unmap_loop(ref: "weakref.ref[DecodeWorker]", stopping: threading.Event) -> None:
    while True:
        worker = ref()
        if worker is None:
            return
        interval = min(1.0, worker.idle_unmap_s / 2)
        try:
            worker._unmap_idle_peers()
        except Exception as exc:  # noqa: BLE001 - never let the thread die silently
            logger.warning("kvcached-pd: unmapping idle CUDA IPC peers failed: %s", exc)
        del worker
        if stopping.wait(interval):
            return
