"""The canonical packed format: sizes, offsets, wire form and compatibility checks."""

from __future__ import annotations

import json

import pytest
import torch

from kvcached_pd.transport.format import (
    FORMAT_VERSION,
    TAG_BYTES,
    PackedFormat,
    PackedFormatMismatch,
    packed_extent_view,
)

FMT = PackedFormat(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_sizes_and_offsets() -> None:
    per_token_one_layer = 2 * 8 * 128 * 2
    assert FMT.version == FORMAT_VERSION == 3
    assert FMT.bytes_per_token_all_layers == 4 * per_token_one_layer
    assert FMT.kv_bytes(48) == 48 * 4 * per_token_one_layer
    assert FMT.extent_bytes(48) == 48 * 4 * per_token_one_layer + TAG_BYTES == 786464
    assert [FMT.slot_offset(slot) for slot in (0, 1, 47)] == [
        slot * 4 * per_token_one_layer for slot in (0, 1, 47)
    ]
    # the window a decode side holding 16 tokens reads: the rest of the extent, tag too
    assert FMT.window(48, 16) == (FMT.slot_offset(16), FMT.extent_bytes(48) - FMT.slot_offset(16))
    assert FMT.window(48) == (0, FMT.extent_bytes(48))
    for bad in (-1, 48):
        with pytest.raises(ValueError, match="outside an extent of 48 token slots"):
            FMT.window(48, bad)
    with pytest.raises(ValueError):
        FMT.extent_bytes(0)


def test_extent_view_is_token_major_each_slot_every_layer_k_before_v() -> None:
    fmt = PackedFormat(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32")
    slots = 5
    extent = torch.zeros(fmt.extent_bytes(slots), dtype=torch.uint8)
    packed = packed_extent_view(extent, fmt, slots)
    assert packed.shape == (slots, 3, 2, 2, 4) and packed.dtype == torch.float32
    packed[3, 2, 1, 1, 2] = 1.0  # slot 3, layer 2, V, head 1, element 2
    flat = extent.view(torch.float32)
    slot_base = fmt.slot_offset(3) // 4
    layer_base = 2 * 2 * 2 * 4  # K and V of layers 0 and 1
    assert flat.nonzero().flatten().tolist() == [slot_base + layer_base + (1 * 2 + 1) * 4 + 2]
    # the window from slot 3 views the same element as its slot 0
    start, _ = fmt.window(slots, 3)
    assert packed_extent_view(extent[start:], fmt, slots, 3)[0, 2, 1, 1, 2] == 1.0


def test_extent_view_refuses_a_wrong_size_or_non_contiguous_extent() -> None:
    fmt = PackedFormat(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")
    with pytest.raises(ValueError, match=r"holds 64 bytes but token slots \[0, 4\) .* need 96"):
        packed_extent_view(torch.zeros(64, dtype=torch.uint8), fmt, 4)
    with pytest.raises(ValueError, match="contiguous"):
        packed_extent_view(torch.zeros(128, dtype=torch.uint8)[::2], fmt, 4)


def test_dict_round_trip_through_json() -> None:
    wire = json.loads(json.dumps(FMT.to_dict()))
    assert PackedFormat.from_dict(wire) == FMT
    assert PackedFormat.for_cache(4, 8, 128, torch.bfloat16) == FMT
    assert FMT.torch_dtype is torch.bfloat16


def test_from_dict_names_missing_fields_and_bad_values() -> None:
    wire = FMT.to_dict()
    del wire["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        PackedFormat.from_dict(wire)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'bfloat17'"):
        PackedFormat.from_dict({**FMT.to_dict(), "dtype": "bfloat17"})
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        PackedFormat.from_dict({**FMT.to_dict(), "num_layers": 0})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("version", 1, "version differs"),
        ("num_layers", 5, "num_layers differs"),
        ("num_kv_heads", 4, "TP head slicing not supported"),
        ("head_dim", 64, "head_dim differs"),
        ("dtype", "float8_e4m3fn", "dtype differs: bfloat16 here, float8_e4m3fn at the peer"),
    ],
)
def test_check_compatible_names_the_mismatching_field(field, value, message) -> None:
    other = PackedFormat.from_dict({**FMT.to_dict(), field: value})
    with pytest.raises(PackedFormatMismatch, match=message):
        FMT.check_compatible(other)
    FMT.check_compatible(PackedFormat.from_dict(FMT.to_dict()))
