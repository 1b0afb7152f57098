"""Hostile clients and agents against the staged transport, on the CPU harness.

Real vLLM schedulers and the connector over real NIXL agents (UCX, host memory), as in
``test_connector_pd``. A client writes D's ``kv_transfer_params`` as it likes; any
process that fetched P's handshake can load P's agent metadata and send P's staging
agent notifications. Neither may take an engine down, move one request's KV into
another's output, or free another request's extent or blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import types

import pytest
import torch

from kvcached_pd.connector.wire import PARAMS_KEY
from tests.support import connector_pd as pd
from tests.test_connector_ipc_wire import ipc  # noqa: F401 (fixture)
from tests.test_connector_pd import loaded, saw_done, staged_env  # noqa: F401 (fixture)

PROMPT = list(range(1, 41))
OTHER = list(range(101, 141))  # as long, other tokens (other blocks, other KV on P)


def prefill(p, req_id, prompt):
    p.sched.add_request(pd.prefill_request(req_id, prompt))
    assert pd.run([p], lambda: req_id in p.outputs)
    params = p.outputs[req_id].kv_transfer_params
    assert PARAMS_KEY in params
    ids = params["remote_block_ids"]
    return params, list(ids[0] if isinstance(ids[0], list) else ids)


def decode(p, d, d_id, prompt, params):
    """Run D's request to its end; D's blocks as they were once loaded (None when its
    load failed before), and whether vLLM was told its load failed."""
    failures = []
    real = d.worker.get_block_ids_with_load_errors

    def load_errors():
        blocks = real()
        failures.extend(blocks)
        return blocks

    d.worker.get_block_ids_with_load_errors = load_errors
    d.sched.add_request(pd.decode_request(d_id, prompt, params))
    seen = {}

    def finished():
        if "blocks" not in seen and loaded(d, d_id) and not failures:
            seen["blocks"] = d.blocks_of(d_id)
        return d_id in d.outputs and d.outputs[d_id].finished
    try:
        assert pd.run([p, d], finished, timeout_s=30), f"{d_id} never finished"
    finally:
        d.worker.get_block_ids_with_load_errors = real
    return seen.get("blocks"), bool(failures)


def same_kv(p, p_blocks, d, d_blocks, n=len(PROMPT)) -> bool:
    return all(bool(torch.equal(a, b))
               for a, b in zip(p.tokens(p_blocks, n), d.tokens(d_blocks, n)))


def staged_loads(d) -> int:
    """Extents D unpacked so far (one handoff sample each)."""
    return len(d.series("kvcached_pd_handoff_duration"))


def forged(params, **fields):
    out = copy.deepcopy(params)
    out[PARAMS_KEY].update(fields)
    return out


FORGED_FIELDS = [("offset", float("inf"), "offset=inf is not an integer"),
                 ("nbytes", 0, "must be positive"),
                 ("num_tokens", len(PROMPT) + 16, "fill 64 slots, not 48")]


def test_a_forged_params_field_costs_only_its_request_the_staged_path(staged_env):
    """Each forged field (offset=Infinity, nbytes=0, num_tokens beyond the prompt) is
    refused by D's scheduler (logged once per P and reason) and that request takes
    vLLM's own path, which reads P's blocks: its KV is still exact. Both engines serve
    the next request through the staged path, byte for byte."""
    p = pd.make_engine("p", "kv_producer", seed=31)
    d = pd.make_engine("d", "kv_consumer", seed=32)
    for field, value, reason in FORGED_FIELDS:
        params, p_blocks = prefill(p, f"f-{field}", PROMPT)
        d_blocks, failed = decode(p, d, f"d-f-{field}", PROMPT,
                                  forged(params, **{field: value}))
        assert not failed and same_kv(p, p_blocks, d, d_blocks), field
        assert reason in d.connector._decode.refused_peers[params["remote_engine_id"]]
    assert not staged_loads(d)
    params, p_blocks = prefill(p, "f2", OTHER)
    d_blocks, failed = decode(p, d, "d-f2", OTHER, params)
    assert not failed and same_kv(p, p_blocks, d, d_blocks)
    assert staged_loads(d) == 1
    assert saw_done(p, d, "f2")


def test_another_requests_offset_reads_nothing_and_frees_nothing(staged_env, caplog):
    """A client copies its own params and points them at another request's extent
    (its offset; then its offset and its request id, for the DONE): the tag of the
    bytes read is the victim's, not the attacker's token, so D fails the attacker's
    load without unpacking them; the DONE its READ carries holds the attacker's token,
    so P frees neither the victim's extent nor its blocks, and the victim's own decode
    then receives its exact KV."""
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=33)
    d = pd.make_engine("d", "kv_consumer", seed=34)
    victim, victim_blocks = prefill(p, "victim", PROMPT)
    for n, fields in enumerate([("offset",), ("offset", "request_id")]):
        mine, _ = prefill(p, f"attacker{n}", OTHER)
        theft = forged(mine, **{f: victim[PARAMS_KEY][f] for f in fields})
        assert theft[PARAMS_KEY]["offset"] != mine[PARAMS_KEY]["offset"]
        d_blocks, failed = decode(p, d, f"d-attacker{n}", OTHER, theft)
        assert failed and d_blocks is None, f"D unpacked another request's extent ({fields})"
        assert "another request's token" in caplog.text
        assert not staged_loads(d)
        pd.run([p, d], lambda: False, timeout_s=1)  # the attacker's DONE reaches P
        assert "victim" in p.connector._prefill.staged, f"P freed the victim's extent ({fields})"
        assert "victim" in p.sched.requests, f"P freed the victim's blocks ({fields})"
    d_blocks, failed = decode(p, d, "d-victim", PROMPT, victim)
    assert not failed and same_kv(p, victim_blocks, d, d_blocks)
    assert saw_done(p, d, "victim")


def test_forged_notifications_neither_stop_p_nor_free_anything(staged_env, caplog):
    """Any agent that loaded P's metadata may notify P's staging agent: malformed
    DONEs (a non-ASCII digit, bad UTF-8, an oversized one), a well-formed DONE with the
    wrong token, or one in the token-less form of older wires. P keeps serving, frees
    neither the request's extent nor its blocks, and the real D's DONE frees both."""
    from nixl._api import nixl_agent, nixl_agent_config

    caplog.set_level(logging.WARNING, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=35)
    d = pd.make_engine("d", "kv_consumer", seed=36)
    params, p_blocks = prefill(p, "n1", PROMPT)
    rogue = nixl_agent("rogue", nixl_agent_config(backends=["UCX"]))
    peer = rogue.add_remote_agent(p.worker._region.agent.metadata())
    token = params[PARAMS_KEY].get("token", "ab" * 16)
    wrong = format(int(token, 16) ^ 1, "032x")
    for message in (b"KVPD1:D:n1:\xc2\xb2", b"KVPD1:D:n1:0", b"KVPD3:D:n1:\xc2\xb2:" +
                    token.encode(), b"KVPD3:D:\xff\xfe:0:" + token.encode(),
                    b"KVPD3:D:" + b"n" * 9000 + b":0:" + token.encode(),
                    b"KVPD3:D:n1:0:" + wrong.encode(), b"\x00" * 64):
        rogue.send_notif(peer, message)
    assert pd.run([p, d], lambda: "ignored" in caplog.text, timeout_s=10), \
        "P's staging agent never saw the forged notifications"
    del rogue  # its UCX progress thread would poll on for the rest of the process
    pd.run([p, d], lambda: False, timeout_s=1)
    assert "n1" in p.connector._prefill.staged and "n1" in p.sched.requests
    assert not p.done_seen
    d_blocks, failed = decode(p, d, "d-n1", PROMPT, params)
    assert not failed and same_kv(p, p_blocks, d, d_blocks)
    assert saw_done(p, d, "n1")
    assert pd.run([p, d], lambda: "n1" not in p.connector._prefill.staged, timeout_s=5)


def test_the_corruption_control_still_yields_wrong_kv_not_a_refused_load(staged_env):
    """The equivalence harness's negative control (``KVCACHED_PD_TEST_CORRUPT``)
    inverts a staged extent's KV after its READ: the load must still succeed, with
    every byte of the KV inverted, or the harness would see a failed request instead
    of the wrong text it must detect."""
    from kvcached_pd.testing.corrupt_received_kv import CorruptReceivedKVPatch

    patch = CorruptReceivedKVPatch()
    assert patch.patch()
    try:
        p = pd.make_engine("p", "kv_producer", seed=37)
        d = pd.make_engine("d", "kv_consumer", seed=38)
        params, p_blocks = prefill(p, "c1", PROMPT)
        d_blocks, failed = decode(p, d, "d-c1", PROMPT, params)
    finally:
        patch.unpatch()
    assert not failed and d_blocks is not None
    for want, got in zip(p.tokens(p_blocks, len(PROMPT)), d.tokens(d_blocks, len(PROMPT))):
        assert torch.equal(got.view(torch.int16), ~want.view(torch.int16))


def test_a_freed_extents_params_open_nothing_when_a_later_request_lies_in_its_bytes(
        staged_env, caplog):
    """Replayed params of a request whose extent P freed, once a later, shorter request
    was packed into the start of those bytes (its own tag lies before the old one): P
    wiped the old tag when it freed the extent, so D's check fails and the later
    request's KV is never unpacked into the replaying request."""
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=39)
    d = pd.make_engine("d", "kv_consumer", seed=40)
    long_prompt = list(range(1, 81))
    old, _ = prefill(p, "old", long_prompt)
    d_blocks, failed = decode(p, d, "d-old", long_prompt, old)
    assert not failed and d_blocks is not None
    assert pd.run([p, d], lambda: "old" not in p.connector._prefill.staged, timeout_s=10)
    later, _ = prefill(p, "later", list(range(201, 221)))
    assert later[PARAMS_KEY]["offset"] == old[PARAMS_KEY]["offset"]
    assert later[PARAMS_KEY]["nbytes"] < old[PARAMS_KEY]["nbytes"]
    d_blocks, failed = decode(p, d, "d-replay", long_prompt, old)
    assert failed and d_blocks is None, "D unpacked a later request's KV"
    assert "another request's token (or none)" in caplog.text


def test_an_extent_outside_ps_staging_is_never_read(staged_env, caplog):
    """Params whose extent runs past the staging P advertised in its handshake (a READ
    there would read whatever P's memory holds, if the transport let it): D fails the
    request's load before posting any READ, and serves the next request."""
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=41)
    d = pd.make_engine("d", "kv_consumer", seed=42)
    params, _ = prefill(p, "o1", PROMPT)
    staging = p.worker._region.agent.nbytes
    beyond = forged(params, offset=staging - params[PARAMS_KEY]["nbytes"] + 4096)
    d_blocks, failed = decode(p, d, "d-o1", PROMPT, beyond)
    assert failed and d_blocks is None
    assert f"outside the {staging} bytes of staging" in caplog.text
    params, p_blocks = prefill(p, "o2", OTHER)
    d_blocks, failed = decode(p, d, "d-o2", OTHER, params)
    assert not failed and same_kv(p, p_blocks, d, d_blocks)


@pytest.mark.parametrize("port", [float("inf"), float("nan"), 1 << 70, 65000, "5600", True],
                         ids=["inf", "nan", "huge", "claim-port-past-65535", "string", "bool"])
def test_a_push_decode_leg_with_a_forged_remote_port_is_left_to_vllm(port):
    """Push mode, a decode leg sent before P answered: D claims its params from P's
    listener at vLLM's ``remote_port`` + 1000. A port no listener can have (vLLM's JSON
    reads ``Infinity``) leaves the request to vLLM's push, refused once per P; nothing
    raises in vLLM's scheduler hook."""
    from kvcached_pd.connector.decode_scheduler import DecodeScheduler

    fmt = pd_format()
    decode = DecodeScheduler(digest="0" * 16, block_size=16, capacity_bytes=4 << 20,
                             tp_size=1, push=True, fmt=fmt)
    request = pd.decode_request("leg", PROMPT, {
        "do_remote_prefill": True, "remote_engine_id": "p-1", "remote_host": "127.0.0.1",
        "remote_port": port})
    assert decode.match(request, 0) is None
    assert "no valid remote_host/remote_port" in decode.refused_peers["p-1"]


def pd_format():
    from kvcached_pd.transport.format import PackedFormat

    return PackedFormat.for_cache(pd.LAYERS, pd.HEADS, pd.HEAD_DIM, torch.float16)


CLAIM_CHANGES = [{"offset": float("inf")}, {"lease_s": float("nan")}, {"age_s": float("inf")},
                 {"age_s": float("nan")}, {"age_s": -1.0}]


def claiming_decode(seed: int):
    """A staged D worker, the params a claim for request "r" of P "p-1" answers with,
    and the order D queued for it (push mode: D has no params until P answers)."""
    from kvcached_pd.connector.records import ClaimTarget, RecvOrder
    from kvcached_pd.connector.wire import WIRE_VERSION, StagedParams

    worker = pd.make_engine("d", "kv_consumer", seed=seed).worker._decode_worker
    fmt = worker.region.fmt
    params = StagedParams(
        wire_version=WIRE_VERSION, engine_id="p-1", request_id="r", host="127.0.0.1",
        port=5600, tp_size=1, offset=0, nbytes=fmt.extent_bytes(48), n_tok_slots=48,
        num_tokens=len(PROMPT), block_size=16, lease_s=30.0,
        format_digest=worker.region.digest, token="ab" * 16).to_params()
    order = RecvOrder(params=None, block_ids=(0, 1, 2), first_token=0,
                      num_tokens=len(PROMPT), deadline=0.0,
                      claim=ClaimTarget("127.0.0.1", 6600, "p-1", "r"))
    return worker, params, order


def take_claim(worker, order, reply):
    """Hand D's worker P's ``reply`` to its claim of a queued request, through the
    worker's own path (``_take_claims``); (the read, the reason its load failed or
    None). The handshake a good reply starts is not made (no P listens)."""
    from kvcached_pd.connector.decode_worker import _Read

    read, reasons = _Read(order), []
    worker.queued["d-r"] = read
    worker._claims = types.SimpleNamespace(take=lambda: {"d-r": reply})
    worker._fail = lambda req_id, read, reason, after=None: reasons.append(reason)
    worker._peer = lambda params: None
    worker._take_claims()
    assert (reasons == []) == (read.params is not None) == ("d-r" in worker.queued)
    worker.queued.pop("d-r", None)
    return read, (reasons[0] if reasons else None)


def test_a_claim_reply_carrying_non_finite_numbers_fails_only_that_load(staged_env):
    """P's listener answers a claim with the request's params and their age; a listener
    the request pointed D at may answer anything. Non-finite or negative numbers
    (offset, lease, age) fail that request's load with the reason; nothing raises in
    D's worker."""
    from kvcached_pd.connector.wire import ClaimReply

    worker, params, order = claiming_decode(43)
    good = ClaimReply("r", "ready", params=params, age_s=0.5)
    assert take_claim(worker, order, good)[1] is None  # the unchanged reply
    for change in CLAIM_CHANGES:
        forged_params = {**params, **{k: v for k, v in change.items() if k != "age_s"}}
        bad = ClaimReply("r", "ready", params=forged_params, age_s=change.get("age_s", 0.5))
        reason = take_claim(worker, order, bad)[1]
        assert reason and "p-1" in reason, change
    assert "claim from p-1: refused" in take_claim(worker, order, ConnectionError("refused"))[1]


def test_a_claim_answered_with_a_tiny_negative_age_is_read_as_zero(staged_env):
    """P's listener could read its clock just before P published the request, and
    answered a few microseconds' negative age (on an H100, 19 of 64 push requests of
    one run failed their load on it). D reads an age within CLAIM_AGE_SLACK_S below 0
    as 0 (its READ deadline is then half the lease from now); one further below still
    fails that load."""
    from kvcached_pd.connector.decode_scheduler import CLAIM_AGE_SLACK_S
    from kvcached_pd.connector.wire import ClaimReply

    worker, params, order = claiming_decode(44)
    before = time.monotonic()
    read, reason = take_claim(worker, order, ClaimReply("r", "ready", params=params,
                                                        age_s=-3e-5))
    assert reason is None
    assert before + 15.0 <= read.deadline <= time.monotonic() + 15.0
    too_far = ClaimReply("r", "ready", params=params, age_s=-2 * CLAIM_AGE_SLACK_S)
    assert "invalid age" in take_claim(worker, order, too_far)[1]


# ---- claim replies: what any listener a request names may answer ---------------------
def _claim_reply_cases():
    from hypothesis import strategies as st

    anything = st.one_of(st.none(), st.booleans(), st.integers(),
                         st.integers(min_value=1, max_value=1 << 40),  # sizes, offsets
                         st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=40), st.binary(max_size=40),
                         st.lists(st.integers(), max_size=3),
                         st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))
    fields = st.sampled_from(["wire_version", "engine_id", "request_id", "host", "port",
                              "tp_size", "offset", "nbytes", "n_tok_slots", "num_tokens",
                              "block_size", "lease_s", "format_digest", "token",
                              "frees_on_done", "pack_event", "unknown"])
    return (st.sampled_from(["ready", "gone"]),
            st.dictionaries(fields, anything, max_size=4), st.booleans(), anything)


def test_any_claim_reply_is_checked_params_or_a_wire_error():
    """D's scheduler and its worker read a claim reply with one function
    (``read_claim_reply``); the listener is the request's choice. Whatever it answers
    (any field of the params replaced by anything, the params replaced wholesale, any
    age), the answer is params that passed every check, with a finite age of at least
    0, or a WireError for that request: nothing else escapes into D's engine."""
    import math

    from hypothesis import HealthCheck, example, given, settings

    from kvcached_pd.connector.decode_scheduler import read_claim_reply
    from kvcached_pd.connector.records import ClaimTarget
    from kvcached_pd.connector.wire import (MAX_LEASE_S, WIRE_VERSION, ClaimReply,
                                            StagedParams, WireError)

    digest, capacity, num_tokens = "f" * 64, 64 << 20, len(PROMPT)
    valid = StagedParams(
        wire_version=WIRE_VERSION, engine_id="p-1", request_id="r", host="127.0.0.1",
        port=5600, tp_size=1, offset=0, nbytes=1 << 20, n_tok_slots=48,
        num_tokens=num_tokens, block_size=16, lease_s=30.0, format_digest=digest,
        token="ab" * 16).to_params()
    target = ClaimTarget("127.0.0.1", 6600, "p-1", "r")
    checked = read_claim_reply(target, ClaimReply("r", "ready", params=valid, age_s=0.5),
                               digest, capacity, num_tokens)
    assert checked[0].to_params() == valid and checked[1] == 0.5  # the baseline passes

    status_s, changes_s, wholesale_s, age_s = _claim_reply_cases()

    @settings(max_examples=400, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(status=status_s, changes=changes_s, wholesale=wholesale_s, age=age_s)
    @example(status="ready", changes={"nbytes": capacity + 1}, wholesale=False, age=0.5)
    @example(status="ready", changes={"engine_id": "p-2"}, wholesale=False, age=0.5)
    @example(status="ready", changes={"num_tokens": num_tokens + 1}, wholesale=False, age=0.5)
    @example(status="ready", changes={"format_digest": "e" * 64}, wholesale=False, age=0.5)
    @example(status="ready", changes={}, wholesale=False, age=float("nan"))
    @example(status="ready", changes={"request_id": "r2"}, wholesale=False, age=0.5)
    def check(status, changes, wholesale, age):
        params = changes if wholesale else {**valid, **changes}
        reply = ClaimReply("r", status, params=params, age_s=age, reason="released")
        try:
            got, age_read = read_claim_reply(target, reply, digest, capacity, num_tokens)
        except WireError:
            return
        assert status == "ready"
        assert isinstance(age_read, float) and math.isfinite(age_read)
        assert 0.0 <= age_read <= MAX_LEASE_S
        assert got.engine_id == "p-1" and got.format_digest == digest
        assert got.num_tokens == num_tokens and 0 < got.nbytes <= capacity
        # another request's params (its tag is its own: the tag check would pass)
        assert got.request_id == "r"

    check()


@pytest.mark.parametrize("wire", ["nixl", "ipc"])
@pytest.mark.parametrize("forged, error", [
    ({"agent_name": "kvcached-pd-someone-else"}, "its metadata loads"),
    ({"notify_metadata": b"not a NIXL agent"}, "no handshake with prefill"),
], ids=["another-agent-name", "garbage-notify-metadata"])
def test_a_handshake_whose_agent_cannot_be_loaded_as_named_fails_only_its_loads(
        staged_env, ipc, caplog, monkeypatch, wire, forged, error):
    """D names P's agent by the handshake's ``agent_name`` (it picks the wire before
    loading the agent, so that an IPC peer is loaded without its memory, from the
    handshake's ``notify_metadata``). A handshake whose metadata loads another agent
    would aim D's READs and DONEs at that agent; metadata NIXL cannot read raises. Either
    way the handshake is refused, that P's requests fail their loads, D serves on. The
    garbage ``notify_metadata`` is loaded only on the IPC wire: on the NIXL wire D loads
    the whole agent and serves."""
    from kvcached_pd.connector import region as region_mod

    monkeypatch.setenv("KVCACHED_PD_WIRE", wire)
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    real = region_mod.StagingRegion.handshake

    def lying(self, engine_id):
        return dataclasses.replace(real(self, engine_id), **forged)
    monkeypatch.setattr(region_mod.StagingRegion, "handshake", lying)
    p = pd.make_engine("p", "kv_producer", seed=61)
    d = pd.make_engine("d", "kv_consumer", seed=62)
    params, p_blocks = prefill(p, "a1", PROMPT)
    d_blocks, failed = decode(p, d, "d-a1", PROMPT, params)
    if wire == "nixl" and "notify_metadata" in forged:
        assert not failed and same_kv(p, p_blocks, d, d_blocks)
        return
    assert failed and d_blocks is None
    assert error in caplog.text
    monkeypatch.setattr(region_mod.StagingRegion, "handshake", real)
    p2 = pd.make_engine("p2", "kv_producer", seed=63)
    params, p_blocks = prefill(p2, "a2", OTHER)
    d_blocks, failed = decode(p2, d, "d-a2", OTHER, params)
    assert not failed and same_kv(p2, p_blocks, d, d_blocks)
