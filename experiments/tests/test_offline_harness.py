"""Offline tests of the experiment harness (proxy, client, equivalence, log/metric parsing)
against fake_vllm.py: no GPU, no vLLM needed.

run: python -m pytest experiments/tests -q
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
EXP = os.path.dirname(HERE)
sys.path.insert(0, EXP)

import pd_client  # noqa: E402
import pd_common  # noqa: E402
import pd_proxy  # noqa: E402
import pd_servers  # noqa: E402

FAKE = [sys.executable, os.path.join(HERE, "fake_vllm.py")]
_ports = pd_servers.PortAllocator(11000)  # below the ephemeral range: see PortAllocator


def _start_fake(tmp_path, name, kv_role=None, env_extra=None, engine_id=None):
    port, side = _ports.take(), _ports.take()
    args = ["fake-model", "--port", str(port)]
    if kv_role:
        args += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": kv_role,
             "engine_id": engine_id or name})]
    env = dict(os.environ, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side), FAKE_VLLM_START_DELAY="0.1",
               **(env_extra or {}))
    proc = pd_servers.ManagedProcess(name, FAKE + args, env, str(tmp_path / f"{name}.log"),
                                     f"http://127.0.0.1:{port}/health")
    proc.start()
    proc.side_port = side
    return proc


@pytest.fixture
def pd_pair(tmp_path):
    procs = []

    def make(p_env=None, d_env=None):
        p = _start_fake(tmp_path, "P", "kv_producer", p_env, engine_id="engine-P")
        d = _start_fake(tmp_path, "D", "kv_consumer", d_env)
        procs.extend([p, d])
        pd_servers.wait_until_ready([p, d], 20, poll_s=0.1)
        assert p.state == d.state == "ready"
        return p, d

    yield make
    pd_servers.stop_all(procs, grace_s=3)


def _serve_proxy(p, d, **kw):
    port = _ports.take()
    proxy = pd_proxy.PDProxy(p.health_url[:-len("/health")], d.health_url[:-len("/health")], **kw)
    server = pd_proxy.make_server("127.0.0.1", port, proxy)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


# ---- pure helpers ----------------------------------------------------------------------


def test_prompt_text_is_exact_and_deterministic():
    for n in (2, 17, 3005):
        text = pd_common.make_prompt_text(n, seed=7)
        assert len(text.encode()) == n - 1 and text.isascii()
        assert text == pd_common.make_prompt_text(n, seed=7)
    assert pd_common.make_prompt_text(50, 1) != pd_common.make_prompt_text(50, 2)
    names = [p.name for p in pd_common.sequential_prompts() + pd_common.batch_prompts()]
    assert len(names) == len(set(names))
    assert max(p.num_tokens for p in pd_common.sequential_prompts()) >= 3000


def test_fingerprint_ignores_order_but_not_content():
    a = pd_common.fingerprint([("x", [1, 2]), ("y", [3])])
    assert a == pd_common.fingerprint([("y", [3]), ("x", [1, 2])])
    assert a != pd_common.fingerprint([("x", [1, 2]), ("y", [4])])


def test_prometheus_parsing_and_deltas():
    before = pd_common.parse_prometheus(
        '# HELP x\nvllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 3\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 5\n')
    after = pd_common.parse_prometheus(
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 25.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 4\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 9\n'
        'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.5\n')
    M = pd_common.M
    assert pd_common.metric_delta(before, after, M.EXT_HITS) == 15
    assert pd_common.metric_delta(before, after, M.PROMPT_BY_SOURCE, source="local_compute") == 1
    assert pd_common.metric_delta(before, after, M.NIXL_XFER_SUM) == 0.5  # new series
    assert pd_common.metric_delta(before, after, M.NIXL_BYTES_SUM) is None  # absent


def test_registration_timings_from_stamped_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("# header\n"
                   "100.000 INFO Registering KV_Caches. use_mla: False\n"
                   "100.100 DEBUG Registering descs: [(1, 2, 0, '')]\n"
                   "100.350 DEBUG Done registering descs\n"
                   "100.900 DEBUG Created 4096 blocks for src engine e and rank 0\n"
                   "101.000 INFO kvcached_pd: registered staging region 256 MiB\n")
    t = pd_servers.registration_timings(str(log))
    assert t["nixl_register_kv_caches_s"] == pytest.approx(0.9)
    assert t["nixl_register_memory_s"] == pytest.approx(0.25)
    assert any("staging" in o["line"] for o in t["other_registration_lines"])


def test_rss_report_of_own_process():
    rep = pd_servers.rss_report(os.getpid())
    assert rep["total_rss_mib"] > 1 and rep["processes"][0]["pid"] == os.getpid()


# ---- proxy + client against the fake server ---------------------------------------------


def test_proxy_matches_single_server_and_reports_leg_timings(pd_pair, tmp_path):
    p, d = pd_pair()
    server, url = _serve_proxy(p, d)
    try:
        pd_doc = pd_client.run_suite(url, "fake-model", max_tokens=8, timeout=30)
        ref_doc = pd_client.run_suite(p.health_url[:-len("/health")], "fake-model", max_tokens=8,
                                      timeout=30)
        res = pd_common.post_json(url + "/v1/completions",
                                  pd_client.completion_request("fake-model", "hello", 4),
                                  timeout=30)
    finally:
        server.shutdown()
    assert pd_doc["n_failed"] == 0 and pd_doc["compare_on"] == "token_ids"
    assert pd_doc["fingerprint_sha256"] == ref_doc["fingerprint_sha256"]
    assert pd_client.compare_outputs(pd_doc, ref_doc)["identical"]
    timing = pd_doc["requests"][0]["pd_proxy"]
    assert timing["prefill_s"] > 0 and timing["decode_s"] > 0
    assert timing["total_s"] >= timing["decode_s"]
    assert res.ok and float(res.headers["x-pd-prefill-seconds"]) > 0
    assert float(res.headers["x-pd-decode-seconds"]) > 0


def test_proxy_refuses_decode_without_kv_params(pd_pair):
    p, d = pd_pair(p_env={"FAKE_VLLM_NO_KV_PARAMS": "1"})
    server, url = _serve_proxy(p, d)
    try:
        res = pd_common.post_json(url + "/v1/completions",
                                  pd_client.completion_request("fake-model", "hello", 4),
                                  timeout=30)
    finally:
        server.shutdown()
    assert res.status == 502
    err = res.json()["error"]
    assert err["leg"] == "prefill" and "kv_transfer_params" in err["message"]


def test_proxy_streams_and_push_concurrent(pd_pair):
    p, d = pd_pair()
    push = {"engine_id": "engine-P", "host": "127.0.0.1", "port": p.side_port,
            "tp_size": 1, "pp_size": 1}
    server, url = _serve_proxy(p, d, push_concurrent=push)
    try:
        body = pd_client.completion_request("fake-model", "abc " * 50, 6)
        res = pd_common.post_json(url + "/v1/completions", body, timeout=30)
        assert res.ok, res.body
        assert res.json()["pd_proxy"]["mode"] == "push-concurrent"
        single = pd_common.post_json(p.health_url[:-len("/health")] + "/v1/completions", body,
                                     timeout=30)
        assert res.json()["choices"][0]["token_ids"] == single.json()["choices"][0]["token_ids"]
        res = pd_common.post_json(url + "/v1/completions", dict(body, stream=True), timeout=30)
        assert res.ok
        text = res.body.decode()
        assert text.count("data: ") == 7 and "[DONE]" in text and ": pd_proxy {" in text
    finally:
        server.shutdown()


@pytest.mark.parametrize("push_mode", [False, True], ids=["sequential", "push-concurrent"])
def test_proxy_trace_marks_each_leg_in_order(pd_pair, capsys, monkeypatch, push_mode):
    """--trace: one line per request with the wall-clock marks critical_path.py splits
    the way to P and D's way out with, in the order the legs go."""
    p, d = pd_pair(p_env={"FAKE_VLLM_PREFILL_MS_PER_KTOK": "4000"})  # P's leg: 0.32 s
    push = {"engine_id": "engine-P", "host": "127.0.0.1", "port": p.side_port,
            "tp_size": 1, "pp_size": 1} if push_mode else None
    server, url = _serve_proxy(p, d, push_concurrent=push, trace=True)
    # every thread of this process while the request is in flight (P's leg takes 0.32 s)
    before = {t.ident for t in threading.enumerate()}
    seen: set = set()
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            seen.update(t.ident for t in threading.enumerate())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        body = dict(pd_client.completion_request("fake-model", "abc " * 20, 4), stream=True)
        t0 = time.time()
        res = pd_common.post_json(url + "/v1/completions", body, timeout=30,
                                  headers={"X-Request-Id": "load-0123456789ab-3"})
        t1 = time.time()
        assert res.ok, res.body
    finally:
        sampling.set()
        sampler.join()
        server.shutdown()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("pd_proxy trace ")]
    assert len(lines) == 1
    rec = json.loads(lines[0][len("pd_proxy trace "):])
    assert rec["req"] == "load-0123456789ab-3" and rec["ok"] is True
    assert t0 <= rec["recv"] <= rec["p_sent"] <= rec["d_first"] <= rec["out_first"] <= t1
    assert rec["recv"] <= rec["d_sent"] <= rec["d_first"]
    # sequential: D's leg only once P answered (0.32 s); push-concurrent: both at once,
    # P's first
    if push_mode:
        assert rec["p_sent"] <= rec["d_sent"] < rec["p_sent"] + 0.25
    else:
        assert rec["d_sent"] - rec["p_sent"] >= 0.3
    # the proxy ran no thread for the request: its event loop's thread did all (each
    # thread start of the proxy before waited for its GIL: 4.8-10 ms p50 from having the
    # request to P's leg sent on 2 x H100, 2026-11-28, push mode)
    assert not seen - before - {sampler.ident}, "the proxy started a thread for a request"


class _StubUpstream:
    """A raw-socket upstream for the proxy's failure paths: answers every request with
    ``answer`` (bytes) or, with None, holds the connection open without a byte and
    records when the proxy closes it."""

    def __init__(self, answer: bytes | None):
        self.answer = answer
        self.closed_by_peer = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", _ports.take()))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:  # closed before sending a whole request
                    if self.answer is None:
                        self.closed_by_peer.set()
                    return
                data += chunk
            if self.answer is not None:
                conn.sendall(self.answer)
                return
            conn.settimeout(20)
            try:
                while conn.recv(65536):  # the body, then nothing until the proxy closes
                    pass
                self.closed_by_peer.set()
            except OSError:
                self.closed_by_peer.set()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.sock.close()


def _serve_proxy_to(prefill_url, decode_url, **kw):
    port = _ports.take()
    proxy = pd_proxy.PDProxy(prefill_url, decode_url, timeout=30, **kw)
    server = pd_proxy.make_server("127.0.0.1", port, proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


def test_proxy_push_cuts_the_decode_leg_when_p_fails():
    """P answers HTTP 500 while D holds its leg open: the proxy closes D's connection
    (vLLM aborts D's request instead of waiting for a handoff that never comes) and
    answers the client with P's status, naming the prefill leg. Without the cut the
    client would wait on D until its timeout."""
    body = b'{"error": "boom"}'
    p = _StubUpstream(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    d = _StubUpstream(None)
    push = {"engine_id": "engine-P", "host": "127.0.0.1", "port": 1, "tp_size": 1,
            "pp_size": 1}
    server, url = _serve_proxy_to(p.url, d.url, push_concurrent=push)
    try:
        t0 = time.time()
        res = pd_common.post_json(url + "/v1/completions",
                                  dict(pd_client.completion_request("fake-model", "hi", 4),
                                       stream=True), timeout=10)
        assert time.time() - t0 < 5
        assert res.status == 500, res.body
        err = res.json()["error"]
        assert err["leg"] == "prefill" and err["upstream_status"] == 500
        assert "boom" in err["upstream_body"]
        assert d.closed_by_peer.wait(5), "D's leg was left open"
    finally:
        server.shutdown()
        p.close()
        d.close()


@pytest.mark.parametrize("push_mode", [False, True], ids=["sequential", "push-concurrent"])
def test_proxy_reports_an_unreachable_or_broken_upstream(push_mode):
    """P refusing connections: 502 naming the prefill leg (and push's D leg closed); a D
    whose answer is cut mid-head: 502 naming the decode leg. The proxy keeps serving."""
    dead_url = f"http://127.0.0.1:{_ports.take()}"  # nothing listens there
    d = _StubUpstream(None)
    push = {"engine_id": "engine-P", "host": "127.0.0.1", "port": 1, "tp_size": 1,
            "pp_size": 1} if push_mode else None
    server, url = _serve_proxy_to(dead_url, d.url, push_concurrent=push)
    req = pd_client.completion_request("fake-model", "hi", 4)
    try:
        res = pd_common.post_json(url + "/v1/completions", req, timeout=10)
        assert res.status == 502 and res.json()["error"]["leg"] == "prefill", res.body
        if push_mode:
            assert d.closed_by_peer.wait(5)
    finally:
        server.shutdown()
        d.close()
    kv = b'{"choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "e"}}'
    p = _StubUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(kv), kv))
    broken_d = _StubUpstream(b"HTTP/1.1 200 OK\r\nContent-Len")  # then closes
    server, url = _serve_proxy_to(p.url, broken_d.url, push_concurrent=push)
    try:
        res = pd_common.post_json(url + "/v1/completions", req, timeout=10)
        assert res.status == 502 and res.json()["error"]["leg"] == "decode", res.body
        with urllib.request.urlopen(url + "/healthz", timeout=5) as r:  # still serving
            health = json.loads(r.read())
        assert health["requests"] == 1 and health["failed"] == 1 and health["ok"] == 0
    finally:
        server.shutdown()
        p.close()
        broken_d.close()


# ---- the proxy's parsers against garbage (what a client or an upstream sends) ----------

_TOKEN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789"), min_size=1,
                 max_size=12)
_VALUE = st.text(st.characters(min_codepoint=32, max_codepoint=255, blacklist_characters="\r\n"),
                 max_size=40)


@st.composite
def _request_heads(draw):
    """Heads near the valid ones: a request line of any shape, header lines some of
    which are malformed, a Content-Length of any size or none."""
    line = draw(st.one_of(
        st.builds(lambda m, t, v: f"{m} {t} {v}", _TOKEN, _TOKEN,
                  st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "http/1.1", ""])),
        _VALUE))
    fields = draw(st.lists(st.one_of(
        st.builds(lambda k, v: f"{k}: {v}", _TOKEN, _VALUE),
        st.builds(lambda v: f"Content-Length: {v}", st.one_of(
            st.integers(-10, 1 << 40).map(str), _VALUE)),
        st.sampled_from(["Connection: close", "no colon here", ": no name", ""]),
    ), max_size=6))
    return ("\r\n".join([line] + fields) + "\r\n\r\n").encode("latin-1")


@settings(max_examples=400, deadline=None)
@given(st.one_of(_request_heads(), st.binary(max_size=512)))
def test_request_head_parser_refuses_garbage_with_value_error(head):
    """A client's head parses or raises ValueError (answered 400, connection closed);
    nothing else escapes, and no body over the bound is ever read."""
    try:
        method, target, keep_alive, headers, length = pd_proxy.parse_request_head(head)
    except ValueError:
        return
    assert 0 <= length <= pd_proxy.MAX_BODY
    assert method and target and isinstance(keep_alive, bool)
    assert all(k == k.lower() for k in headers)


def test_request_head_parser_reads_what_a_client_sends():
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n"
            b"X-Request-Id: load-0123456789ab-3\r\n\r\n")
    assert pd_proxy.parse_request_head(head) == (
        "POST", "/v1/completions", True,
        {"host": "x", "content-length": "17", "x-request-id": "load-0123456789ab-3"}, 17)
    assert pd_proxy.parse_request_head(b"GET /health HTTP/1.0\r\n\r\n")[2] is False
    with pytest.raises(ValueError):
        pd_proxy.parse_request_head(b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
                                    % (pd_proxy.MAX_BODY + 1))


def test_proxy_answers_a_malformed_request_with_400_and_keeps_serving():
    server, url = _serve_proxy_to("http://127.0.0.1:1", "http://127.0.0.1:1")
    port = int(url.rsplit(":", 1)[1])
    try:
        for bad in (b"POST /v1/completions\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nno colon\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(bad)
                answer = b""
                while chunk := c.recv(65536):  # the proxy closes after answering
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 400 "), answer
            assert b"malformed request" in answer
        with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
            assert json.loads(r.read())["requests"] == 0  # none reached the legs
    finally:
        server.shutdown()


class _NoWriter:
    """Upstream's writer side, unused by its reads (abort only on its idle timer)."""

    transport = types.SimpleNamespace(abort=lambda: None)

    def close(self):
        pass


_RESPONSE_PREFIXES = [b"", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                      b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                      b"HTTP/1.1 500 Oops\r\nContent-Length: -3\r\n\r\n"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_RESPONSE_PREFIXES), st.binary(max_size=1024))
def test_upstream_reader_turns_garbage_into_an_upstream_error(prefix, tail):
    """Whatever P or D sends (a status line, headers, a chunked or sized body, cut
    anywhere), the proxy's reader returns a body or raises one of UPSTREAM_ERRORS, which
    fail that request's leg with a 502, never the proxy."""
    async def read():
        reader = asyncio.StreamReader(limit=pd_proxy.MAX_HEAD)
        reader.feed_data(prefix + tail)
        reader.feed_eof()
        up = pd_proxy.Upstream(reader, _NoWriter(), timeout=5)
        try:
            await up.read_head()
            body = await up.read_body()
        except pd_proxy.UPSTREAM_ERRORS:
            return None
        assert len(body) <= len(prefix + tail)
        return body

    asyncio.run(asyncio.wait_for(read(), 5))


def test_upstream_reader_dechunks_a_streamed_answer():
    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
        reader.feed_eof()
        up = pd_proxy.Upstream(reader, _NoWriter(), timeout=5)
        return await up.read_head(), [c async for c in up.chunks()]

    assert asyncio.run(read()) == (200, [b"hello", b" world"])


def test_proxy_without_trace_prints_no_marks(pd_pair, capsys):
    p, d = pd_pair()
    server, url = _serve_proxy(p, d)
    try:
        res = pd_common.post_json(url + "/v1/completions",
                                  dict(pd_client.completion_request("fake-model", "x", 2),
                                       stream=True), timeout=30)
        assert res.ok
    finally:
        server.shutdown()
    assert "pd_proxy trace" not in capsys.readouterr().out


# ---- the whole equivalence harness -----------------------------------------------------


def _run_equivalence(tmp_path, modes, env_extra=None, extra_args=()):
    out = tmp_path / "eq"
    base = _ports.take()
    cmd = [sys.executable, os.path.join(EXP, "equivalence.py"), str(out), *modes,
           "--vllm-cmd", " ".join(FAKE), "--model", "fake-model", "--health-timeout", "30",
           "--port-base", str(base + 100), "--side-channel-port-base", str(base + 300),
           "--proxy-port-base", str(base + 500), *extra_args]
    env = dict(os.environ, FAKE_VLLM_START_DELAY="0.1", **(env_extra or {}))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    return res, summary, out


def test_equivalence_passes_and_negative_control_differs(tmp_path):
    res, summary, out = _run_equivalence(tmp_path, ["vanilla", "kvcached-pd-staged", "negative",
                                                    "push"])
    assert res.returncode == 0, res.stdout + res.stderr
    modes = summary["modes"]
    assert modes["reference"]["verdict"] == "PASS"
    assert modes["vanilla"]["kv_proof"]["ok"]
    assert modes["negative"]["verdict"] == "PASS"
    assert modes["negative"]["vs_baseline"]["n_different"] > 0
    assert modes["negative"]["kvcached_pd"]["instances"]["decode"]["corrupted_blocks_logged"] > 0
    assert (out / "summary.txt").read_text().count("PASS") >= 5
    assert (out / "logs" / "vanilla-decode.log").exists()


def test_equivalence_fails_when_decode_recomputes(tmp_path):
    res, summary, _ = _run_equivalence(tmp_path, ["vanilla", "negative"],
                                       {"FAKE_VLLM_RECOMPUTE": "1"})
    assert res.returncode == 1
    van = summary["modes"]["vanilla"]
    assert van["verdict"] == "FAIL" and not van["kv_proof"]["ok"]
    assert any("did not load the KV" in r for r in van["reasons"])
    # recomputing D never sees the corrupted KV: the negative control must fail too
    assert summary["modes"]["negative"]["verdict"] == "FAIL"


def test_equivalence_reports_dead_servers_with_log_tail(tmp_path):
    res, summary, _ = _run_equivalence(tmp_path, ["vanilla", "push"],
                                       {"FAKE_VLLM_EXIT_AT_START": "1"})
    assert res.returncode == 1
    assert "simulated crash during startup" in res.stdout
    assert summary["modes"]["vanilla"]["verdict"] == "FAIL"
    assert summary["modes"]["push"]["verdict"] == "FAIL-OPTIONAL"


def test_equivalence_deadline_skips_instead_of_hanging(tmp_path):
    t0 = time.monotonic()
    res, summary, _ = _run_equivalence(tmp_path, ["vanilla", "mixed-p"],
                                       extra_args=["--parallel", "1", "--deadline-s", "1"])
    assert time.monotonic() - t0 < 60
    assert res.returncode == 1
    assert any("out of time" in " ".join(m["reasons"] or [])
               for m in summary["modes"].values())


def test_equivalence_flags_kvcached_pd_where_it_must_not_run(tmp_path):
    res, summary, _ = _run_equivalence(tmp_path, ["vanilla", "kvcached-pd-staged"],
                                       {"FAKE_VLLM_PD_ALWAYS": "1"})
    assert res.returncode == 1
    assert summary["modes"]["vanilla"]["verdict"] == "FAIL"
    assert any("although KVCACHED_PD=0" in r for r in summary["modes"]["vanilla"]["reasons"])
    staged = summary["modes"]["kvcached-pd-staged"]
    assert staged["kvcached_pd"]["instances"]["decode"]["applied"] == ["nixl_layout"]


# ---- the transfer benchmark ------------------------------------------------------------


def test_bench_transfer_runs_all_modes_and_writes_outputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_key_value_heads": 16, "num_attention_heads": 16,
        "hidden_size": 256, "head_dim": 128, "dtype": "bfloat16",
        "max_position_embeddings": 4096}))
    out = tmp_path / "bench"
    base = _ports.take()
    cmd = [sys.executable, os.path.join(EXP, "bench_transfer.py"), "--out", str(out),
           "--model", str(model), "--vllm-cmd", " ".join(FAKE), "--sizes", "1,16,8192",
           "--repeats", "2", "--ttft-batch", "2", "--ttft-prompt-tokens", "500",
           "--modes", "vanilla,kvcached-pd-staged,kvcached-pd-direct,kvcached-own",
           "--deadline-s", "120", "--port-base", str(base + 100),
           "--side-channel-port-base", str(base + 300), "--proxy-port-base", str(base + 500)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         env=dict(os.environ, FAKE_VLLM_START_DELAY="0.1"))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "bench.json").read_text())
    assert doc["kv_bytes_per_token"] == 256 * 1024
    assert doc["config"]["max_model_len"] == 4096  # capped to the model's positions
    for name in ("vanilla", "kvcached-pd-staged", "kvcached-pd-direct", "kvcached-own"):
        mode = doc["modes"][name]
        assert mode["status"] == "measured", mode
        small, medium, huge = mode["sizes"]
        assert small["prompt_tokens"] == 4 and small["repeats_ok"] == 2
        assert medium["gbps_server"] > 0 and medium["nixl_bytes"] > 0
        assert "max-model-len" in huge["skipped"]
        assert mode["ttft"]["ok"] == 2
        assert mode["instances"]["decode"]["registration"]["nixl_register_kv_caches_s"] > 0
    staged = doc["modes"]["kvcached-pd-staged"]["sizes"][1]
    # the fake packs in 0.25 ms and unpacks in 0.5 ms: effective = pack + READ + unpack
    assert staged["pack_ms"] == pytest.approx(0.25) and staged["unpack_ms"] == pytest.approx(0.5)
    assert staged["effective_ms"] == pytest.approx(0.75 + staged["nixl_xfer_ms"])
    assert staged["gbps_effective"] == pytest.approx(
        staged["kv_bytes"] / staged["effective_ms"] / 1e6)
    vanilla = doc["modes"]["vanilla"]["sizes"][1]
    assert vanilla["pack_ms"] is None and vanilla["effective_ms"] == vanilla["nixl_xfer_ms"]
    for name in ("bench.csv", "instances.csv", "ttft.csv", "summary.txt"):
        assert (out / name).stat().st_size > 0
    summary = (out / "summary.txt").read_text()
    assert "kvcached-pd-staged" in summary and "Handoff parts" in summary


def test_equivalence_explains_reference_vs_pd_numerics(tmp_path):
    res, summary, out = _run_equivalence(tmp_path, ["vanilla", "kvcached-pd-staged", "negative"],
                                         {"FAKE_VLLM_SINGLE_SKEW": "1"})
    assert res.returncode == 1  # strict against the reference, as asked
    staged = summary["modes"]["kvcached-pd-staged"]
    assert staged["vs_baseline"]["n_different"] > 0
    assert staged["vs_vanilla"]["n_different"] == 0
    assert staged["vs_baseline"]["different"][0]["first_diff_index"] == 20
    assert summary["numerics_note"] and "vs vanilla" in (out / "summary.txt").read_text()
    # the negative control is judged against its clean twin, not the skewed reference
    neg = summary["modes"]["negative"]
    assert neg["verdict"] == "PASS" and "clean twin" in neg["note"]
    assert 0 < neg["vs_clean_twin"]["n_different"] < neg["vs_baseline"]["n_different"]


def test_negative_control_matching_its_twin_fails(tmp_path):
    # no corruption reaches D (it recomputes), so negative == its clean twin
    res, summary, _ = _run_equivalence(tmp_path, ["kvcached-pd-staged", "negative"],
                                       {"FAKE_VLLM_RECOMPUTE": "1", "FAKE_VLLM_SINGLE_SKEW": "1"})
    assert res.returncode == 1
    neg = summary["modes"]["negative"]
    assert neg["verdict"] == "FAIL"
    assert any("MATCHED its clean twin" in r for r in neg["reasons"])


def test_equivalence_reports_a_decode_instance_dying_mid_run(tmp_path):
    t0 = time.monotonic()
    res, summary, _ = _run_equivalence(tmp_path, ["vanilla"], {"FAKE_VLLM_DIE_AFTER": "3"})
    assert time.monotonic() - t0 < 60  # fail fast: no timeout per remaining prompt
    assert res.returncode == 1
    van = summary["modes"]["vanilla"]
    assert van["verdict"] == "FAIL"
    assert any("died during the requests" in r for r in van["reasons"])
    assert "simulated crash while serving" in res.stdout
    assert van["n_ok"] == 3


def test_default_bench_modes_start_at_most_three_kvcached_pairs():
    from pd_modes import BENCH_MODES, MODES, resolve_modes

    kvcached = [m for m in BENCH_MODES if MODES[m].prefill.env.get("ENABLE_KVCACHED") == "true"]
    assert len(kvcached) <= 3  # ten kvcached instances at once ran out of device memory
    assert {"vanilla", "kvcached-pd-staged", "kvcached-own"} <= set(BENCH_MODES)
    every = [m.name for m in resolve_modes(["all"])]
    assert "kvcached-pd-staged-prealloc" not in every and "kvcached-pd-staged-nospin" not in every
    assert [m.name for m in resolve_modes(["kvcached-pd-staged-nospin"])] == ["kvcached-pd-staged-nospin"]


def test_kv_proof_subtracts_decode_prefix_cache_hits():
    """The shared-prefix prompts find their prefix in D's own cache: D's external hits
    are the prompt tokens less those, and D recomputing instead is still caught."""
    import equivalence

    def snap(ext, cached, local):
        by_source = [({"source": "local_cache_hit"}, cached), ({"source": "local_compute"}, local)]
        return pd_common.MetricSnapshot(samples={
            pd_common.M.EXT_HITS: [({}, ext)], pd_common.M.PROMPT_BY_SOURCE: by_source})

    prompts = pd_common.shared_prefix_prompts()
    assert [p.num_tokens for p in prompts] == [1000, 1113]
    assert prompts[1].text.startswith(prompts[0].text[:pd_common.SHARED_PREFIX_TOKENS])
    run = equivalence.ModeRun(mode=equivalence.MODES["vanilla"])
    run.suite = {"requests": [{"ok": True, "prompt_tokens": p.num_tokens} for p in prompts]}
    run.metrics_before = {"decode": snap(0, 0, 0)}
    run.metrics_after = {"decode": snap(2113 - 688, 688, 2)}  # 43 blocks of 16 cached
    proof = equivalence.kv_proof(run)
    assert proof["ok"], proof["problems"]
    assert proof["d_prompt_tokens_local_cache_hit"] == 688
    run.metrics_after = {"decode": snap(2113 - 688 - 400, 688, 402)}  # D recomputed 400
    proof = equivalence.kv_proof(run)
    assert not proof["ok"] and any("external prefix cache hits" in p for p in proof["problems"])


# ---- a server that dies of a port clash at its start -----------------------------------

_CLASH_SERVER = """
import http.server, os, sys, time
marker, message, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
time.sleep(0.3)  # a server's start
if os.path.exists(marker) and message != "always":
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler
                           ).serve_forever()
open(marker, "a").close()
print("RuntimeError: " + (message if message != "always" else
                          "The server socket has failed to listen: EADDRINUSE"), flush=True)
sys.exit(1)
"""


def _clash_server(tmp_path, name, message):
    script = tmp_path / "clash_server.py"
    script.write_text(_CLASH_SERVER)
    port = _ports.take()
    return pd_servers.ManagedProcess(
        name, [sys.executable, str(script), str(tmp_path / f"{name}.marker"), message,
               str(port)],
        dict(os.environ), str(tmp_path / f"{name}.log"), f"http://127.0.0.1:{port}/")


def test_a_server_that_died_of_a_port_clash_at_its_start_is_started_once_more(tmp_path):
    """vLLM picks its internal ports from the ephemeral range; one taken before vLLM
    bound it killed vanilla PD's decode server on 2026-11-27 and lost the run's vanilla
    column. Such a death is started once more (and logged twice in one log); any other
    death, and a second clash, stay failures."""
    clash = _clash_server(tmp_path, "clash", "torch.distributed.DistNetworkError: The server "
                          "socket has failed to listen on any local network address. port: "
                          "43671, code: -98, name: EADDRINUSE, message: address already in use")
    other = _clash_server(tmp_path, "other", "CUDA out of memory")
    twice = _clash_server(tmp_path, "twice", "always")
    procs = [clash, other, twice]
    for p in procs:
        p.start({"SOME": "env"})
    try:
        pd_servers.wait_until_ready(procs, 20, poll_s=0.1)
        assert clash.state == "ready" and clash.restarts == 1
        log = (tmp_path / "clash.log").read_text()
        assert log.count("# clash started") == 2 and log.count("# env: SOME=env") == 2
        assert "serving" in log
        assert other.state == "failed" and other.restarts == 0
        assert twice.state == "failed" and twice.restarts == 1
        assert "exited with code 1" in twice.failure
    finally:
        pd_servers.stop_all(procs, grace_s=3)


def test_bench_proxy_measures_both_modes_of_each_proxy_given(tmp_path):
    """bench_proxy.py: stub P and D, the proxy with --trace, every request's marks read
    back (its timings are the bench's, not asserted)."""
    res = subprocess.run([sys.executable, os.path.join(EXP, "bench_proxy.py"), "--requests",
                          "8", "--concurrency", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [ln.split() for ln in res.stdout.splitlines()]
    rows = [r for r in rows if r and r[0].endswith("pd_proxy.py")]
    assert [r[1] for r in rows] == ["sequential", "push-concurrent"]
    for r in rows:  # three "p50 / p90" cells, each a number
        cells = r[2:]
        assert len(cells) == 9 and all(float(cells[i]) >= 0 for i in (0, 2, 3, 5, 6, 8))
