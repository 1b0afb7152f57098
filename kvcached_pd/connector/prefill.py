"""The prefill side: reserve an extent, pack after the forward, free on D's DONE.

Scheduler half (:class:`PrefillScheduler`), one call per vLLM hook:

* ``admit`` (``get_num_new_matched_tokens``): a remote-decode request gets its extent
  before vLLM schedules its prefill. With no room, vLLM skips the request and asks
  again next step, so a full staging means waiting for D's READs to free room, never
  the direct path (0.5 GB/s from kvcached memory).
* ``on_step`` (``build_connector_meta``): follow the request's blocks; in the step
  that schedules its last prompt tokens, order the pack into the extent.
* ``on_finished`` (``request_finished``): add :class:`StagedParams` to the
  ``kv_transfer_params`` that vLLM hands to D.
* ``on_output`` (``update_connector_output``): free the extent at the first of D's
  DONE (its READ completed), vLLM freeing P's blocks (a plain D read them, or an
  abort), or the lease running out; the next step's metadata tells the worker to wipe
  the freed extent's tag (:mod:`.tokens`).

Worker half (:class:`PrefillWorker`): ``pack`` (``wait_for_save``) gathers every
layer's blocks into the extent on the compute stream, after that step's forward and
before vLLM samples: P's response, which hands D the extent, cannot exist before the
pack has run; the extent's tag (the request's token) follows its KV. ``wipe``
(``start_load_kv``, which vLLM calls in every step, with a forward or without) zeros
the tags of freed extents before any pack of the step can reuse their bytes. ``done``
(``build_connector_worker_meta``) collects D's DONE notifications, and only those
carrying the request's token: any agent that fetched P's handshake can send P a
notification, and a DONE frees an extent and P's blocks.

P's blocks are freed on D's DONE too, in pull and push mode alike: a staged D never
reads them, and vLLM's own way of telling P (a notification sent through vLLM's NIXL
handshake) does not always exist. vLLM's push connector has none without a WRITE;
vLLM 0.29+ refuses the handshake between peers of two KV layouts (kvcached's
contiguous layout beside its split layout or vLLM's own memory); vLLM's notify-only
path cannot serve P 16 / D 32-token blocks. Each of those held P's blocks for the
whole KV lease (30 s; 480 s on vLLM 0.20) after every request: at a steady rate that
is rate x lease x prompt blocks held, enough to fill P's KV cache (not measured). So
``finished_sending`` (``get_finished``) reports a packed request as sent once D's DONE
arrives (vLLM's scheduler frees its blocks then), and drops the inner connector's own
later report of it (vLLM's notification, which a pull-mode D still sends where vLLM's
handshake allows, or the inner lease running out, whose WARNING the connector drops
for these requests): a second report would trip vLLM's scheduler assertion.
:class:`StagedParams` say so to D (``frees_on_done``). A plain vLLM decode instance
never sends a DONE: it reads (pull) or is written (push) P's blocks, which the inner
connector frees as vLLM does.

In push mode a staged D READs the extent exactly as in pull mode (one READ; the staged
WRITE of the hooks this connector replaced measured 2.52 ms at 94 MiB against the
READ's 1.95 ms on the host).
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kvcached_pd.connector.records import PackOrder, Wipe
from kvcached_pd.connector.region import StagingRegion
from kvcached_pd.connector.claim_board import ClaimBoard
from kvcached_pd.connector.tokens import new_token, tag_bytes, wipe_tag
from kvcached_pd.connector.wire import (
    PARAMS_KEY,
    WIRE_VERSION,
    Done,
    StagedParams,
    WireError,
)
from kvcached_pd.transport.cuda_ipc import NUM_PACK_EVENTS
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.pack import pack_request
from kvcached_pd.transport.staging import Extent, ExtentAllocator
from kvcached_pd.transport.trace import ms_since, trace

logger = logging.getLogger("kvcached_pd")


@dataclass
class _Staged:
    extent: Extent
    order: PackOrder | None = None  # set once the pack is ordered
    params: StagedParams | None = None  # set once the request finished for a remote D
    finished_at: float = 0.0
    done_ranks: set[int] = field(default_factory=set)


@dataclass
class PrefillScheduler:
    fmt: PackedFormat
    digest: str
    block_size: int
    allocator: ExtentAllocator
    engine_id: str
    tp_size: int
    lease_s: float
    host: str = ""
    port: int = 0  # the side channel's, known once vLLM handed over the handshakes
    # push mode: where a decode leg that came before P answered claims the params
    board: ClaimBoard | None = None
    staged: dict[str, _Staged] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # admitted, not packed yet
    requests: dict[str, Any] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    samples: dict[str, list[float]] = field(default_factory=dict)
    pack_steps: int = 0  # steps that packed: picks each step's slot of the pack-event ring
    wipes: list[Wipe] = field(default_factory=list)  # freed packed extents, for the worker

    # ------------------------------------------------------------- vLLM's hooks
    def admit(self, request: Any) -> bool:
        """Reserve the extent of a remote-decode prefill. False: no room now; vLLM
        holds the request back and asks again next step."""
        req_id = request.request_id
        if req_id in self.staged:
            return True
        if self.board is not None:
            self.board.expect(req_id)  # a claim for its id waits for it (side_channel)
        nbytes = self.extent_bytes(request)
        extent = self.allocator.alloc(nbytes, req_id)
        if extent is None:
            if nbytes > self.allocator.capacity_bytes:
                return True  # can never fit: vLLM's own path (startup checks the size)
            if req_id not in self.waiting:
                self.waiting.add(req_id)
                self._sample("waits", 1)
                logger.info("kvcached-pd: prefill staging full (%d of %d MiB in use); request "
                            "%s (%d MiB) waits for room", self.allocator.used_bytes >> 20,
                            self.allocator.capacity_bytes >> 20, req_id, nbytes >> 20)
            return False
        trace("p_admit", req_id, bytes=nbytes, waited=req_id in self.waiting,
              since_arrival_ms=ms_since(getattr(request, "arrival_time", None)))
        self.waiting.discard(req_id)
        self.staged[req_id] = _Staged(extent)
        self.blocks[req_id] = []
        self.requests[req_id] = request
        self._usage_changed()
        return True

    def on_step(self, scheduler_output: Any, yield_req_data) -> dict[str, PackOrder]:
        packs: dict[str, PackOrder] = {}
        slot = self.pack_steps % NUM_PACK_EVENTS
        num_scheduled = scheduler_output.num_scheduled_tokens or {}
        for req_id, new_block_id_groups, full_table in yield_req_data(scheduler_output):
            if req_id not in self.blocks:
                continue
            ids = self.blocks[req_id]
            # None: this step allocated no block (a last chunk that fits the blocks
            # taken already), yet it may complete the prompt
            if new_block_id_groups is not None:
                if full_table:  # resumed after preemption (or new): the whole table follows
                    ids.clear()
                ids.extend(new_block_id_groups[0])
            req = self.requests[req_id]
            if req.num_computed_tokens + num_scheduled.get(req_id, 0) < req.num_prompt_tokens:
                continue  # a later chunk completes the prompt
            del self.blocks[req_id]
            entry = self.staged[req_id]
            n_blocks = math.ceil(int(req.num_prompt_tokens) / self.block_size)
            entry.order = PackOrder(tuple(ids[:n_blocks]), entry.extent.offset,
                                    entry.extent.nbytes, n_blocks * self.block_size,
                                    new_token(), slot)
            packs[req_id] = entry.order
            trace("pack_ordered", req_id, bytes=entry.extent.nbytes,
                  tokens=int(req.num_prompt_tokens),
                  since_arrival_ms=ms_since(getattr(req, "arrival_time", None)))
        if packs:
            self.pack_steps += 1
        return packs

    def on_finished(self, request: Any, delay_free: bool, params: dict | None) -> None:
        req_id = request.request_id
        self.waiting.discard(req_id)
        self.requests.pop(req_id, None)
        entry = self.staged.get(req_id)
        if entry is None:
            if self.board is not None:
                self.board.withdraw(req_id, f"prefill {req_id} was not staged")
            return
        if entry.order is None or not delay_free or not params or not self.port:
            # aborted before its prompt completed, or no remote D
            self.release(req_id, f"prefill {req_id} ended ({request.status}) without "
                         "packing its KV for a remote decode")
            return
        entry.params = StagedParams(
            wire_version=WIRE_VERSION, engine_id=self.engine_id, request_id=req_id,
            host=self.host, port=self.port, tp_size=self.tp_size, offset=entry.extent.offset,
            nbytes=entry.extent.nbytes, n_tok_slots=entry.order.n_tok_slots,
            num_tokens=int(request.num_prompt_tokens), block_size=self.block_size,
            lease_s=self.lease_s, format_digest=self.digest,
            token=entry.order.token.hex(), frees_on_done=True,
            pack_event=entry.order.event_slot)
        entry.finished_at = time.monotonic()
        params[PARAMS_KEY] = entry.params.to_params()
        if self.board is not None:
            self.board.publish(req_id, params[PARAMS_KEY])
        trace("p_finished", req_id, bytes=entry.extent.nbytes)

    def on_output(self, done: Iterable[tuple[str, int]], finished_sending: Iterable[str]) -> None:
        for req_id, rank in done:
            entry = self.staged.get(req_id)
            if entry is not None:
                entry.done_ranks.add(rank)
                if len(entry.done_ranks) >= self.tp_size:
                    self.release(req_id)
        for req_id in finished_sending or ():
            self.release(req_id)
        self.expire()

    def expire(self, now: float | None = None) -> None:
        """Free extents whose lease ran out without D's DONE or vLLM freeing the blocks
        (a D that died): D never starts a READ after half the lease."""
        now = time.monotonic() if now is None else now
        for req_id, entry in list(self.staged.items()):
            if entry.params is not None and now - entry.finished_at > self.lease_s:
                logger.warning("kvcached-pd: request %s: no decode instance read its %d MiB "
                               "extent within the %.0f s lease; freeing it", req_id,
                               entry.extent.nbytes >> 20, self.lease_s)
                self.release(req_id, f"P's {self.lease_s:.0f} s lease ran out")
        if self.board is not None:
            self.board.expire(now)

    # ----------------------------------------------------------------- helpers
    def extent_bytes(self, request: Any) -> int:
        n_blocks = math.ceil(int(request.num_prompt_tokens) / self.block_size)
        return self.fmt.extent_bytes(n_blocks * self.block_size)

    def release(self, req_id: str, reason: str = "released") -> None:
        self.blocks.pop(req_id, None)
        self.requests.pop(req_id, None)
        entry = self.staged.pop(req_id, None)
        if entry is not None and self.board is not None:
            self.board.withdraw(req_id, reason)
        if entry is not None:
            if entry.order is not None:  # its tag was written: the worker wipes it
                self.wipes.append(Wipe(req_id, entry.extent.offset, entry.extent.nbytes))
            self.allocator.free(entry.extent)
            self._usage_changed()
            # finished_at is time.monotonic(): ms_since (wall clock) gave ~1.8e12 ms
            held_ms = (round(1e3 * (time.monotonic() - entry.finished_at), 3)
                       if entry.finished_at else None)
            trace("p_released", req_id, held_ms=held_ms)

    def take_wipes(self) -> list[Wipe]:
        wipes, self.wipes = self.wipes, []
        return wipes

    def _sample(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def _usage_changed(self) -> None:
        self._sample("prefill_staging_bytes", self.allocator.used_bytes)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples


@dataclass
class PrefillWorker:
    region: StagingRegion
    sync_pack: bool = False  # speculative decoding: vLLM samples before wait_for_save
    # how long a request's release bookkeeping is kept (twice P's lease + margin)
    horizon_s: float = 120.0
    # (request ids, bytes, start event, end event, host seconds) of packs not reaped yet
    packing: list[tuple[str, int, Any, Any, float]] = field(default_factory=list)
    samples: dict[str, list[float]] = field(default_factory=dict)
    _done: set[tuple[str, int]] = field(default_factory=set)  # DONEs not reported yet
    _packed: dict[str, float] = field(default_factory=dict)  # blocks held by vLLM
    _released: set[str] = field(default_factory=set)  # DONE seen, not reported yet
    _sent_early: dict[str, float] = field(default_factory=dict)  # reported by us
    _tokens: dict[str, str] = field(default_factory=dict)  # packed, not wiped: token hex
    # wiped: (token hex, when); a DONE slower than vLLM's own notification still counts
    _retired: dict[str, tuple[str, float]] = field(default_factory=dict)
    _refused: int = 0  # DONE-like notifications refused since the last warning
    _refused_logged: float = -math.inf

    def wipe(self, wipes: list[Wipe]) -> None:
        """Zero the tags of extents P's scheduler freed (stream-ordered before this
        step's packs, which may reuse their bytes); their tokens free nothing more."""
        now = time.monotonic()
        for wipe in wipes:
            token = self._tokens.pop(wipe.req_id, None)
            if token is not None:
                self._retired[wipe.req_id] = (token, now)
            wipe_tag(self.region.region(wipe.offset, wipe.nbytes))

    def pack(self, packs: dict[str, PackOrder]) -> None:
        """Gather each finished prefill's blocks into its extent, on the compute stream
        (stream-ordered after the forward, before sampling: see the module docstring).
        With speculative decoding vLLM calls ``wait_for_save`` only after sampling, so
        the response could leave before the pack ran: P then waits for it."""
        if not packs:
            return
        region = self.region
        t0 = time.perf_counter()
        start = end = stream = None
        if region.buffer.tensor.is_cuda:
            stream = torch.cuda.current_stream(region.buffer.tensor.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i, (req_id, order) in enumerate(packs.items()):
            kernel_ids = region.kernel_ids(list(order.block_ids))
            if len(kernel_ids) * region.kernel_block_size != order.n_tok_slots:
                raise RuntimeError(
                    f"kvcached-pd: request {req_id}: the scheduler planned {order.n_tok_slots} "
                    f"token slots, the worker has {len(kernel_ids) * region.kernel_block_size}")
            # the device time starts at the step's first device operation, after that
            # pack's host checks (pack_request's ``started``); host_ms in the trace
            # (``packed``) is the host's side of the same calls
            pack_request(region.layers, kernel_ids, region.region(order.offset, order.nbytes),
                         region.fmt, tag_bytes(order.token, order.offset, order.nbytes),
                         started=start if i == 0 else None)
            self._tokens[req_id] = order.token.hex()
        if region.pack_events is not None:
            # a same-host D's stream waits on this before it unpacks (IPC wire)
            region.pack_events.record(next(iter(packs.values())).event_slot, stream)
        if end is not None:
            end.record(stream)
            if self.sync_pack:
                end.synchronize()
        host_s = time.perf_counter() - t0
        now = time.monotonic()
        self._packed.update((req_id, now) for req_id in packs)
        self.packing.append((",".join(packs), sum(o.nbytes for o in packs.values()),
                             start, end, host_s))
        self.reap()

    def reap(self) -> None:
        still = []
        for entry in self.packing:
            req_ids, nbytes, start, end, host_s = entry
            if end is not None and not end.query():
                still.append(entry)
                continue
            device = start.elapsed_time(end) / 1e3 if end is not None else host_s
            self.samples.setdefault("pack_duration", []).append(device)
            trace("packed", req_ids, bytes=nbytes, device_ms=round(1e3 * device, 3),
                  host_ms=round(1e3 * host_s, 3))
        self.packing = still

    def take_samples(self) -> dict[str, list[float]]:
        self.reap()
        samples, self.samples = self.samples, {}
        return samples

    def done(self) -> set[tuple[str, int]]:
        """D's DONE notifications received since the last call."""
        self.reap()
        self._drain()
        done, self._done = self._done, set()
        return done

    def finished_sending(self, inner: Any) -> Any:
        """What this rank reports as sent: the inner connector's report, plus the packed
        requests D's DONE released, less the inner connector's later report of those
        (see the module docstring)."""
        self._drain()
        now = time.monotonic()
        sending = set()
        for req_id in inner or ():
            if self._sent_early.pop(req_id, None) is not None:
                continue  # its lease ran out after we had reported it
            self._packed.pop(req_id, None)  # the inner connector freed it first
            self._released.discard(req_id)
            sending.add(req_id)
        for req_id in self._released:
            self._sent_early[req_id] = now
            sending.add(req_id)
            trace("p_blocks_released", req_id)
        self._released = set()
        for held in (self._packed, self._sent_early):
            for req_id in [r for r, t in held.items() if now - t > self.horizon_s]:
                del held[req_id]  # aborted after its pack: vLLM never held its blocks
        for req_id in [r for r, (_, t) in self._retired.items() if now - t > self.horizon_s]:
            del self._retired[req_id]
        return sending

    def reported_early(self, req_id: str) -> bool:
        return req_id in self._sent_early

    def _drain(self) -> None:
        for message in self.region.agent.notifications():
            try:
                record = Done.decode(message)
            except WireError as exc:
                self._refuse(str(exc))
                continue
            if record is None:
                continue
            token = self._tokens.get(record.request_id) or \
                self._retired.get(record.request_id, ("",))[0]
            if not token or not hmac.compare_digest(token, record.token):
                self._refuse(f"a DONE for request {record.request_id[:200]!r} without its "
                             "token (its sender never held the request's params)")
                continue
            self._done.add((record.request_id, record.rank))
            if self._packed.pop(record.request_id, None) is not None:
                self._released.add(record.request_id)

    def _refuse(self, reason: str, every_s: float = 60.0) -> None:
        """Ignore one notification; warn for the first and then at most every
        ``every_s`` (a peer may send any number)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= every_s:
            logger.warning("kvcached-pd: ignored %d notification(s) to the staging agent, "
                           "the last: %s", self._refused, reason)
            self._refused, self._refused_logged = 0, now
