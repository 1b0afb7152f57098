"""P's claim board: the staged params of P's requests, as P's listener answers claims.

Push mode with concurrent legs, a decode leg that reached D before P answered claims its
request's :class:`~kvcached_pd.connector.wire.StagedParams` from P's listener
(:mod:`.side_channel`) by the request's base id. P's scheduler thread writes the board
(admitted, staged, released, expired every step); the listener thread reads it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvcached_pd.connector.wire import Claim, ClaimReply, base_request_id

MAX_BOARD_GONE = 4096  # released requests a board still answers "gone" for


@dataclass
class _Entry:
    base: str  # the request's base id: what a claim names
    params: dict[str, Any] | None = None  # set once P staged it
    gone: str | None = None  # why, once P released it
    at: float = 0.0  # monotonic time of publishing or releasing
    answers_left: int = 1  # "ready" answers left: one per decode rank


class ClaimBoard:
    """What P's listener answers claims from; written by P's scheduler thread, read by
    the listener thread.

    Keyed by P's request id, each under its base id (a claim names only the base id, and
    a client chooses it, as X-Request-Id): P's scheduler enters a request when it admits
    it (:meth:`expect`), so the board knows every request in flight under a base id,
    staged or not yet. A claim is answered "ready" only when exactly one request in
    flight has that base id, and at most ``readers`` times (once per decode rank: a D
    asks again only on "pending"), so two requests sharing one id get "gone" rather
    than each other's params, and a replayed claim gets "gone" too. A released request
    is answered "gone" for ``keep_s`` (P's lease: no READ may start later), at most
    :data:`MAX_BOARD_GONE` of them. P's scheduler calls :meth:`expire` every step, so
    the board holds no more than P's requests in flight plus those."""

    def __init__(self, engine_id: str, keep_s: float, readers: int = 1,
                 max_gone: int = MAX_BOARD_GONE) -> None:
        self.engine_id = engine_id
        self.keep_s = keep_s
        self.readers = readers
        self.max_gone = max_gone
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # P request id -> entry
        self._by_base: dict[str, set[str]] = {}
        self._dated: OrderedDict[str, float] = OrderedDict()  # published/released, by age
        self._gone = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def expect(self, req_id: str) -> None:
        """P admitted ``req_id``: a claim for its base id waits for it."""
        with self._lock:
            if req_id not in self._entries:
                self._add(req_id, _Entry(base_request_id(req_id), answers_left=self.readers))

    def publish(self, req_id: str, params: dict[str, Any]) -> None:
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None:
                entry = _Entry(base_request_id(req_id), answers_left=self.readers)
                self._add(req_id, entry)
            if entry.gone is None:
                entry.params = params
                self._date(req_id, entry)
        self._wake()

    def withdraw(self, req_id: str, reason: str) -> None:
        """The request's extent is released (or never was): a claim for it from now on
        is answered "gone". A request P never admitted (every request P finishes comes
        here, local ones too) is not entered."""
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None or entry.gone is not None:
                return
            entry.gone, entry.params = reason, None
            self._gone += 1
            self._date(req_id, entry)
            while self._gone > self.max_gone:
                self._drop_oldest_gone()
        self._wake()

    def answer(self, claim: Claim, now: float | None = None) -> ClaimReply:
        now = time.monotonic() if now is None else now
        if claim.engine_id != self.engine_id:
            return ClaimReply(claim.key, "gone", reason=f"this is prefill {self.engine_id}, "
                              f"not {claim.engine_id}")
        with self._lock:
            entries = [self._entries[r] for r in self._by_base.get(claim.key, ())]
            live = [e for e in entries if e.gone is None]
            if len(live) > 1:
                return ClaimReply(claim.key, "gone", reason=(
                    f"{len(live)} requests with id {claim.key!r} are in flight on prefill "
                    f"{self.engine_id}; a claim cannot tell them apart (give each request "
                    "its own id)"))
            if not live:
                if entries:
                    latest = max(entries, key=lambda e: e.at)
                    return ClaimReply(claim.key, "gone", reason=latest.gone or "")
                return ClaimReply(claim.key, "pending")
            entry = live[0]
            if entry.params is None:
                return ClaimReply(claim.key, "pending")
            if entry.answers_left <= 0:
                return ClaimReply(claim.key, "gone", reason=(
                    f"request {claim.key!r} was claimed already"))
            entry.answers_left -= 1
            # ``now`` may predate the publishing: the listener reads the clock once for
            # all its held claims, and P's scheduler can publish in between (seen on an
            # H100: D refused 19 of 64 push requests for an age of -0.x ms)
            return ClaimReply(claim.key, "ready", params=entry.params,
                              age_s=max(0.0, now - entry.at))

    def expire(self, now: float | None = None) -> None:
        """Forget what was published or released more than ``keep_s`` ago (P's scheduler
        calls this every step)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._dated:
                req_id, at = next(iter(self._dated.items()))
                if now - at <= self.keep_s:
                    break
                self._remove(req_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # the lock is held by the callers of these
    def _add(self, req_id: str, entry: _Entry) -> None:
        self._entries[req_id] = entry
        self._by_base.setdefault(entry.base, set()).add(req_id)

    def _date(self, req_id: str, entry: _Entry) -> None:
        entry.at = time.monotonic()
        self._dated[req_id] = entry.at
        self._dated.move_to_end(req_id)

    def _remove(self, req_id: str) -> None:
        self._dated.pop(req_id, None)
        entry = self._entries.pop(req_id)
        if entry.gone is not None:
            self._gone -= 1
        ids = self._by_base[entry.base]
        ids.discard(req_id)
        if not ids:
            del self._by_base[entry.base]

    def _drop_oldest_gone(self) -> None:
        for req_id in self._dated:
            if self._entries[req_id].gone is not None:
                self._remove(req_id)
                return

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except BlockingIOError:  # the listener has wake-ups pending already
            pass

    def drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    @property
    def wake_fd(self) -> socket.socket:
        return self._wake_r

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
