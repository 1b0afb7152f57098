"""Per-request tokens: only the holder of a request's params reads its KV or frees it.

P's scheduler draws a random token for each request it stages (:func:`new_token`,
``TOKEN_BYTES`` = 16: 128 bits, never guessed) and hands it to D only inside that
request's :class:`~kvcached_pd.connector.wire.StagedParams`. P's worker has the pack
write the extent's tag (the last :data:`~kvcached_pd.transport.format.TAG_BYTES` of the
extent, after its KV)::

    tag = token (16 bytes) | extent size in bytes (u64 LE) | extent offset (u64 LE)

and wipes it (zeros) when P frees the extent, so a token is in P's staging exactly while
its extent is live. D reads the tag of the bytes it received (one device-to-host read
of 32 bytes) and unpacks them only when it equals what its params say
(:func:`check_tag`). Params that point at any bytes other than their own live extent
therefore fail: the tag at the end of the window read is another request's, a wiped
one, or KV; params naming a window that ends at the holder's own tag but starts
elsewhere carry another size. D may read only the extent's tail (its prefix cache holds
the first tokens; packed format 3 makes any token suffix and the tag one byte range):
it checks the tag against the size and offset of the whole extent its params name all
the same, and the tail starts at D's own cached tokens, inside that extent. D's DONE
carries the token too, and P frees an extent and its blocks only on a DONE whose token
is the request's (:class:`~kvcached_pd.connector.prefill.PrefillWorker`).
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import struct
from collections.abc import Sequence

import torch

from kvcached_pd.transport.format import TAG_BYTES

TOKEN_BYTES = 16
_PLACE = struct.Struct("<QQ")  # extent size, extent offset


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def tag_bytes(token: bytes, offset: int, nbytes: int) -> bytes:
    """The tag P writes at the end of the extent ``[offset, offset + nbytes)``."""
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a request token is {TOKEN_BYTES} bytes, got {len(token)}")
    return token + _PLACE.pack(nbytes, offset)


def tag_view(extent: torch.Tensor) -> torch.Tensor:
    """The tag region of an extent (its last ``TAG_BYTES`` bytes, as uint8)."""
    flat = extent.reshape(-1).view(torch.uint8)
    return flat[flat.numel() - TAG_BYTES:]


def wipe_tag(extent: torch.Tensor) -> None:
    """Zero the tag of a freed extent: its token no longer opens any bytes."""
    tag_view(extent).zero_()


def read_tag(extent: torch.Tensor, stream: object | None = None) -> bytes:
    """The tag of an extent as received: one device-to-host read of ``TAG_BYTES``.

    ``stream``: the CUDA stream to read on (the caller makes it see the extent's bytes:
    a completed NIXL READ is visible to every stream). A side stream keeps the read
    from waiting for the compute stream's queued forward; None reads on the current
    stream."""
    src = tag_view(extent)
    if src.is_cuda and stream is not None:
        with torch.cuda.stream(stream):
            return bytes(src.cpu().numpy().tobytes())
    return bytes(src.cpu().numpy().tobytes())


def read_tags(extents: Sequence[torch.Tensor], stream: object | None = None) -> list[bytes]:
    """The tags of several extents (:func:`read_tag` each) with ONE device-to-host read:
    the tags are gathered into one tensor (one ``cat`` kernel, on ``stream``), read
    back once, and split. D checks the extents that completed in one engine step this
    way: each separate read is a synchronous 32-byte copy (a stream synchronization and
    a pageable copy on the host), and in the kvbig batch of 8 x 3000-token prompts on
    the H100, 4 extents completed in one step, their ``read_done`` 0.45 ms apart (tag
    read, unpack call and trace line each). Extents on different devices are read one
    by one."""
    if len(extents) <= 1 or any(e.device != extents[0].device for e in extents):
        return [read_tag(extent, stream) for extent in extents]
    scope = (torch.cuda.stream(stream) if extents[0].is_cuda and stream is not None
             else contextlib.nullcontext())
    with scope:
        raw = bytes(torch.cat([tag_view(extent) for extent in extents]).cpu().numpy().tobytes())
    return [raw[i * TAG_BYTES:(i + 1) * TAG_BYTES] for i in range(len(extents))]


def check_tag(tag: bytes, token_hex: str, offset: int, nbytes: int) -> str | None:
    """None when ``tag`` is the one P wrote for this request's extent, else why not
    (the token never appears in the reason)."""
    try:
        token = bytes.fromhex(token_hex)
    except ValueError:
        return "its params carry no valid token"
    if len(tag) != TAG_BYTES or len(token) != TOKEN_BYTES:
        return "its params carry no valid token"
    if not hmac.compare_digest(tag[:TOKEN_BYTES], token):
        return ("the extent read carries another request's token (or none): the params "
                "do not belong to the bytes they point at")
    size, place = _PLACE.unpack(tag[TOKEN_BYTES:])
    if (size, place) != (nbytes, offset):
        return (f"the extent read was tagged for {size} bytes at offset {place}, the params "
                f"say {nbytes} at {offset}")
    return None


def extent_check(window: torch.Tensor, token_hex: str, offset: int, nbytes: int,
                 stream: object | None = None) -> str | None:
    """Read the tag at the end of ``window`` (the bytes received of P's extent
    ``[offset, offset + nbytes)``: its tail from the first token D lacks, tag included,
    or all of it) and check it (:func:`check_tag`) against the whole extent's place:
    the one call D makes before it unpacks, whatever the bytes were read from. A window
    that ends at the request's own tag lies inside its extent, wherever it starts."""
    return check_tag(read_tag(window, stream), token_hex, offset, nbytes)
