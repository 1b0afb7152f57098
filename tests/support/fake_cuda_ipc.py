"""CUDA IPC for a CPU test process, where P and D are two engines of one process.

``export_staging`` hands out a token for P's staging tensor and an event ring; D's
``open_staging`` maps that token back to the very same tensor, so D's unpack reads P's
bytes as it would through a real IPC mapping. Every event record, stream wait, pack and
unpack lands in one ordered :attr:`FakeIpc.log`, so tests can check the order the wire
promises (P packs, P records the pack event, D's stream waits on it, D unpacks).
``fail_open`` makes D's open fail the way a real one can (another IPC namespace, a
GPU that cannot peer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from kvcached_pd.transport import cuda_ipc


@dataclass
class FakeEvent:
    owner: "FakeIpc"
    name: str

    def record(self, stream: Any = None) -> None:
        self.owner.log.append(("record", self.name))

    def __repr__(self) -> str:
        return self.name


class FakeStream:
    """What D's unpack waits on (the test's stand-in for D's compute stream)."""

    def __init__(self, owner: "FakeIpc") -> None:
        self.owner = owner

    def wait_event(self, event: FakeEvent) -> None:
        self.owner.log.append(("wait", event.name))


class FakeEndEvent:
    """An unpack's end event whose completion the test controls (``done``)."""

    def __init__(self, owner: "FakeIpc") -> None:
        self.owner = owner

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self.owner.unpacks_complete

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@dataclass
class FakeIpc:
    log: list[tuple[str, str]] = field(default_factory=list)
    exported: dict[int, Any] = field(default_factory=dict)  # token -> (tensor, events)
    opened: list[int] = field(default_factory=list)
    fail_open: str | None = None  # reason D's open fails with
    fail_same_host: bool = True
    unpacks_complete: bool = True  # what FakeEndEvent.query answers
    _tokens: Any = field(default_factory=lambda: itertools.count(1))

    def export_staging(self, tensor):
        token = next(self._tokens)
        events = cuda_ipc.PackEvents.__new__(cuda_ipc.PackEvents)
        events.events = [FakeEvent(self, f"p{token}.e{i}") for i in range(4)]
        events.handles = [e.name.encode() for e in events.events]
        self.exported[token] = (tensor, events)
        export = cuda_ipc.StagingExport(
            host=cuda_ipc.host_identity(), device_uuid="GPU-fake", nbytes=tensor.numel(),
            memory=(token, tensor.numel(), 0, b"", 0, b"", False), events=tuple(events.handles))
        return export, events

    def open_staging(self, export, device):
        if self.fail_open is not None:
            raise cuda_ipc.IpcUnavailable(self.fail_open, same_host=self.fail_same_host)
        token = export.memory[0]
        tensor, events = self.exported[token]
        self.opened.append(token)
        return cuda_ipc.MappedStaging(tensor, list(events.events), tensor.device), \
            "same GPU (fake)"

    def device_events(self):
        return FakeStream(self), None, FakeEndEvent(self)


def install(monkeypatch) -> FakeIpc:
    """Replace the CUDA IPC layer for this test; returns the fake to inspect."""
    from kvcached_pd.connector.decode_worker import DecodeWorker

    fake = FakeIpc()
    monkeypatch.setattr(cuda_ipc, "export_staging", fake.export_staging)
    monkeypatch.setattr(cuda_ipc, "open_staging", fake.open_staging)
    monkeypatch.setattr(DecodeWorker, "_device_events", lambda self: fake.device_events())
    return fake
