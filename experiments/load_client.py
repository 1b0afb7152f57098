"""The load's streaming client: one greedy completion streamed through a proxy (or straight
to a server), with the client dropping it during the P leg or the D leg when told to.

Streaming gives the time to first token and, through pd_proxy.py, the moment D's stream
starts (the proxy answers only then), which is what tells a P-leg abort from a D-leg one.
Dropping = what a departed client does: FIN on the socket, then close. Standard library
only, like the rest of the harness.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pd_common import Prompt, _split_url


@dataclass(frozen=True)
class AbortPlan:
    """Which requests the client drops, and when.

    Request i (0-based) is dropped when (i + 1) % every == 0: during its prefill leg when
    no answer has come ``prefill_ms`` after sending (the proxy answers only once D's
    stream starts), and/or ``decode_ms`` after the answer's headers (D's stream). A
    request that finishes first is simply completed."""

    every: int
    prefill_ms: float | None = None
    decode_ms: float | None = None

    def for_index(self, i: int) -> tuple[float | None, float | None] | None:
        if self.every <= 0 or (i + 1) % self.every:
            return None
        return self.prefill_ms, self.decode_ms

    def describe(self) -> str:
        legs = []
        if self.prefill_ms is not None:
            legs.append(f"P leg after {self.prefill_ms:g} ms")
        if self.decode_ms is not None:
            legs.append(f"D leg after {self.decode_ms:g} ms")
        k = self.every
        return f"requests {k}, {2 * k}, {3 * k}, ...: drop " + " / ".join(legs)


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}


def _drop(conn: http.client.HTTPConnection, sock: socket.socket) -> None:
    """What a client that goes away does: FIN now (the response object may still hold
    the socket), then close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def stream_completion(url: str, body: dict, timeout: float, abort_p_ms: float | None = None,
                      abort_d_ms: float | None = None, request_id: str | None = None) -> dict:
    """One streamed completion; returns its token ids, timings and how it ended.

    ``aborted`` is "prefill" or "decode" when the client dropped it, ``ok`` True only for
    a request that finished with all its tokens."""
    host, port, path = _split_url(url.rstrip("/") + "/v1/completions")
    out: dict = {"ok": False, "aborted": None, "status": 0, "error": None, "token_ids": [],
                 "prompt_tokens": None, "completion_tokens": None, "finish_reason": None,
                 "e2e_s": None, "ttft_s": None, "headers_s": None, "prefill_s": None,
                 "decode_s": None, "started_at": time.time(),
                 "request_id": request_id or uuid.uuid4().hex}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
        sock = conn.sock  # http.client may drop conn.sock once the response is open
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        headers = {"Content-Type": "application/json",
                   "X-Request-Id": out["request_id"]}
        conn.request("POST", path, json.dumps(body).encode(), headers)
        if abort_p_ms is not None:
            sock.settimeout(max(0.001, abort_p_ms / 1000 - (time.perf_counter() - t0)))
        try:
            resp = conn.getresponse()
        except TimeoutError:
            out["aborted"] = "prefill"
            _drop(conn, sock)
            out["e2e_s"] = time.perf_counter() - t0
            return out
        t_headers = time.perf_counter()
        out["headers_s"] = t_headers - t0
        out["status"] = resp.status
        if resp.getheader("X-PD-Prefill-Seconds"):
            out["prefill_s"] = float(resp.getheader("X-PD-Prefill-Seconds"))
        if resp.status != 200:
            sock.settimeout(timeout)
            out["error"] = f"HTTP {resp.status}: " + resp.read()[:1500].decode("utf-8", "replace")
            return out
        d_deadline = t_headers + abort_d_ms / 1000 if abort_d_ms is not None else None
        text = []
        while True:
            if d_deadline is not None:
                left = d_deadline - time.perf_counter()
                if left <= 0:
                    out["aborted"] = "decode"
                    _drop(conn, sock)
                    break
                sock.settimeout(min(left, timeout))
            else:
                sock.settimeout(timeout)
            try:
                line = resp.readline()
            except TimeoutError:
                if d_deadline is not None and time.perf_counter() >= d_deadline:
                    out["aborted"] = "decode"
                    _drop(conn, sock)
                    break
                raise
            if not line:
                break
            line = line.decode("utf-8", "replace").strip()
            if line.startswith(": pd_proxy "):
                try:
                    timing = json.loads(line[len(": pd_proxy "):])
                    out["decode_s"] = timing.get("decode_s")
                    out["prefill_s"] = timing.get("prefill_s", out["prefill_s"])
                except ValueError:
                    pass
                continue
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("error"):  # vLLM reports a failure mid-stream as an error event
                out["error"] = f"error event: {json.dumps(event['error'])[:500]}"
            if event.get("usage"):
                out["prompt_tokens"] = event["usage"].get("prompt_tokens")
                out["completion_tokens"] = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["token_ids"].extend(ids)
                text.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
        out["text"] = "".join(text)
        if out["aborted"] is None and out["error"] is None:
            want = body["max_tokens"]
            if out["finish_reason"] not in ("length", "stop"):
                out["error"] = f"stream ended without a finish reason ({len(out['token_ids'])} " \
                               "tokens)"
            elif len(out["token_ids"]) != want:
                out["error"] = f"{len(out['token_ids'])} token ids streamed, {want} asked"
            else:
                out["ok"] = True
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["e2e_s"] = out["e2e_s"] or time.perf_counter() - t0
        conn.close()
    return out


def run_load(url: str, model: str, prompts: list[Prompt], max_tokens: int, concurrency: int,
             timeout: float, aborts: AbortPlan | None = None,
             on_start=None, on_done=None) -> list[dict]:
    """Every prompt once, ``concurrency`` in flight, in prompt order; outcomes in that order.
    ``on_done(result)``: called from the client's thread as each request ends."""

    def one(i: int) -> dict:
        prompt = prompts[i]
        plan = aborts.for_index(i) if aborts else None
        p_ms, d_ms = plan if plan else (None, None)
        res = stream_completion(url, completion_body(model, prompt.text, max_tokens), timeout,
                                p_ms, d_ms, request_id=f"load-{uuid.uuid4().hex[:12]}-{i}")
        res.update(name=prompt.name, index=i, intended_prompt_tokens=prompt.num_tokens,
                   abort_planned=plan is not None)
        if on_done:
            on_done(res)
        return res

    if on_start:
        on_start()
    # no `with`: on an interrupt (SIGTERM from traffic.sh's timeout) the servers must be
    # stopped at once, not after every in-flight request has timed out
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        return list(pool.map(one, range(len(prompts))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
