#!/usr/bin/env python3
"""Deterministic greedy client: fixed prompts, output token ids, SHA-256 fingerprint.

Sends the fixed prompt set of pd_common (17 to 3800 tokens, one at a time) and then a
concurrent batch (64 to 3500 tokens), all greedy (temperature 0, ignore_eos) with
``return_token_ids`` (vLLM 0.26 CompletionRequest field; the response's
choices[0].token_ids holds the generated ids). Works against a single vLLM server (the
reference) or against pd_proxy.py (a PD pair): the client does not care which.

Output JSON: every request (prompt name and size, usage, token ids, text, latency,
the proxy's per-leg timings when present) and one SHA-256 over all outputs.

usage: pd_client.py --url http://127.0.0.1:19100 --model /tmp/tiny --out vanilla.json
       pd_client.py ... --compare-to reference.json   (exit 1 if any output differs)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pd_common import (Prompt, batch_prompts, fingerprint, post_json, sequential_prompts,
                       write_json)


@dataclass
class RequestOutcome:
    name: str
    intended_prompt_tokens: int
    ok: bool
    status: int
    latency_s: float
    error: str | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens as the server counted them
    completion_tokens: int | None = None
    token_ids: list[int] | None = None
    text: str | None = None
    finish_reason: str | None = None
    pd_proxy: dict | None = None  # per-leg timings added by pd_proxy.py
    started_at: float = field(default=0.0)


def completion_request(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": False,
    }


def send_completion(url: str, model: str, prompt: Prompt, max_tokens: int,
                    timeout: float) -> RequestOutcome:
    started = time.time()
    res = post_json(url.rstrip("/") + "/v1/completions",
                    completion_request(model, prompt.text, max_tokens), timeout=timeout)
    out = RequestOutcome(prompt.name, prompt.num_tokens, False, res.status, res.seconds,
                         started_at=started)
    if res.status != 200:
        out.error = res.error or res.body.decode("utf-8", "replace")[:2000]
        return out
    try:
        body = res.json()
        choice = body["choices"][0]
    except (ValueError, KeyError, IndexError) as exc:
        out.error = f"unexpected response: {exc}: {res.body[:500]!r}"
        return out
    usage = body.get("usage") or {}
    out.prompt_tokens = usage.get("prompt_tokens")
    out.completion_tokens = usage.get("completion_tokens")
    out.token_ids = choice.get("token_ids")
    out.text = choice.get("text")
    out.finish_reason = choice.get("finish_reason")
    out.pd_proxy = body.get("pd_proxy")
    if out.finish_reason not in ("length", "stop"):
        out.error = f"finish_reason={out.finish_reason!r}"
        return out
    if out.completion_tokens is not None and out.completion_tokens != max_tokens:
        out.error = f"{out.completion_tokens} tokens generated, {max_tokens} asked (ignore_eos)"
        return out
    out.ok = True
    return out


def _skipped(prompt: Prompt, why: str) -> RequestOutcome:
    return RequestOutcome(prompt.name, prompt.num_tokens, False, 0, 0.0, error=f"not sent: {why}")


def _timeout_for(timeout: float, deadline: float | None) -> float | None:
    """The per-request timeout, shortened to what is left before ``deadline``
    (time.monotonic()); None when nothing is left."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    return min(timeout, left) if left > 1.0 else None


def run_sequential(url, model, prompts, max_tokens, timeout,
                   deadline: float | None = None) -> list[RequestOutcome]:
    """One prompt at a time. After a request that got no HTTP answer at all (timeout,
    refused), the rest are not sent: a hung server would otherwise cost one full
    timeout per prompt."""
    out: list[RequestOutcome] = []
    broken = None
    for p in prompts:
        t = _timeout_for(timeout, deadline)
        if broken or t is None:
            out.append(_skipped(p, broken or "out of time"))
            continue
        res = send_completion(url, model, p, max_tokens, t)
        out.append(res)
        if res.status == 0:
            broken = f"an earlier request got no answer ({res.error})"
    return out


def run_concurrent(url, model, prompts, max_tokens, timeout,
                   concurrency: int | None = None,
                   deadline: float | None = None) -> list[RequestOutcome]:
    t = _timeout_for(timeout, deadline)
    if t is None:
        return [_skipped(p, "out of time") for p in prompts]
    with ThreadPoolExecutor(max_workers=concurrency or len(prompts) or 1) as pool:
        futures = [pool.submit(send_completion, url, model, p, max_tokens, t)
                   for p in prompts]
        return [f.result() for f in futures]


def output_of(outcome: dict, compare_on: str):
    return outcome.get("token_ids") if compare_on == "token_ids" else outcome.get("text")


def run_suite(url: str, model: str, max_tokens: int = 32, max_model_len: int = 4096,
              include_batch: bool = True, timeout: float = 300.0, label: str = "",
              deadline: float | None = None) -> dict:
    """The sequential prompts, then the concurrent batch; returns the result document.

    ``deadline`` (a time.monotonic() value) bounds the whole suite: requests that no
    longer fit are recorded as failed, not sent. The batch is not sent either when a
    sequential request got no answer at all."""
    limit = max_model_len - max_tokens
    t0 = time.time()
    seq = run_sequential(url, model, sequential_prompts(limit), max_tokens, timeout, deadline)
    hung = next((r for r in seq if r.status == 0), None)
    batch = []
    if include_batch:
        batch = [_skipped(p, "a sequential request got no answer") for p in batch_prompts(limit)] \
            if hung else run_concurrent(url, model, batch_prompts(limit), max_tokens, timeout,
                                        deadline=deadline)
    requests = [asdict(o) for o in seq + batch]
    ok = [r for r in requests if r["ok"]]
    # Token ids when the server returned them for every request, else the text.
    compare_on = "token_ids" if ok and all(r["token_ids"] is not None for r in ok) else "text"
    return {
        "label": label,
        "url": url,
        "model": model,
        "max_tokens": max_tokens,
        "compare_on": compare_on,
        "n_requests": len(requests),
        "n_ok": len(ok),
        "n_failed": len(requests) - len(ok),
        "fingerprint_sha256": fingerprint((r["name"], output_of(r, compare_on)) for r in ok),
        "wall_s": round(time.time() - t0, 3),
        "requests": requests,
    }


def compare_outputs(candidate: dict, baseline: dict) -> dict:
    """Per-prompt byte-for-byte comparison of two run_suite documents.

    Returns counts and, for each differing prompt, the index of the first differing
    token (a late divergence hints at numerics, an early one at corrupted KV)."""
    compare_on = "token_ids" if (candidate.get("compare_on") == "token_ids"
                                 and baseline.get("compare_on") == "token_ids") else "text"
    base = {r["name"]: r for r in baseline.get("requests", []) if r["ok"]}
    same, differ, missing = [], [], []
    for r in candidate.get("requests", []):
        b = base.get(r["name"])
        if not r["ok"] or b is None:
            missing.append(r["name"])
            continue
        x, y = output_of(r, compare_on), output_of(b, compare_on)
        if x == y:
            same.append(r["name"])
        else:
            first = next((i for i, (u, v) in enumerate(zip(x or [], y or [])) if u != v),
                         min(len(x or []), len(y or [])))
            differ.append({"name": r["name"], "first_diff_index": first,
                           "prompt_tokens": r.get("prompt_tokens")})
    return {"compare_on": compare_on, "n_same": len(same), "n_different": len(differ),
            "n_missing": len(missing), "different": differ, "missing": missing,
            "identical": not differ and not missing and bool(same)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="a vLLM server or pd_proxy.py base URL")
    ap.add_argument("--model", required=True, help="model name as the server knows it")
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--label", default="")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="prompts longer than this minus --max-tokens are skipped")
    ap.add_argument("--no-batch", action="store_true", help="skip the concurrent batch")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    ap.add_argument("--compare-to", help="another result JSON: exit 1 unless identical")
    a = ap.parse_args(argv)
    doc = run_suite(a.url, a.model, a.max_tokens, a.max_model_len, not a.no_batch,
                    a.timeout, a.label)
    rc = 0 if doc["n_failed"] == 0 else 1
    if a.compare_to:
        with open(a.compare_to, encoding="utf-8") as f:
            doc["comparison"] = compare_outputs(doc, json.load(f))
        rc = rc or (0 if doc["comparison"]["identical"] else 1)
    write_json(a.out, doc)
    print(f"{a.label or a.url}: {doc['n_ok']}/{doc['n_requests']} ok, "
          f"sha256={doc['fingerprint_sha256']}"
          + (f", vs {a.compare_to}: {doc['comparison']['n_different']} different, "
             f"{doc['comparison']['n_missing']} missing" if a.compare_to else ""))
    for r in doc["requests"]:
        if not r["ok"]:
            print(f"  FAILED {r['name']}: HTTP {r['status']}: {(r['error'] or '')[:300]}",
                  file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
