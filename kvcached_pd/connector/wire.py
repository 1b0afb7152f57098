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
  3 (2026-11-25): per-request tokens (:mod:`.tokens`): :class:`StagedParams` carry a
    required ``token`` (32 hex digits), the extent ends with a tag holding it (packed
    format version 2), and the DONE is ``KVPD3:D:<request id>:<rank>:<token>``. P frees
    an extent and its blocks only on a DONE with the request's token; D unpacks only an
    extent whose tag matches its params. Versions 1 and 2 are not compatible: their
    params carry no token, so nothing could show that the bytes read are the request's.
    Requests between a version 3 and an older peer take vLLM's own NIXL path (both sides
    refuse the other's params and handshake), as between peers of two packed formats.
  3, amended 2026-11-25: packed format version 3 (token-major, issue 23): a decode side
    with a prefix hit READs only the extent's tail from the first token it lacks (tag
    included) and a full hit sends the DONE alone. No field of the params, handshake or
    DONE changed, so the wire version stays 3: the format version travels in the
    handshake's ``packed_format`` and in the params' ``format_digest``, so peers of
    formats 2 and 3 refuse each other's params and handshake, and their requests take
    vLLM's own NIXL path.
  3, amended 2026-11-26: optional ``notify_metadata`` in :class:`RankHandshake`: P's
    NIXL agent with its connection and none of its memory. A D on the IPC wire loads
    it instead of ``agent_metadata`` (it only sends DONEs), so UCX never opens P's
    staging in D's process (``StagingAgent.add_peer`` says why that matters). An older
    D ignores it; a newer D reads its absence as "load all of P's agent".

Every field of a peer's params is checked before use (:meth:`StagedParams.from_params`):
types, finite numbers, bounds (:data:`MAX_WIRE_INT`), and the arithmetic that ties
``num_tokens``, ``n_tok_slots`` and ``block_size`` together. A refusal is per request.
The IPC wire's optional fields (version 2, amended) stay optional in version 3.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Mapping

import msgspec

from kvcached_pd.transport.format import PackedFormat

WIRE_VERSION = 3
# Versions this build can talk to. A new version that only adds optional fields may
# list its predecessor here; a change in meaning must not.
COMPATIBLE_WIRE_VERSIONS = frozenset({3})
CLAIM_WIRE_VERSION = 2  # the first version whose P answers claims

PARAMS_KEY = "kvcached_pd"  # in kv_transfer_params, P -> D
_DONE_PREFIX = b"KVPD3:D:"

# Bounds on what a peer's params may say. 2**48 bytes (256 TiB) is above any device
# buffer (x86-64 and CUDA address 48 bits of virtual memory), and every integer below
# it survives a proxy that holds JSON numbers as doubles (exact to 2**53).
MAX_WIRE_INT = 1 << 48
MAX_ID_BYTES = 4096  # a request or engine id (UTF-8): above any id vLLM or a proxy makes
MAX_HOST_BYTES = 255  # a DNS name's limit
MAX_LEASE_S = 86400.0  # a day: no KV lease is longer (vLLM's default is 480 s at most)
MAX_BLOCK_SIZE = 1 << 20
_TOKEN_HEX = re.compile(r"[0-9a-f]{32}")
_RANK = re.compile(r"[0-9]{1,5}")


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
    # P's NIXL agent without its memory (connection only): what a D on the IPC wire loads
    # to send its DONEs; None: an older P (D loads ``agent_metadata``)
    notify_metadata: bytes | None = None

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
    nbytes: int  # per rank, the extent's tag included
    n_tok_slots: int
    num_tokens: int
    block_size: int  # P's scheduler block size (tokens)
    lease_s: float  # P frees the extent this long after the request finished at the latest
    format_digest: str
    token: str  # the request's token, 32 hex digits (.tokens): in the extent's tag and DONE
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
        none (a plain vLLM prefill); :class:`WireError` when they are malformed (any
        input: nothing else is raised)."""
        try:
            raw = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
        except Exception as exc:  # noqa: BLE001 - a mapping whose get raises
            raise WireError(f"unreadable kv_transfer_params: {type(exc).__name__}") from None
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise WireError(f"{PARAMS_KEY} in kv_transfer_params is not a mapping")
        names = {f.name: f.type for f in fields(cls) if f.name in raw or f.default is MISSING}
        missing = sorted(set(names) - set(raw))
        if missing:
            raise WireError(f"{PARAMS_KEY} lacks {missing} (peer wire version "
                            f"{_short(raw.get('wire_version'))})")
        try:
            staged = cls(**{name: _coerce(name, raw[name], kind)
                            for name, kind in names.items()})
            staged._check()
        except WireError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else a value can make raise
            raise WireError(f"malformed {PARAMS_KEY}: {type(exc).__name__}") from None
        return staged

    def _check(self) -> None:
        """What holds between fields (P's ``on_step`` packs whole blocks of the prompt)."""
        if not 1 <= self.port <= 65535:
            raise WireError(f"malformed {PARAMS_KEY}: port {self.port} is not a TCP port")
        if min(self.tp_size, self.nbytes, self.num_tokens) < 1 or self.offset < 0:
            raise WireError(f"malformed {PARAMS_KEY}: tp_size, nbytes and num_tokens must "
                            "be positive, offset not negative")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise WireError(f"malformed {PARAMS_KEY}: block_size {self.block_size}")
        if self.offset + self.nbytes > MAX_WIRE_INT:
            raise WireError(f"malformed {PARAMS_KEY}: the extent ends past 2**48")
        blocks = -(-self.num_tokens // self.block_size)
        if self.n_tok_slots != blocks * self.block_size:
            raise WireError(f"malformed {PARAMS_KEY}: {self.num_tokens} tokens in blocks of "
                            f"{self.block_size} fill {blocks * self.block_size} slots, not "
                            f"{self.n_tok_slots}")
        if not (math.isfinite(self.lease_s) and 0 < self.lease_s <= MAX_LEASE_S):
            raise WireError(f"malformed {PARAMS_KEY}: lease_s must be in (0, "
                            f"{MAX_LEASE_S:.0f}]")
        if not _TOKEN_HEX.fullmatch(self.token):
            raise WireError(f"malformed {PARAMS_KEY}: token is not 32 lowercase hex digits")


def _short(value: Any) -> str:
    """A peer's value in an error message, cut short (it may be anything, and huge)."""
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else \
        type(value).__name__
    return text if len(text) <= 40 else text[:40] + "..."


_STR_LIMITS = {"host": MAX_HOST_BYTES, "format_digest": 64, "token": 32}


def _coerce(name: str, value: Any, kind: Any) -> Any:
    """One field of a peer's params, or :class:`WireError`. Integers: ``int`` (or an
    integral float, as a JSON proxy may write one) of magnitude at most
    ``MAX_WIRE_INT`` (signs are the business of ``StagedParams._check``); floats:
    finite; strings: valid UTF-8 of bounded length (a DONE must be able to carry the
    request id)."""
    kind = str(kind)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not an integer")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not an integer")
        if not -MAX_WIRE_INT <= value <= MAX_WIRE_INT:
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is outside "
                            "[-2**48, 2**48]")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, int) and abs(value) > MAX_WIRE_INT):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not a number")
        value = float(value)
        if not math.isfinite(value):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not finite")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not a boolean")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise WireError(f"malformed {PARAMS_KEY}: {name}={_short(value)} is not a string")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise WireError(f"malformed {PARAMS_KEY}: {name} is not valid UTF-8") from None
        if not 0 < size <= _STR_LIMITS.get(name, MAX_ID_BYTES):
            raise WireError(f"malformed {PARAMS_KEY}: {name} is empty or longer than "
                            f"{_STR_LIMITS.get(name, MAX_ID_BYTES)} bytes")
        return value
    raise WireError(f"malformed {PARAMS_KEY}: {name} has no known type")


@dataclass(frozen=True)
class Done:
    """D's READ of ``request_id``'s extent from P rank ``rank`` has completed; ``token``
    (32 hex digits) is the request's, from its params: P frees nothing on a DONE
    whose token is not the request's."""

    request_id: str
    rank: int
    token: str

    def encode(self) -> bytes:
        return _DONE_PREFIX + f"{self.request_id}:{self.rank}:{self.token}".encode()

    @classmethod
    def decode(cls, message: Any) -> "Done | None":
        """None for a message that is not a kvcached-pd DONE; :class:`WireError` for one
        that starts like a DONE and is malformed (any input: nothing else is raised).
        A message is anything any agent that loaded P's metadata sends: the rank must
        be ASCII digits, the token 32 lowercase hex digits, the request id valid UTF-8
        of at most :data:`MAX_ID_BYTES`."""
        if not isinstance(message, (bytes, bytearray, memoryview)):
            return None
        message = bytes(message)
        if not message.startswith(_DONE_PREFIX):
            return None
        if len(message) > len(_DONE_PREFIX) + MAX_ID_BYTES + 40:
            raise WireError(f"a DONE of {len(message)} bytes (longer than any request id)")
        try:
            body = message[len(_DONE_PREFIX):].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("a DONE that is not valid UTF-8") from None
        rest, _, token = body.rpartition(":")
        request_id, _, rank = rest.rpartition(":")
        if not request_id or not _RANK.fullmatch(rank) or not _TOKEN_HEX.fullmatch(token):
            raise WireError("a malformed DONE (want <request id>:<rank>:<32 hex digits>)")
        return cls(request_id, int(rank), token)


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
