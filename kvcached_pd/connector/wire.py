"""What crosses between a prefill (P) and a decode (D) kvcached-pd connector.

Four records, nothing else:

* :class:`RankHandshake`: one per P worker rank, served by P's side channel and fetched
  once per peer rank by D's worker. It carries P's NIXL agent, its staging region and
  the packed format; D checks the wire version and the format here, once per peer.
* :class:`StagedParams`: per request, P -> D inside vLLM's ``kv_transfer_params``
  (under :data:`PARAMS_KEY`, next to the inner NixlConnector's own keys, which a plain
  vLLM decode instance reads and ignores ours). It says where the packed extent lies.
* :class:`Done`: D -> P, the NIXL notification that rides on D's READ and reaches P
  when the READ has completed; P then frees the extent.
* :class:`Claim`: D -> P over P's side channel, push mode with concurrent legs only: a
  decode leg that reached D before P answered carries no :class:`StagedParams`, so D
  asks P's listener for them by request id and P answers once the extent is packed
  (:class:`ClaimReply`).

The model is vLLM's ``nixl/metadata.py``: a version constant with its history, and a
compatibility check at handshake rather than per request. Per-request params carry
only the version and a hash of the format, which D's scheduler compares with its own
before routing a request to the staged path (cheap, and it lets D route requests from
an incompatible P to vLLM's own path without waiting for a handshake).

Wire version history
  1 (2026-11-23): first connector wire. Handshake per P rank; per-request extent at
    one offset in every P rank's staging (each rank packs its own heads there); DONE
    notification ``KVPD1:D:<request id>:<rank>``. Per-request params carry P's block
    size (added before any release, after the first GPU run: D needs it to know whether
    vLLM's notify-only path can serve the hand-over, see ``DecodeScheduler``).
  2 (2026-11-24): the claim (push mode, decode leg sent before P answered): D asks P's
    side channel for a request's :class:`StagedParams` by its base id (vLLM's id less
    its per-engine random suffix, as vLLM's push matches a registration). Nothing of
    version 1 changed meaning, so 1 stays compatible: D claims only from a P whose
    handshake says 2 or more, and leaves the others' concurrent legs to vLLM's push.
  2, amended 2026-11-25: optional ``frees_on_done`` in :class:`StagedParams`: P frees
    the request's blocks on D's DONE in pull mode too, not only its extent. An older P
    omits it (read as False), an older D ignores it; they still work together, so the
    version stays 2 (only what D logs about P's blocks depends on it).
  2, amended 2026-11-25: the CUDA IPC wire. Optional ``ipc`` in :class:`RankHandshake`
    (P's staging exported for a same-host D, :mod:`kvcached_pd.transport.cuda_ipc`) and
    optional ``pack_event`` in :class:`StagedParams` (the slot of P's event ring recorded
    after the request's pack). An older D ignores both and READs over NIXL; a newer D
    reads their absence as "no IPC" and READs over NIXL too. The DONE is the same
    notification on both wires (on the IPC wire D sends it once its unpack has run).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Mapping

import msgspec

from kvcached_pd.transport.format import PackedFormat

WIRE_VERSION = 2
# Versions this build can talk to. A new version that only adds optional fields may
# list its predecessor here; a change in meaning must not.
COMPATIBLE_WIRE_VERSIONS = frozenset({1, 2})
CLAIM_WIRE_VERSION = 2  # the first version whose P answers claims

PARAMS_KEY = "kvcached_pd"  # in kv_transfer_params, P -> D
_DONE_PREFIX = b"KVPD1:D:"


class WireError(ValueError):
    """A peer sent something this build cannot use (reason in the message)."""


# The deepest msgpack a record may hold: a record is a map (1) whose ``dict[str, Any]``
# fields (a handshake's packed format, a claim reply's params) are flat maps (2) of
# scalars; 8 leaves room for an optional nested field. msgspec decodes an ``Any`` field
# recursively, so 100k nested arrays raised RecursionError there instead of a
# DecodeError; the depth is checked first, without recursion.
MAX_MSGPACK_DEPTH = 8


class _Msgpack:
    """A record that crosses P's side channel as msgpack; ``decode`` names it in errors."""

    WHAT = "record"

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes):
        """The record in ``data``; :class:`WireError`, and nothing else, for anything a
        peer can send that is not one."""
        try:
            check_msgpack_shape(data)
            return msgspec.msgpack.decode(data, type=cls)
        except WireError as exc:
            raise WireError(f"undecodable kvcached-pd {cls.WHAT}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a peer's bytes never raise anything else
            raise WireError(f"undecodable kvcached-pd {cls.WHAT}: {exc}") from exc


# msgpack's header bytes: (first, last) -> (kind, fixed length or size-field bytes)
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1),
          0xc9: (4, 1), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0)}  # (size bytes, type byte)
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # (size, items per)


def check_msgpack_shape(data: bytes, max_depth: int = MAX_MSGPACK_DEPTH) -> None:
    """Raise :class:`WireError` unless ``data`` is exactly one msgpack object nested at
    most ``max_depth`` deep, each container declaring no more items than bytes remain.
    One pass over the headers, no recursion: what msgspec is then handed is bounded."""
    view = memoryview(data)
    end, pos = len(view), 0
    remaining = [1]  # items still expected at each open level
    while remaining:
        if remaining[-1] == 0:
            remaining.pop()
            continue
        remaining[-1] -= 1
        if pos >= end:
            raise WireError("truncated msgpack")
        head = view[pos]
        pos += 1
        items, container = 0, False
        if head <= 0x7f or head >= 0xe0:
            continue  # fixint
        if 0x80 <= head <= 0x9f:
            items, container = (head & 0x0f) * (2 if head <= 0x8f else 1), True
        elif 0xa0 <= head <= 0xbf:
            pos += head & 0x1f
        elif head in _FIXED:
            pos += _FIXED[head]
        elif head in _SIZED:
            size_bytes, type_byte = _SIZED[head]
            pos += size_bytes + type_byte + int.from_bytes(view[pos:pos + size_bytes], "big")
        elif head in _CONTAINERS:
            size_bytes, per = _CONTAINERS[head]
            if pos + size_bytes > end:
                raise WireError("truncated msgpack")
            items, container = per * int.from_bytes(view[pos:pos + size_bytes], "big"), True
            pos += size_bytes
        else:
            raise WireError(f"byte 0x{head:02x} at {pos - 1} starts no msgpack object")
        if pos > end:
            raise WireError("truncated msgpack")
        if container and len(remaining) > max_depth:  # this container's depth
            raise WireError(f"msgpack nested deeper than {max_depth}")
        if items > end - pos:
            raise WireError(f"a msgpack container of {items} items in {end - pos} bytes")
        if items:
            remaining.append(items)
    if pos != end:
        raise WireError(f"{end - pos} bytes after the msgpack object")


def format_hash(fmt: PackedFormat, head_start: int, head_count: int) -> str:
    """A short, stable digest of what must match for an extent to be unpacked as-is:
    the packed format (layers, heads, head size, dtype) and the rank's head range."""
    text = json.dumps({**fmt.to_dict(), "head_start": head_start, "head_count": head_count},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankHandshake(_Msgpack):
    """One P worker rank, as D needs it to READ from that rank's staging."""

    WHAT = "handshake"

    wire_version: int
    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    staging_base: int  # device address of the registered staging buffer
    staging_bytes: int
    device_id: int
    memory_type: str  # NIXL memory type of the staging buffer: "VRAM" or "DRAM"
    packed_format: dict[str, Any]  # PackedFormat.to_dict()
    head_start: int  # this rank's first KV head in the model's numbering (TP > 1)
    head_count: int
    format_digest: str
    # P's staging exported for CUDA IPC (cuda_ipc.StagingExport.to_dict); None: NIXL only
    ipc: dict[str, Any] | None = None

    def check_compatible(self, own_format: PackedFormat, own_digest: str) -> None:
        """Raise :class:`WireError` unless this peer's extents can be unpacked here."""
        if self.wire_version not in COMPATIBLE_WIRE_VERSIONS:
            raise WireError(f"peer {self.engine_id} speaks kvcached-pd wire version "
                            f"{self.wire_version}; this build speaks "
                            f"{sorted(COMPATIBLE_WIRE_VERSIONS)}")
        try:
            own_format.check_compatible(PackedFormat.from_dict(self.packed_format))
        except ValueError as exc:
            raise WireError(f"peer {self.engine_id}: {exc}") from exc
        if self.format_digest != own_digest:
            raise WireError(f"peer {self.engine_id} packs heads [{self.head_start}, "
                            f"{self.head_start + self.head_count}) per rank; this rank "
                            "expects another range")


@dataclass(frozen=True)
class StagedParams:
    """Where one request's packed KV waits on P (the same offset on every P rank)."""

    wire_version: int
    engine_id: str
    request_id: str  # P's request id: what D's DONE names
    host: str  # P's kvcached-pd side channel
    port: int
    tp_size: int
    offset: int
    nbytes: int  # per rank
    n_tok_slots: int
    num_tokens: int
    block_size: int  # P's scheduler block size (tokens)
    lease_s: float  # P frees the extent this long after the request finished at the latest
    format_digest: str
    # P frees the request's blocks on D's DONE (optional: absent from older builds)
    frees_on_done: bool = False
    # the slot of P's pack-event ring recorded after this request's pack (IPC wire); -1:
    # none (an older P, or a P that exports no IPC)
    pack_event: int = -1

    def to_params(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "StagedParams | None":
        """The staged params in a request's ``kv_transfer_params``, None when there are
        none (a plain vLLM prefill); :class:`WireError` when they are malformed."""
        raw = (params or {}).get(PARAMS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise WireError(f"{PARAMS_KEY} in kv_transfer_params is not a mapping: {raw!r}")
        names = {f.name: f.type for f in fields(cls) if f.name in raw or f.default is MISSING}
        missing = sorted(set(names) - set(raw))
        if missing:
            raise WireError(f"{PARAMS_KEY} lacks {missing} (peer wire version "
                            f"{raw.get('wire_version')!r})")
        try:
            return cls(**{name: _coerce(raw[name], kind) for name, kind in names.items()})
        except (TypeError, ValueError) as exc:
            raise WireError(f"malformed {PARAMS_KEY}: {exc}") from exc


def _coerce(value: Any, kind: Any) -> Any:
    kind = str(kind)
    if kind == "int":
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"{value!r} is not an integer")
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not a boolean")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a string")
        return value
    return value


@dataclass(frozen=True)
class Done:
    """D's READ of ``request_id``'s extent from P rank ``rank`` has completed."""

    request_id: str
    rank: int

    def encode(self) -> bytes:
        return _DONE_PREFIX + f"{self.request_id}:{self.rank}".encode()

    @classmethod
    def decode(cls, message: bytes) -> "Done | None":
        """None for a message that is not a kvcached-pd DONE."""
        if not message.startswith(_DONE_PREFIX):
            return None
        body = message[len(_DONE_PREFIX):].decode(errors="replace")
        request_id, _, rank = body.rpartition(":")
        if not request_id or not rank.isdigit():
            return None
        return cls(request_id, int(rank))


_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """A request id less the ``-<8 hex>`` suffix each vLLM engine appends to the id a
    proxy sent (vLLM 0.24+ push mode matches D's registration to P's request the same
    way): P and D know one request under ids that differ only there."""
    return _RANDOM_SUFFIX.sub("", request_id)


@dataclass(frozen=True)
class Claim(_Msgpack):
    """D asks P for the :class:`StagedParams` of the request whose base id is ``key``."""

    WHAT = "claim"

    wire_version: int
    key: str  # base_request_id of the request
    engine_id: str  # the P engine D means (a listener of another engine answers GONE)


@dataclass(frozen=True)
class ClaimReply(_Msgpack):
    """P's answer to a :class:`Claim`.

    ``status``: ``"ready"`` (``params`` holds the request's :class:`StagedParams` as
    ``to_params`` writes them, ``age_s`` how long ago P finished it: D's READ must start
    within half of P's lease of that), ``"pending"`` (not packed yet, or not arrived:
    ask again), ``"gone"`` (P released or never staged it: ``reason`` says why; D's load
    fails rather than wait for a push that will not come)."""

    WHAT = "claim reply"

    key: str
    status: str
    params: dict[str, Any] | None = None
    age_s: float = 0.0
    reason: str = ""

    @classmethod
    def decode(cls, data: bytes) -> "ClaimReply":
        reply = super().decode(data)
        if reply.status not in ("ready", "pending", "gone"):
            raise WireError(f"claim reply with unknown status {reply.status!r}")
        if reply.status == "ready" and reply.params is None:
            raise WireError("a ready claim reply without params")
        return reply
