"""The decode side's scheduler half: which requests load through the staged transport,
and when.

Scheduler half (:class:`DecodeScheduler`), one call per vLLM hook:

* ``match`` (``get_num_new_matched_tokens``): a request whose ``kv_transfer_params``
  carry compatible :class:`StagedParams` loads asynchronously through the staged path,
  or synchronously (in ``start_load_kv`` of the step that schedules it, before its
  forward) from a peer every rank of which D's workers have mapped over CUDA IPC
  (:meth:`DecodeScheduler._loads_now`; the workers say so in ``WorkerReport.ipc_peers``);
  anything else (a plain vLLM P, another wire version or format, an extent larger
  than D's staging) is left to the inner NixlConnector, and said so once per peer.
* ``on_alloc`` (``update_state_after_alloc``): the blocks to unpack into.

A prefix hit in D's own cache moves only what D lacks: the worker READs (or, on the
IPC wire, unpacks from P's memory) the window of P's extent from the first token D
does not hold, tag included (packed format 3 is token-major, so that window is one
byte range: :meth:`~kvcached_pd.transport.format.PackedFormat.window`), into an
extent of D's staging of the window's size; P still frees its whole extent on the
DONE. A *full* hit (D holds every prompt token but the last, which vLLM computes again
whatever was loaded) loads nothing: ``match`` reports 0 tokens, vLLM computes that
token, and the worker sends P the DONE alone (``RecvOrder.notify_only``), so P frees
its extent and blocks at once. Before packed format 3 D READ the whole extent whatever
it held (issue 23: 22x vLLM's TTFT on a repeated-prompt benchmark at 0.5 GB/s).
* ``on_finished_recving`` (``update_connector_output``): the READ is done, and its DONE
  has told P to free the extent and its blocks (``frees_on_done``); the caller also
  hands the request to the inner NixlConnector with no block to read, which sends P
  vLLM's own "done" notification (what freed P's blocks before P freed them on DONE,
  and what clears the inner connector's own record of the request on P). The request
  keeps ``do_remote_prefill`` until then, so an abort at any point before it makes the
  inner connector notify P the same way (vLLM's path for requests aborted before
  scheduling). vLLM 0.29+ refuses that notification between peers of two KV layouts
  (its handshake fails, logged by vLLM on D); P's blocks are freed on DONE all the same.

Push mode (the inner connector is vLLM's ``NixlPushConnector``): a staged request is
READ the same way. D clears its ``do_remote_prefill`` once it has taken it, so the inner
push connector never registers it with P (no ``PUSH_REG``, no per-block WRITE into
kvcached memory); P frees its blocks on D's DONE (:mod:`.prefill`). A request aborted
before its READ leaves P's blocks and extent to P's lease, as vLLM's push mode does
for a decode request that never registers.

Push mode with concurrent legs (the proxy sends the decode leg before P has answered,
so D can allocate while P still prefills, as vLLM's push design intends): the request
carries only P's vLLM side-channel address, no :class:`StagedParams`. D asks that host
at the claim port (:mod:`.side_channel`) for P's handshake, once per P engine, while
vLLM holds the request back; a kvcached-pd P of a claim-capable wire and the same
packed format makes the request staged: D allocates its blocks at once, takes it out
of vLLM's push flow as above, and its worker claims the params from P's listener,
which answers when P has packed the extent; the READ follows as in pull mode. From a P
every rank of D reads over CUDA IPC, D's scheduler claims the params itself instead and
holds the request back until P answers, so that it loads synchronously in the step that
schedules it (:meth:`DecodeScheduler._claim_now`). Any other
P (a plain vLLM, an older wire, another format, nothing listening within
:data:`PROBE_TIMEOUT_S`) keeps vLLM's per-block push, said once per peer and retried
after :data:`PROBE_RETRY_S`. Before this, every concurrent leg took that per-block push
into D's kvcached memory: the 0.5 GB/s path.

Everything in a request's ``kv_transfer_params`` is the client's to write (vLLM hands
them over as the proxy sent them): the scheduler refuses malformed or inconsistent
staged params (:meth:`~kvcached_pd.connector.wire.StagedParams.from_params`, and the
prompt's length and the packed size here), and the request takes vLLM's own path, which
reads P's blocks as vLLM does: nothing is lost. What only the worker can check (the
extent within P's advertised staging, and the tag of the bytes read: :mod:`.tokens`)
fails that request's load instead, as a failed NIXL READ does (vLLM's
``kv_load_failure_policy``: the request fails, or D recomputes it): never an exception
in an engine hook, never bytes unpacked that are not the request's.

The worker half, which moves the bytes, is :mod:`.decode_worker`.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvcached_pd.connector.records import ClaimTarget, RecvOrder
from kvcached_pd.connector.side_channel import ClaimClient, claim_port, fetch_handshake
from kvcached_pd.connector.wire import (
    CLAIM_WIRE_VERSION,
    COMPATIBLE_WIRE_VERSIONS,
    MAX_HOST_BYTES,
    MAX_LEASE_S,
    PARAMS_KEY,
    Claim,
    ClaimReply,
    RankHandshake,
    StagedParams,
    WireError,
    base_request_id,
)
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport import trace as tracing
from kvcached_pd.transport.trace import ms_since, trace

logger = logging.getLogger("kvcached_pd")

PROBE_TIMEOUT_S = 2.0  # how long D waits for a P's claim listener to answer, once per P
PROBE_RETRY_S = 300.0  # a P found not to answer claims is asked again after this
# Probes run at once at most; each takes up to PROBE_TIMEOUT_S on a dead target, so
# requests naming dead or forged targets cannot queue a real P's probe behind theirs:
# with every worker busy a new target is answered "no" (vLLM's push) and asked again by
# its next request, uncached.
PROBE_WORKERS = 8
# A claim reply's age (how long ago P published the request) read as 0 when it is this
# little below 0: P's listener could read its clock just before P published (fixed on P;
# D accepts such an answer from a P of the same wire version built before the fix).
CLAIM_AGE_SLACK_S = 0.25
# Peers (engine id, host, port) D keeps a verdict or a handshake for. Requests choose
# them, so the maps are bounded: the oldest entry goes first.
MAX_PEERS = 1024


def peer_key(params: Any) -> tuple[str, str, int]:
    """What a handshake or a verdict is cached under: the engine id and where it was
    asked, so a request naming a real engine id with another host pins nothing for it."""
    return (str(params.engine_id), str(params.host), int(params.port))


def bound(cache: dict, limit: int | None = None) -> None:
    """Drop ``cache``'s oldest entries (dicts keep insertion order) beyond ``limit``
    (:data:`MAX_PEERS`)."""
    limit = MAX_PEERS if limit is None else limit
    while len(cache) > limit:
        del cache[next(iter(cache))]


def read_claim_reply(target: ClaimTarget, reply: ClaimReply, digest: str, capacity_bytes: int,
                     num_tokens: int) -> tuple[StagedParams, float]:
    """P's answer to a claim, checked: (P's params, how long ago P staged them, >= 0);
    :class:`WireError` with the reason the request's load fails. The listener is the
    request's choice, so the answer is untrusted like the params of a pull request."""
    if reply.status == "gone":
        raise WireError(f"prefill {target.engine_id} has no staged extent for it: {reply.reason}")
    try:
        params = StagedParams.from_params({PARAMS_KEY: reply.params})
    except WireError as exc:
        raise WireError(f"prefill {target.engine_id} answered its claim with {exc}") from None
    if params is None or params.engine_id != target.engine_id:
        raise WireError(f"the claim was answered by another prefill than {target.engine_id}")
    if base_request_id(params.request_id) != target.key:
        # P's board answers a claim only with the request of that base id; params of
        # another request would pass every other check here (and its tag: the tag is
        # that request's), so D would unpack another prompt's KV into this one
        raise WireError(f"prefill {target.engine_id} answered the claim for {target.key!r} "
                        f"with the params of another request")
    if params.format_digest != digest or params.wire_version not in COMPATIBLE_WIRE_VERSIONS:
        raise WireError(f"prefill {target.engine_id}'s extent is in another packed format or wire")
    if params.num_tokens != num_tokens:
        raise WireError(f"prefill {target.engine_id} staged {params.num_tokens} tokens for "
                        f"{target.key}, this decode expects {num_tokens}")
    if params.nbytes > capacity_bytes:
        raise WireError(f"its {params.nbytes >> 20} MiB extent exceeds the "
                        f"{capacity_bytes >> 20} MiB decode staging")
    age_s = reply.age_s
    if isinstance(age_s, bool) or not isinstance(age_s, (int, float)) or \
            not -CLAIM_AGE_SLACK_S <= age_s <= MAX_LEASE_S:
        raise WireError(f"prefill {target.engine_id} answered its claim with an invalid age")
    # A P of wire version 3 before the board clamped its ages could answer a claim
    # published just after it read its clock with a small negative age: that is 0.
    return params, max(0.0, float(age_s))


def claim_outcome(req_id: str, target: ClaimTarget, reply: ClaimReply | Exception,
                  digest: str, capacity_bytes: int, num_tokens: int, now: float, by: str
                  ) -> tuple[StagedParams | None, float | None, str]:
    """What P's answer to a claim (or the claim client's error) makes of the request's
    load, for D's scheduler and its worker alike (``by``, in the trace): (P's params, the
    READ's deadline, "") or (None, None, why the load fails)."""
    if isinstance(reply, Exception):
        return None, None, f"claim from {target.engine_id}: {reply}"
    try:
        params, age_s = read_claim_reply(target, reply, digest, capacity_bytes, num_tokens)
    except WireError as exc:
        return None, None, str(exc)
    trace("claim_answered", req_id, age_ms=round(1e3 * age_s, 3),
          remote_req=params.request_id, by=by)
    # P's lease began when P staged it, age_s ago: D never READs after half of it
    return params, now + params.lease_s / 2 - age_s, ""


@dataclass
class _Pending:
    request: Any
    params: StagedParams | None  # None: claimed from P later (push, concurrent legs)
    first_token: int
    blocks: Any = None  # vLLM's KVCacheBlocks, kept for the inner connector's notify
    loading: bool = False  # its RecvOrder went to the worker
    claim: ClaimTarget | None = None
    full_hit: bool = False  # D holds every token it needs: P gets the DONE alone
    sync: bool = False  # loaded within the step that schedules it (an IPC peer)
    deadline: float | None = None  # params claimed by the scheduler: P's lease, halved
    failure: str = ""  # the scheduler's claim failed: the worker fails the load with this


class ClaimProbe:
    """Push mode, concurrent legs: is this request's P a kvcached-pd instance whose
    extents this decode instance can claim and unpack? Asked once per P engine, in the
    background (vLLM holds the request back meanwhile)."""

    def __init__(self, digest: str, tp_size: int, timeout_s: float = PROBE_TIMEOUT_S,
                 retry_s: float = PROBE_RETRY_S, secret: bytes | None = None,
                 workers: int = PROBE_WORKERS) -> None:
        self.digest = digest
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.secret = secret
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="kvcached-pd-probe")
        # (engine id, host, port) -> (future, started)
        self._probes: dict[tuple[str, str, int], tuple[Future, float]] = {}

    def verdict(self, engine_id: str, host: str, port: int) -> tuple[str, str]:
        """("yes" | "no" | "wait", reason for "no")."""
        now = time.monotonic()
        key = (str(engine_id), str(host), int(port))
        probe = self._probes.get(key)
        if probe is not None and probe[0].done() and probe[0].exception() is not None \
                and now - probe[1] > self.retry_s:
            probe = None
        if probe is None:
            if sum(not p[0].done() for p in self._probes.values()) >= self.workers:
                return "no", (f"{self.workers} kvcached-pd claim listeners are being asked "
                              "already")
            probe = (self._pool.submit(self._ask, engine_id, host, port), now)
            self._probes.pop(key, None)
            self._probes[key] = probe
            bound(self._probes)
        future = probe[0]
        if not future.done():
            return "wait", ""
        if future.exception() is not None:
            return "no", str(future.exception())
        return "yes", ""

    def _ask(self, engine_id: str, host: str, port: int) -> None:
        try:
            handshake = RankHandshake.decode(fetch_handshake(host, port, 0, self.timeout_s,
                                                             self.secret))
        except (TimeoutError, ConnectionError, WireError) as exc:
            raise RuntimeError(f"no kvcached-pd claim listener answered at {host}:{port} "
                               f"({exc})") from exc
        if handshake.engine_id != engine_id:
            raise RuntimeError(f"{host}:{port} is prefill {handshake.engine_id}, not {engine_id}")
        if handshake.wire_version < CLAIM_WIRE_VERSION:
            raise RuntimeError(f"its kvcached-pd speaks wire version {handshake.wire_version}, "
                               f"which answers no claims (needs {CLAIM_WIRE_VERSION}+)")
        if handshake.format_digest != self.digest or handshake.tp_size != self.tp_size:
            raise RuntimeError("its packed format, TP size or head range differs")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class DecodeScheduler:
    digest: str
    block_size: int
    capacity_bytes: int
    tp_size: int
    push: bool = False  # the inner connector is vLLM's push connector (module docstring)
    lease_s: float = 30.0  # how long a claim may wait for P's prefill (this engine's lease)
    fmt: PackedFormat | None = None  # this side's packed format (a claim's size estimate)
    probe: ClaimProbe | None = None  # push mode: which P answers claims
    secret: bytes | None = None  # proves this D to P's listener (side_channel.sign)
    claim_timeout_s: float = 5.0  # a claim listener silent this long past its hold is gone
    # push mode, concurrent legs, an IPC peer: the scheduler claims the params itself
    # (_claim_now), request id -> (target, when claimed, prompt tokens), and each
    # answered claim's outcome until vLLM allocates the request (or ends it)
    claims: ClaimClient | None = None
    claiming: dict[str, tuple[ClaimTarget, float, int]] = field(default_factory=dict)
    claimed: dict[str, tuple[StagedParams | None, float | None, str]] = field(
        default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)
    orders: dict[str, RecvOrder] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    # IPC loads finished whose unpack may still read P's staging (on_finished_recving),
    # and synchronous loads from their allocation on
    parked: dict[str, _Pending] = field(default_factory=dict)
    # (P engine, host, port) -> D's ranks whose wire to it is CUDA IPC (the workers'
    # reports, on_wires): a peer every rank of which is here loads synchronously
    ipc_ranks: dict[tuple[str, str, int], set[int]] = field(default_factory=dict)
    refused_peers: dict[str, str] = field(default_factory=dict)  # engine id -> reason
    unnotified_peers: set[str] = field(default_factory=set)  # P block size differs
    samples: dict[str, list[float]] = field(default_factory=dict)
    computing: set[str] = field(default_factory=set)  # trace: loaded, forward not scheduled
    arrival_unknown_logged: bool = False  # _read_deadline's WARNING, once

    def staged_params(self, request: Any) -> StagedParams | None:
        """The request's staged params when this side can serve them, else None."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            staged = StagedParams.from_params(params)
        except WireError as exc:
            self._refuse(str(params.get("remote_engine_id")), str(exc))
            return None
        if staged is None:
            if not self.push:
                self._refuse(str(params.get("remote_engine_id")), "it is not a kvcached-pd "
                             "prefill (no staged extent in its kv_transfer_params)")
            return None
        reason = None
        if staged.wire_version not in COMPATIBLE_WIRE_VERSIONS:
            reason = f"it speaks wire version {staged.wire_version}"
        elif staged.format_digest != self.digest:
            reason = "its packed format (layers, heads, dtype or TP head range) differs"
        elif staged.tp_size != self.tp_size:
            reason = f"its TP size {staged.tp_size} differs from this instance's {self.tp_size}"
        elif staged.nbytes > self.capacity_bytes:
            reason = (f"request {request.request_id}'s {staged.nbytes >> 20} MiB exceed the "
                      f"{self.capacity_bytes >> 20} MiB decode staging")
        elif staged.num_tokens != len(request.prompt_token_ids or ()):
            # fewer: D would take prompt tokens as loaded that no extent holds (wrong
            # text); more: the extent holds KV of tokens this request does not have
            reason = "a request's staged num_tokens differ from its prompt's length"
        elif self.fmt is not None and staged.nbytes != self.fmt.extent_bytes(staged.n_tok_slots):
            reason = "a request's staged nbytes differ from what its n_tok_slots pack into"
        if reason is not None:
            self._refuse(staged.engine_id, reason)
            return None
        return staged

    def match(self, request: Any, num_computed_tokens: int
              ) -> tuple[int | None, bool] | None:
        """(tokens to load, True) for a staged request; (None, False) while a push-mode
        P is being asked whether it answers claims (vLLM asks again next step); None
        for the inner connector's requests."""
        if request.request_id in self.parked:
            # preempted after its load, before D's unpack was reported run: its blocks
            # are gone and P's extent may be too; vLLM computes the prompt again here
            return 0, False
        staged = self.staged_params(request)
        claim = None
        if staged is None:
            params = request.kv_transfer_params
            if not (self.push and params and params.get("do_remote_prefill")
                    and PARAMS_KEY not in params):
                return None
            claim, reason = self._claim_target(request)
            if claim is None:
                if reason == "wait":
                    return None, False
                self._refuse(str(params.get("remote_engine_id")), reason)
                return None
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 1:
            # A full prefix hit: vLLM computes the last prompt token again after any
            # load (it needs its logits), so nothing is worth moving; P is told (on_alloc)
            self.pending[request.request_id] = _Pending(request, staged, num_computed_tokens,
                                                        claim=claim, full_hit=True)
            return 0, False
        deadline, failure = None, ""
        # A request the scheduler claimed stays on that path, whatever D's wires say now:
        # P answers one claim per request. Its reply may wait in ``claimed`` already,
        # taken while another request was matched (2 x H100, 2026-11-26: with the
        # idle unmap's news in between, the worker claimed again and P refused it)
        if claim is not None and (request.request_id in self.claiming
                                  or request.request_id in self.claimed
                                  or self._ipc_engine(claim)):
            claimed = self._claim_now(request, claim)
            if claimed is None:
                return None, False  # P has not staged it yet: vLLM asks again next step
            staged, deadline, failure = claimed
            if staged is not None:
                claim = None
        sync = staged is not None and self._loads_now(staged)
        trace("d_match", request.request_id, tokens=count, sync=sync,
              since_arrival_ms=ms_since(getattr(request, "arrival_time", None)))
        self.pending[request.request_id] = _Pending(request, staged, num_computed_tokens,
                                                    claim=claim, sync=sync,
                                                    deadline=deadline, failure=failure)
        if sync:
            # vLLM computes the last prompt token in the step that schedules the request
            # (after any load it does so again, it needs that token's logits)
            return count - 1, False
        return count, True

    def _loads_now(self, staged: StagedParams) -> bool:
        """Whether this request loads synchronously: within the step that schedules it,
        before that step's forward, on the compute stream. Only from a peer every rank
        of which D reads over CUDA IPC (no READ to wait for: the unpack reads P's extent
        after P's pack event, 0.25 ms at 94 MiB on an H200), with P's block size; in
        push mode with concurrent legs the scheduler claims the params first
        (:meth:`_claim_now`). An asynchronous load costs
        vLLM two more engine steps before the request's first forward: the step that
        reports the load finished and, with vLLM's asynchronous scheduling (its
        default), the step scheduled before that report was seen: 15-18 ms each on one
        H200 shared by P and D under load (2026-11-26, kvbig 48/8)."""
        if staged.block_size != self.block_size:
            return False
        return len(self.ipc_ranks.get(peer_key(staged), ())) >= self.tp_size

    def _ipc_engine(self, claim: ClaimTarget) -> bool:
        """Whether every rank of D reads the claimed request's P over CUDA IPC. A claim
        names P's vLLM address, the handshake P's own: the engine id ties them (a
        request naming the right engine at another host is told apart later: its
        params' peer is not a mapped one, or its tag is not the request's)."""
        return any(key[0] == claim.engine_id and len(ranks) >= self.tp_size
                   for key, ranks in self.ipc_ranks.items())

    def _claim_now(self, request: Any, claim: ClaimTarget
                   ) -> tuple[StagedParams | None, float | None, str] | None:
        """Push mode, concurrent legs, from an IPC peer: claim the params here, holding
        the request back (vLLM asks again every step) until P has staged it, so that it
        loads synchronously in the step that schedules it. The worker's claim (the
        asynchronous path) reports the load finished one step after P answered and
        vLLM's asynchronous scheduling adds one more: the two steps the pull path's
        synchronous loads took out (15-18 ms each under load on one H200). None while P
        has not answered; else (params, the READ's deadline, "") or (None, None, why the
        load fails): the worker fails it as a failed claim of its own. The outcome is kept
        until vLLM allocates the request: with no room in D's KV cache vLLM asks again
        next step, and P answers a claim once (a second one is refused)."""
        req_id = request.request_id
        now = time.monotonic()
        if req_id not in self.claiming and req_id not in self.claimed:
            if self.claims is None:
                # polled here, every step, not by a thread waiting for the GIL
                self.claims = ClaimClient(self.claim_timeout_s, self.secret, threaded=False)
            self.claims.submit(req_id, claim.host, claim.port,
                               Claim(CLAIM_WIRE_VERSION, claim.key, claim.engine_id))
            self.claiming[req_id] = (claim, now, len(request.prompt_token_ids or ()))
            trace("claim_sent", req_id, key=claim.key, by="scheduler")
            return None
        for answered, reply in self.claims.take().items():
            entry = self.claiming.pop(answered, None)
            if entry is not None:  # else given up since (on_request_finished)
                target, _since, num_tokens = entry
                self.claimed[answered] = claim_outcome(
                    answered, target, reply, self.digest, self.capacity_bytes, num_tokens, now,
                    by="scheduler")
        if req_id in self.claiming:
            target, since, _ = self.claiming[req_id]
            if now - since <= self.lease_s:
                return None
            self.claims.cancel(req_id)
            del self.claiming[req_id]
            self.claimed[req_id] = (None, None, f"prefill {target.engine_id} had not staged "
                                    "it within this instance's KV lease")
        return self.claimed[req_id]

    def on_wires(self, ipc_peers: dict[tuple[str, str, int, int], bool]) -> None:
        """The workers' news of their peers' wires (``WorkerReport.ipc_peers``)."""
        for (engine_id, host, port, rank), up in ipc_peers.items():
            key = (engine_id, host, port)
            ranks = self.ipc_ranks.setdefault(key, set())
            if up:
                ranks.add(rank)
            else:
                ranks.discard(rank)
            if not ranks:
                del self.ipc_ranks[key]
        bound(self.ipc_ranks)

    def _claim_target(self, request: Any) -> tuple[ClaimTarget | None, str]:
        """Where to claim a push-mode request's params from, or (None, why not), with
        "wait" meaning not known yet."""
        params = request.kv_transfer_params
        engine_id = str(params.get("remote_engine_id"))
        prefix = ("the proxy sent the decode leg before P answered (push mode with "
                  "concurrent legs) and ")
        host, port = params.get("remote_host"), params.get("remote_port")
        if not (isinstance(host, str) and 0 < len(host) <= MAX_HOST_BYTES
                and type(port) is int and 1 <= claim_port(port) <= 65535):
            return None, prefix + "its kv_transfer_params name no valid remote_host/remote_port"
        port = claim_port(port)
        if self.probe is None or self.fmt is None:
            return None, prefix + "this instance claims no extents"
        n_tokens = len(request.prompt_token_ids or ())
        estimate = self.fmt.extent_bytes(math.ceil(n_tokens / self.block_size)
                                         * self.block_size)
        if estimate > self.capacity_bytes:
            return None, (f"request {request.request_id}'s ~{estimate >> 20} MiB exceed "
                          f"the {self.capacity_bytes >> 20} MiB decode staging")
        verdict, reason = self.probe.verdict(engine_id, host, port)
        if verdict == "wait":
            return None, "wait"
        if verdict == "no":
            return None, (prefix + reason + ": vLLM's per-block WRITE into this "
                          "instance's memory, the slow path with kvcached")
        return ClaimTarget(host, port, engine_id, base_request_id(request.request_id)), ""

    def on_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """True when the request is staged (the caller keeps the inner connector out)."""
        if request.request_id in self.parked:
            # vLLM reschedules a loaded request through here (0 external tokens): the
            # inner connector would notify P while D's unpack may still read P's staging
            return True
        entry = self.pending.get(request.request_id)
        if entry is None:
            return False
        self.claimed.pop(request.request_id, None)  # allocated: never asked again
        if entry.full_hit:
            return self._notify_only(request, entry)
        if num_external_tokens <= 0:
            del self.pending[request.request_id]
            return False
        entry.blocks = blocks
        if self.push:
            # the inner push connector must never register it with P (a PUSH_REG would
            # make P WRITE its blocks into kvcached memory, the 0.5 GB/s path)
            request.kv_transfer_params["do_remote_prefill"] = False
        elif entry.params.block_size != self.block_size:
            self._leave_unnotified(entry)
        trace("d_alloc", request.request_id,
              remote_req=entry.params.request_id if entry.params else entry.claim.key,
              tokens=int(num_external_tokens), claimed=entry.claim is not None,
              since_arrival_ms=ms_since(getattr(request, "arrival_time", None)))
        ids = list(blocks.get_block_ids()[0])
        num_tokens = (entry.params.num_tokens if entry.params is not None
                      else len(request.prompt_token_ids or ()))
        first_block = entry.first_token // self.block_size
        last_block = math.ceil(num_tokens / self.block_size)
        entry.loading = True
        self.orders[request.request_id] = RecvOrder(
            params=entry.params, block_ids=tuple(ids[first_block:last_block]),
            first_token=entry.first_token, num_tokens=num_tokens,
            deadline=self._read_deadline(request, entry),
            claim=entry.claim, sync=entry.sync, failure=entry.failure)
        if entry.sync:
            # no finished load is ever reported for it: it waits, as an IPC load whose
            # unpack may still read P's staging, for the worker's word that it ran
            del self.pending[request.request_id]
            self.parked[request.request_id] = entry
            if tracing.enabled():
                self.computing.add(request.request_id)
        return True

    def _read_deadline(self, request: Any, entry: _Pending) -> float:
        """``time.monotonic()`` after which D must not start the request's READ.

        P frees an extent at its lease (``params.lease_s`` after it staged it) at the
        latest and may pack another request into it; the tag, read before the scatter
        runs on the device, does not cover that window, so D keeps its READs within half
        the lease. Params D's scheduler claimed carry P's own age (:func:`read_claim_reply`).
        Params that came with the request (pull mode) carry none, but P staged them
        before the decode leg reached D: the time the request has waited on D since its
        arrival (vLLM's ``arrival_time``, wall clock) is counted against the half lease.
        Until 2026-11-27 the half lease started at D's allocation, so a request vLLM held
        back for KV room more than half a lease was read although P may have reused its
        extent. Params still to be claimed by the worker get this instance's lease (the
        claim's limit; the READ's comes with the params)."""
        if entry.deadline is not None:
            return entry.deadline
        now = time.monotonic()
        if entry.params is None:
            return now + self.lease_s
        waited = 0.0
        arrival = getattr(request, "arrival_time", None)
        if isinstance(arrival, (int, float)) and not isinstance(arrival, bool) \
                and math.isfinite(arrival):
            waited = max(0.0, time.time() - float(arrival))
        elif not self.arrival_unknown_logged:
            # every supported release sets it (tests/test_connector_ipc_wire.py checks);
            # one that stops must not weaken the rule without a word
            self.arrival_unknown_logged = True
            logger.warning("kvcached-pd: vLLM's request %s carries no arrival time; a "
                           "pulled request's READ deadline counts from its allocation, "
                           "so its wait for KV room on this instance goes uncounted",
                           request.request_id)
        return now + entry.params.lease_s / 2 - waited

    def _notify_only(self, request: Any, entry: _Pending) -> bool:
        """A full hit: the worker sends P the DONE without a READ; vLLM waits for
        nothing (0 tokens loaded). True when the inner connector must stay out: in push
        mode (it would register the request with P for a per-block WRITE) and between
        P and D block sizes that differ (vLLM's notify-only path cannot serve them:
        :meth:`_leave_unnotified`). Otherwise vLLM's own full-hit path notifies P too,
        as after a staged READ (it clears the inner connector's record on P)."""
        del self.pending[request.request_id]
        if self.push:
            request.kv_transfer_params["do_remote_prefill"] = False
            inner_out = True
        elif entry.params.block_size != self.block_size:
            self._leave_unnotified(entry)
            inner_out = True
        else:
            inner_out = False
        num_tokens = (entry.params.num_tokens if entry.params is not None
                      else len(request.prompt_token_ids or ()))
        wait_s = entry.params.lease_s / 2 if entry.params is not None else self.lease_s
        self.orders[request.request_id] = RecvOrder(
            params=entry.params, block_ids=(), first_token=entry.first_token,
            num_tokens=num_tokens, deadline=time.monotonic() + wait_s, claim=entry.claim,
            notify_only=True)
        trace("d_full_hit", request.request_id,
              remote_req=entry.params.request_id if entry.params else entry.claim.key,
              cached_tokens=entry.first_token)
        return inner_out

    def take_orders(self) -> tuple[dict[str, RecvOrder], set[str]]:
        orders, self.orders = self.orders, {}
        cancelled, self.cancelled = self.cancelled, set()
        return orders, cancelled

    def on_finished_recving(self, req_ids, unread=frozenset(), read=frozenset()
                            ) -> list[tuple[Any, Any]]:
        """(request, blocks) of staged loads that completed: the caller passes them to
        the inner connector so that P is told and frees its blocks.

        ``unread``: loads of the IPC wire whose unpack, enqueued, still reads P's staging
        on the device; ``read``: those whose unpack has run (D sent its DONE). vLLM's
        notification makes P free the extent, so for the former it waits in
        :attr:`parked` until the latter says so (the worker's report)."""
        handed = []
        for req_id in req_ids or ():
            trace("d_recv_reported", req_id)
            if tracing.enabled():
                self.computing.add(req_id)
            entry = self.pending.pop(req_id, None)
            if entry is None or entry.blocks is None:
                continue
            if self.push or entry.params.block_size != self.block_size:
                continue  # P frees them on DONE (older P16/D32: by its lease)
            if req_id in unread and req_id not in read:
                self.parked[req_id] = entry
                continue
            handed.append((entry.request, entry.blocks))
        for req_id in read:
            entry = self.parked.pop(req_id, None)
            if entry is not None:
                handed.append((entry.request, entry.blocks))
        return handed

    def _leave_unnotified(self, entry: _Pending) -> None:
        """P's and D's block sizes differ: vLLM's notify-only read (no local block)
        indexes group 0 of a remote block list it leaves empty then (vLLM 0.26
        ``pull_worker._read_blocks``: IndexError, the decode EngineCore died on the
        host with P 16 / D 32). So the request never reaches that path: it no longer
        asks for a remote prefill (vLLM's own connector clears the flag the same way
        once it has taken a request). P frees its blocks on D's DONE; a kvcached-pd P
        older than ``frees_on_done`` frees only its extent then, and its blocks when its
        KV lease runs out (said once per such P)."""
        entry.request.kv_transfer_params["do_remote_prefill"] = False
        if entry.params.frees_on_done or entry.params.engine_id in self.unnotified_peers:
            return
        self.unnotified_peers.add(entry.params.engine_id)
        logger.warning(
            "kvcached-pd: prefill %s uses %d-token blocks, this decode %d, and predates "
            "freeing blocks on kvcached-pd's DONE: vLLM cannot notify it without a read, so "
            "it frees each request's blocks when its KV lease (%.0f s) runs out instead of "
            "at once; upgrade its kvcached-pd", entry.params.engine_id,
            entry.params.block_size, self.block_size, entry.params.lease_s)

    def on_step(self, scheduler_output: Any) -> None:
        """Trace only: the step that schedules a loaded request's own forward (the one
        that yields its first token on D); it should be the step after the scheduler
        learnt the load (``d_recv_reported``)."""
        if not self.computing:
            return
        scheduled = scheduler_output.num_scheduled_tokens or {}
        for req_id in [r for r in self.computing if r in scheduled]:
            self.computing.discard(req_id)
            trace("d_compute_scheduled", req_id, tokens=int(scheduled[req_id]))

    def on_request_finished(self, request: Any) -> None:
        self.computing.discard(request.request_id)
        self.claimed.pop(request.request_id, None)
        if self.claiming.pop(request.request_id, None) is not None:
            # held back for its claim (never allocated): P's lease frees its extent, as
            # for a push-mode request aborted before its READ
            self.claims.cancel(request.request_id)
            return
        if self.parked.pop(request.request_id, None) is not None:
            # its unpack may still read P's staging: vLLM must not notify P now (it does
            # for a request that still asks for a remote prefill); P frees on D's DONE
            request.kv_transfer_params["do_remote_prefill"] = False
            return
        entry = self.pending.get(request.request_id)
        if entry is None:
            return
        if not entry.loading:
            del self.pending[request.request_id]
            if not self.push and entry.params.block_size != self.block_size:
                self._leave_unnotified(entry)
        else:
            # vLLM keeps the blocks until the worker reports the load finished.
            self.cancelled.add(request.request_id)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        if self.claims is not None:
            self.claims.close()

    def _refuse(self, engine_id: str, reason: str) -> None:
        self.samples.setdefault("direct_fallbacks", []).append(1)
        if self.refused_peers.get(engine_id) != reason:
            self.refused_peers.pop(engine_id, None)
            self.refused_peers[engine_id] = reason
            bound(self.refused_peers)
            logger.warning("kvcached-pd: requests from prefill %s take vLLM's own NIXL path: "
                           "%s", engine_id, reason)
