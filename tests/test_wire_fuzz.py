"""Fuzzing what a client or any NIXL agent can send the staged transport.

``kv_transfer_params`` are the client's to write (vLLM's JSON reads ``Infinity`` and
``NaN``), and any agent that loaded P's metadata can send P's staging agent a
notification. Whatever they hold, :meth:`StagedParams.from_params` and
:meth:`Done.decode` answer with a value or :class:`WireError`, nothing else, and what
they accept satisfies every bound D relies on. Sized for CI: about 4,000 cases in a
few seconds per vLLM release.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached_pd.connector.tokens import TOKEN_BYTES, check_tag, tag_bytes
from kvcached_pd.connector.wire import (
    MAX_ID_BYTES,
    MAX_LEASE_S,
    MAX_WIRE_INT,
    PARAMS_KEY,
    WIRE_VERSION,
    Done,
    StagedParams,
    WireError,
)

VALID = StagedParams(
    wire_version=WIRE_VERSION, engine_id="p-1", request_id="r-1", host="127.0.0.1",
    port=5600, tp_size=1, offset=4096, nbytes=24608, n_tok_slots=16, num_tokens=10,
    block_size=16, lease_s=30.0, format_digest="0123456789abcdef", token="ab" * 16,
    frees_on_done=True).to_params()

SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
           | st.binary(max_size=16)
           | st.sampled_from([float("inf"), float("-inf"), float("nan"), 2**48, 2**48 + 1,
                              -1, 0, 65536, "\ud800", "AB" * 16, "ab" * 16, 1e300]))
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                       max_leaves=12)

FUZZ = settings(max_examples=600, deadline=None, database=None)


def _parse(params):
    try:
        return StagedParams.from_params(params)
    except WireError:
        return "refused"


def _holds_every_bound(staged: StagedParams) -> None:
    for name in ("wire_version", "port", "tp_size", "offset", "nbytes", "n_tok_slots",
                 "num_tokens", "block_size"):
        value = getattr(staged, name)
        assert type(value) is int and abs(value) <= MAX_WIRE_INT, (name, value)
    assert 1 <= staged.port <= 65535 and staged.offset >= 0 and staged.nbytes >= 1
    assert staged.offset + staged.nbytes <= MAX_WIRE_INT
    assert 1 <= staged.num_tokens <= staged.n_tok_slots
    assert staged.n_tok_slots == math.ceil(staged.num_tokens / staged.block_size) \
        * staged.block_size
    assert math.isfinite(staged.lease_s) and 0 < staged.lease_s <= MAX_LEASE_S
    for name in ("engine_id", "request_id", "host", "format_digest", "token"):
        assert 0 < len(getattr(staged, name).encode("utf-8")) <= MAX_ID_BYTES
    assert type(staged.frees_on_done) is bool
    # what D then does with them cannot raise either: its DONE encodes and decodes back
    done = Done(staged.request_id, 0, staged.token)
    assert Done.decode(done.encode()) == done


def test_the_valid_params_parse():
    staged = StagedParams.from_params({PARAMS_KEY: VALID})
    assert staged.to_params() == VALID
    _holds_every_bound(staged)


@FUZZ
@given(field=st.sampled_from(sorted(VALID)), value=JSONISH)
def test_one_forged_field_is_refused_or_within_bounds(field, value):
    result = _parse({PARAMS_KEY: {**VALID, field: value}})
    if result != "refused":
        _holds_every_bound(result)


@settings(max_examples=500, deadline=None, database=None)
@given(params=JSONISH, inner=JSONISH)
def test_arbitrary_params_are_refused_or_within_bounds(params, inner):
    for candidate in (params, {PARAMS_KEY: inner}, {PARAMS_KEY: params}):
        result = _parse(candidate)
        if result not in (None, "refused"):
            _holds_every_bound(result)


@FUZZ
@given(message=st.binary(max_size=80) | st.builds(
    lambda body: b"KVPD3:D:" + body, st.binary(max_size=80)) | st.builds(
    lambda rid, rank, token: b"KVPD3:D:" + rid + b":" + rank + b":" + token,
    st.binary(max_size=12), st.sampled_from([b"0", b"\xc2\xb2", b"\xd9\xa3", b"1" * 5000,
                                             b"-1", b" 1", b"1\n", b"99999"]),
    st.sampled_from([b"ab" * 16, b"AB" * 16, b"ab" * 15, b"ab" * 16 + b"\n", b""])))
def test_any_notification_is_a_done_none_or_refused(message):
    try:
        record = Done.decode(message)
    except WireError:
        return
    if record is not None:
        assert record.rank >= 0 and len(record.token) == 32
        assert Done.decode(record.encode()) == record


@settings(max_examples=300, deadline=None, database=None)
@given(request_id=st.text(min_size=1, max_size=60).filter(
    lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)),
    rank=st.integers(0, 99999), token=st.binary(min_size=16, max_size=16))
def test_every_done_d_sends_is_read_back_as_sent(request_id, rank, token):
    done = Done(request_id, rank, token.hex())
    assert Done.decode(done.encode()) == done


def test_an_oversized_done_is_refused_without_decoding_it():
    message = b"KVPD3:D:" + b"x" * (MAX_ID_BYTES + 100) + b":0:" + b"ab" * 16
    try:
        Done.decode(message)
    except WireError as exc:
        assert "longer than any request id" in str(exc)
    else:
        raise AssertionError("an oversized DONE was accepted")


@settings(max_examples=500, deadline=None, database=None)
@given(tag=st.binary(max_size=40), token=st.text(max_size=40),
       offset=st.integers(0, 2**48), nbytes=st.integers(1, 2**48))
def test_a_tag_check_answers_for_any_bytes(tag, token, offset, nbytes):
    reason = check_tag(tag, token, offset, nbytes)
    assert reason is None or isinstance(reason, str)
    if reason is None:  # only the very tag P writes for these params passes
        assert tag == tag_bytes(bytes.fromhex(token), offset, nbytes)


def test_a_tag_check_accepts_only_its_own_extent():
    token = bytes(range(TOKEN_BYTES))
    tag = tag_bytes(token, 4096, 24608)
    assert check_tag(tag, token.hex(), 4096, 24608) is None
    assert "another request's token" in check_tag(tag, ("ff" * 16), 4096, 24608)
    assert "tagged for 24608 bytes at offset 4096" in check_tag(tag, token.hex(), 0, 28704)
    assert "no valid token" in check_tag(tag, "zz", 4096, 24608)
