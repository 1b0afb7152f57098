"""The canonical packed format of one request's KV in a staging extent (version 3).

Prefill and decode workers may lay their caches out differently (NHD or HND, K/V
first, blocks first or K/V packed, kvcached or not) and may use different block sizes.
Rather than negotiate a common block size or layout, each side converts between its own
cache and this one format, and the handshake checks only that both speak it.

Version 3, for one request on one TP rank, with ``n_tok_slots`` = (blocks packed) x
(block size of the packing side), token-major::

    extent = slot 0 | slot 1 | ... | slot n_tok_slots-1 | tag    (no gaps, no header)
    slot   = layer 0 | layer 1 | ... | layer num_layers-1
    layer  = K then V, each (num_kv_heads, head_dim), C-contiguous, in the cache dtype
    tag    = TAG_BYTES bytes the packing side's connector writes after the KV (the
             request's token and the extent's place: kvcached_pd.connector.tokens);
             the pack and unpack kernels never touch it

so the extent is one array of logical shape ``(n_tok_slots, num_layers, 2,
num_kv_heads, head_dim)`` followed by the tag. Token-major makes every suffix of a
request's tokens, with the tag, one contiguous byte range (:meth:`PackedFormat.window`)
whatever either side's block size: a decode side that already holds a prompt's first
tokens in its prefix cache reads only ``[slot_offset(first), extent_bytes)`` and still
reads, and checks, the tag. Version 2 was layer-major (per layer ``(2, n_tok_slots,
heads, head_dim)``): a token suffix there was ``2 x num_layers`` ranges, so D read the
whole extent whatever it held (issue 23: round 2 of a repeated-prompt benchmark 22x
slower than vLLM's own PD, which reads only the blocks D lacks). Version 1 had no tag.

The tag is what makes a read of the wrong bytes detectable before they are used: the
decode side checks it against the request's params before it unpacks (see
``kvcached_pd.connector.tokens``).

Token slot ``t`` holds the request's token ``t``; slots ``[num_tokens, n_tok_slots)``
are padding (whatever the packing side's last block held there). ``n_tok_slots`` and
``num_tokens`` travel with the request, not in the format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "TAG_BYTES",
    "PackedFormat",
    "PackedFormatMismatch",
    "dtype_name",
    "format_of_kv_cache_config",
    "packed_extent_view",
]

FORMAT_VERSION = 3
TAG_BYTES = 32  # after the KV of every extent: a 16-byte token, the extent's size and offset


class PackedFormatMismatch(ValueError):
    """The two sides of a transfer do not speak the same packed format."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling used on the wire."""
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV cache dtype {name!r} in packed format")
    return dtype


@dataclass(frozen=True)
class PackedFormat:
    """What both sides must agree on to exchange packed extents."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "version"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PackedFormat.{field} must be a positive int, got {value!r}")
        _dtype_from_name(self.dtype)

    @classmethod
    def for_cache(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> PackedFormat:
        """The current-version format of a cache with these dims."""
        return cls(num_layers, num_kv_heads, head_dim, dtype_name(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_from_name(self.dtype)

    @property
    def bytes_per_token_one_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def bytes_per_token_all_layers(self) -> int:
        return self.num_layers * self.bytes_per_token_one_layer

    def kv_bytes(self, n_tok_slots: int) -> int:
        """Size of the KV part of an extent of ``n_tok_slots`` token slots (all layers)."""
        _check_slots(n_tok_slots)
        return n_tok_slots * self.bytes_per_token_all_layers

    def extent_bytes(self, n_tok_slots: int) -> int:
        """Size of an extent holding ``n_tok_slots`` token slots of every layer, and its tag."""
        return self.kv_bytes(n_tok_slots) + TAG_BYTES

    def slot_offset(self, slot: int) -> int:
        """Byte offset of token slot ``slot`` (all its layers) inside any extent."""
        if slot < 0:
            raise ValueError(f"token slot {slot} is negative")
        return slot * self.bytes_per_token_all_layers

    def window(self, n_tok_slots: int, first_slot: int = 0) -> tuple[int, int]:
        """``(start, nbytes)``: the one byte range of an extent of ``n_tok_slots`` slots
        that holds slots ``[first_slot, n_tok_slots)`` and the tag, which is what a side
        that already holds the first ``first_slot`` tokens reads."""
        _check_slots(n_tok_slots)
        if not 0 <= first_slot < n_tok_slots:
            raise ValueError(f"first slot {first_slot} outside an extent of {n_tok_slots} "
                             "token slots")
        start = self.slot_offset(first_slot)
        return start, self.extent_bytes(n_tok_slots) - start

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form for the handshake and ``kv_transfer_params``."""
        return {
            "version": self.version,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PackedFormat:
        missing = {"version", "num_layers", "num_kv_heads", "head_dim", "dtype"} - set(data)
        if missing:
            raise ValueError(f"packed format {dict(data)!r} lacks {sorted(missing)}")
        return cls(
            num_layers=data["num_layers"],
            num_kv_heads=data["num_kv_heads"],
            head_dim=data["head_dim"],
            dtype=data["dtype"],
            version=data["version"],
        )

    def check_compatible(self, other: PackedFormat) -> None:
        """Raise :class:`PackedFormatMismatch` naming the first field that differs."""
        checks = (
            ("version", "packed format version", ""),
            ("num_layers", "num_layers", ""),
            ("num_kv_heads", "num_kv_heads",
             " (different TP sizes); TP head slicing not supported"),
            ("head_dim", "head_dim", ""),
            ("dtype", "KV cache dtype", ""),
        )
        for field_name, label, consequence in checks:
            mine, theirs = getattr(self, field_name), getattr(other, field_name)
            if mine != theirs:
                raise PackedFormatMismatch(
                    f"{label} differs: {mine} here, {theirs} at the peer{consequence}"
                )


def format_of_kv_cache_config(kv_cache_config: Any) -> tuple[PackedFormat | None, str]:
    """The packed format of one TP rank of a vLLM ``KVCacheConfig``, or None and the
    reason staging cannot serve it (one full-attention KV-cache group only)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return None, f"{len(groups)} KV-cache groups (the staged path serves one)"
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        return None, f"a {type(spec).__name__} cache (the staged path serves full attention)"
    return PackedFormat.for_cache(len(groups[0].layer_names), spec.num_kv_heads,
                                  spec.head_size, spec.dtype), ""


def _check_slots(n_tok_slots: int) -> None:
    if n_tok_slots <= 0:
        raise ValueError(f"n_tok_slots must be positive, got {n_tok_slots}")


def packed_extent_view(extent: torch.Tensor, fmt: PackedFormat, n_tok_slots: int,
                       first_slot: int = 0) -> torch.Tensor:
    """View a contiguous window of an extent (any dtype, e.g. staging ``uint8``) as
    ``(n_tok_slots - first_slot, num_layers, 2, num_kv_heads, head_dim)`` in the
    format's dtype: token slots ``[first_slot, n_tok_slots)``.

    The window must be exactly :meth:`PackedFormat.window` long (the tag included; the
    view leaves it out): the whole extent when ``first_slot`` is 0. A size mismatch
    means the two sides disagree on ``n_tok_slots`` and is never papered over.
    """
    if not extent.is_contiguous():
        raise ValueError(f"packed extent must be contiguous, got strides {extent.stride()}")
    _, expected = fmt.window(n_tok_slots, first_slot)
    actual = extent.numel() * extent.element_size()
    if actual != expected:
        raise ValueError(
            f"packed extent holds {actual} bytes but token slots [{first_slot}, "
            f"{n_tok_slots}) of {fmt} need {expected}"
        )
    slots = n_tok_slots - first_slot
    return (
        extent.reshape(-1)
        .view(torch.uint8)[: expected - TAG_BYTES]
        .view(fmt.torch_dtype)
        .view(slots, fmt.num_layers, 2, fmt.num_kv_heads, fmt.head_dim)
    )
