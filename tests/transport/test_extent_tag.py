"""The extent's tag: written by the pack after the KV, read back and checked by D.

On the CPU here; on a GPU too when one is present (the tag goes from pinned memory
without a host wait, and is read on a side stream).
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd.connector.tokens import (
    extent_check,
    new_token,
    read_tag,
    read_tags,
    tag_bytes,
    wipe_tag,
)
from kvcached_pd.transport.format import TAG_BYTES, PackedFormat
from kvcached_pd.transport.layout import KVCacheLayers
from kvcached_pd.transport.pack import pack_request, pack_request_reference, unpack_request

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_tag_follows_the_kv_and_is_checked_against_the_params(device):
    fmt = PackedFormat.for_cache(2, 2, 4, torch.bfloat16)
    caches = [torch.randn(2, 6, 8, 2, 4, generator=torch.Generator().manual_seed(layer))
              .to(torch.bfloat16).to(device) for layer in range(2)]
    layers = KVCacheLayers.from_views(caches)
    ids, slots = [4, 1], 16
    token, offset = new_token(), 8192
    extent = torch.full((fmt.extent_bytes(slots),), 0xA5, dtype=torch.uint8, device=device)
    pack_request(layers, ids, extent, fmt, tag_bytes(token, offset, extent.numel()))
    reference = pack_request_reference(caches, ids, fmt)
    kv = fmt.kv_bytes(slots)
    assert torch.equal(extent[:kv], reference[:kv])  # the tag leaves the KV alone
    assert torch.equal(reference[kv:].cpu(), torch.zeros(TAG_BYTES, dtype=torch.uint8))
    stream = torch.cuda.Stream() if device == "cuda" else None
    assert read_tag(extent, stream) == token + extent.numel().to_bytes(8, "little") \
        + offset.to_bytes(8, "little")
    n = extent.numel()
    assert extent_check(extent, token.hex(), offset, n, stream) is None
    assert "another request's token" in extent_check(extent, new_token().hex(), offset, n,
                                                     stream)
    assert "at offset 8192" in extent_check(extent, token.hex(), 0, n, stream)
    # a prefix hit reads the tail from its first missing token: the same tag, checked
    # against the whole extent's place (a tail is never taken for a smaller extent)
    tail = extent[fmt.window(slots, 8)[0]:]
    assert extent_check(tail, token.hex(), offset, n, stream) is None
    assert "tagged for" in extent_check(tail, token.hex(), offset, tail.numel(), stream)
    # the unpack reads the KV only: the tag never lands in a block
    out = [torch.zeros_like(c) for c in caches]
    unpack_request(KVCacheLayers.from_views(out), [0, 2], extent, fmt, 16, slots)
    for got, cache in zip(out, caches):
        assert torch.equal(got[:, [0, 2]], cache[:, ids])
    wipe_tag(extent)
    assert read_tag(extent, stream) == bytes(TAG_BYTES)
    assert "another request's token" in extent_check(extent, token.hex(), offset, n, stream)


@pytest.mark.parametrize("device", DEVICES)
def test_tags_of_several_extents_are_read_at_once_each_its_own(device):
    """D reads the tags of the loads that completed in one step with one read
    (``read_tags``): each comes back as its own extent's, in order, whatever their
    sizes and places in the staging."""
    staging = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    places = [(4096, 8192), (0, 2048), (20480, 4096 + 64)]
    tokens = [new_token() for _ in places]
    extents = []
    for (offset, nbytes), token in zip(places, tokens):
        extent = staging[offset: offset + nbytes]
        extent[-TAG_BYTES:].copy_(torch.frombuffer(bytearray(tag_bytes(token, offset, nbytes)),
                                                   dtype=torch.uint8))
        extents.append(extent)
    stream = torch.cuda.Stream() if device == "cuda" else None
    assert read_tags(extents, stream) == [read_tag(extent, stream) for extent in extents]
    assert [tag[:16] for tag in read_tags(extents, stream)] == tokens
    assert read_tags(extents[:1], stream) == [read_tag(extents[0], stream)]
    assert read_tags([], stream) == []
