"""What the connector's scheduler half hands its worker half each step, and back.

vLLM carries these between processes (pickled): the scheduler's
:class:`StepMetadata` rides in ``SchedulerOutput.kv_connector_metadata``; the worker's
:class:`WorkerReport` rides in ``KVConnectorOutput.kv_connector_worker_meta`` and is
aggregated over TP ranks before the scheduler sees it. Both wrap the inner
NixlConnector's own records, which are passed on to it untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvcached_pd.connector.wire import StagedParams


@dataclass(frozen=True)
class PackOrder:
    """P: gather these scheduler blocks into ``[offset, offset + nbytes)`` of staging,
    and end the extent with the tag of the request's ``token`` (:mod:`.tokens`)."""

    block_ids: tuple[int, ...]
    offset: int
    nbytes: int
    n_tok_slots: int
    token: bytes
    event_slot: int = -1  # the pack-event slot P's worker records after this step's packs


@dataclass(frozen=True)
class Wipe:
    """P: the extent ``[offset, offset + nbytes)`` of ``req_id`` was freed; zero its tag
    (its token must open nothing any more) before this step's packs."""

    req_id: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ClaimTarget:
    """Where D claims a request's params when its decode leg came before P answered
    (push mode): P's listener (P's vLLM side-channel port + the claim offset), P's engine
    and the request's base id."""

    host: str
    port: int
    engine_id: str
    key: str


@dataclass(frozen=True)
class RecvOrder:
    """D: READ P's extent from token ``first_token`` on (the window D lacks) and scatter
    tokens ``[first_token, num_tokens)`` into ``block_ids`` (D's scheduler blocks holding
    those tokens, in token order). ``params`` is None until claimed from ``claim`` (push
    mode, concurrent legs)."""

    params: StagedParams | None
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    # time.monotonic() on D after which the READ must not start (with a claim: after
    # which the claim is given up; the READ's own limit comes with the params)
    deadline: float
    claim: ClaimTarget | None = None
    # a full prefix hit on D: no block to fill, nothing to READ; only P's DONE is sent
    notify_only: bool = False
    # load it within this step, before its forward (an IPC peer: vLLM was told the load
    # is synchronous and computes the last prompt token in the same step)
    sync: bool = False
    # the scheduler's own claim for it failed (push mode, an IPC peer): the worker fails
    # the load with this reason, as it does a failed claim of its own
    failure: str = ""


@dataclass
class StepMetadata(KVConnectorMetadata):
    inner: Any = None
    packs: dict[str, PackOrder] = field(default_factory=dict)
    recvs: dict[str, RecvOrder] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)  # D: aborted before their READ
    wipes: list[Wipe] = field(default_factory=list)  # P: extents freed since the last step


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    inner: Any = None
    # P: (request id, D rank) READs completed, from D's DONE notifications
    done: set[tuple[str, int]] = field(default_factory=set)
    # D: IPC loads finished whose unpack may still read P's staging, and those whose
    # unpack has run (DecodeScheduler.on_finished_recving)
    unread: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)
    # D: (P engine, host, port, rank) -> True when that rank's wire became CUDA IPC,
    # False when its mapping was dropped (DecodeScheduler.on_wires: loads from a peer
    # every rank of which is on the IPC wire are synchronous)
    ipc_peers: dict[tuple[str, str, int, int], bool] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, WorkerReport)
        inner = self.inner
        if inner is None:
            inner = other.inner
        elif other.inner is not None:
            inner = inner.aggregate(other.inner)
        return WorkerReport(inner=inner, done=self.done | other.done,
                            unread=self.unread | other.unread, read=self.read | other.read,
                            ipc_peers={**self.ipc_peers, **other.ipc_peers})
