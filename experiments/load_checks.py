"""The load harness's checks: pure functions of what one repeat measured, each returning
{"status": pass | fail | n/a | absent, "detail": ...}, so every rule is testable alone.

"absent" is a check that could not be made (a metric the instance does not export, nothing
to compare): never a pass. A verdict is FAIL if any check failed, else UNPROVEN if one is
absent, else PASS.
"""

from __future__ import annotations

from pd_common import M, MetricSnapshot, metric_delta, percentile

PASS, FAIL, NA, ABSENT = "pass", "fail", "n/a", "absent"


def check_outputs(requests: list[dict], reference: dict[str, list[int]],
                  faults: bool = False) -> dict:
    """``faults``: a peer was killed or transfers made to fail, so none completing is
    possible; then nothing could be compared (absent), which is no pass either."""
    done = [r for r in requests if r["ok"]]
    differ, missing = [], []
    for r in done:
        ref = reference.get(r["name"])
        if ref is None:
            missing.append(r["name"])
        elif r["token_ids"] != ref:
            first = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b),
                         min(len(r["token_ids"]), len(ref)))
            differ.append({"name": r["name"], "first_diff_index": first})
    if not done:
        status, why = (ABSENT, "no request completed: nothing to compare") if faults else \
            (FAIL, "no request completed")
    elif differ:
        status, why = FAIL, f"{len(differ)} of {len(done)} completed outputs differ from the " \
            "reference (first: " + ", ".join(f"{d['name']} at token {d['first_diff_index']}"
                                             for d in differ[:4]) + ")"
    elif missing:
        status, why = ABSENT, f"the reference has no output for {len(missing)} completed prompts"
    else:
        status, why = PASS, f"{len(done)} completed outputs identical to the reference"
    return {"status": status, "detail": why, "n_compared": len(done) - len(missing),
            "n_different": len(differ), "different": differ, "missing": missing}


def check_requests(requests: list[dict], failures_expected: bool) -> dict:
    failed = [r for r in requests if not r["ok"] and not r["aborted"]]
    detail = f"{len(failed)} requests failed that the client did not drop"
    if failed:
        detail += ": " + " | ".join(f"{r['name']}: {(r['error'] or '')[:160]}" for r in failed[:3])
    if failures_expected:
        return {"status": NA, "detail": detail + " (faults injected: not checked)",
                "n_failed": len(failed)}
    return {"status": FAIL if failed else PASS, "detail": detail, "n_failed": len(failed)}


def check_kv_loaded(requests: list[dict], before: MetricSnapshot | None,
                    after: MetricSnapshot | None) -> dict:
    """D's counters prove it loaded the completed requests' KV (see the module doc)."""
    done = [r for r in requests if r["ok"]]
    sent = len(requests)
    tokens = sum(r["prompt_tokens"] or r["intended_prompt_tokens"] for r in done)
    hits = metric_delta(before, after, M.EXT_HITS)
    local = metric_delta(before, after, M.PROMPT_BY_SOURCE, source="local_compute")
    out = {"d_external_prefix_cache_hits": hits, "d_local_compute_tokens": local,
           "completed_prompt_tokens": tokens}
    if after is None or hits is None:
        return {**out, "status": ABSENT, "detail": f"D exports no {M.EXT_HITS}"}
    problems = []
    if hits < tokens - len(done):
        problems.append(f"D's external prefix cache hits grew by {hits:.0f}, at least "
                        f"{tokens - len(done)} expected: D did not load the KV")
    if local is not None and local > sent:
        problems.append(f"D computed {local:.0f} prompt tokens locally, at most {sent} expected "
                        "(one per request): D recomputed prompts")
    if problems:
        return {**out, "status": FAIL, "detail": "; ".join(problems)}
    return {**out, "status": PASS, "detail": f"D loaded {hits:.0f} prompt tokens from P"}


def staging_expected(env: dict[str, str]) -> bool:
    return env.get("KVCACHED_PD") == "1" and env.get("KVCACHED_PD_TRANSPORT") == "staged"


def check_staging(readings: dict[str, dict]) -> dict:
    """``readings``: role -> {"expected": bool, "bytes": float | None, "settle_s": float}."""
    parts, status = [], NA
    rank = {NA: 0, PASS: 1, ABSENT: 2, FAIL: 3}
    for role, r in readings.items():
        if not r["expected"]:
            continue
        if r["bytes"] is None:
            s, txt = ABSENT, f"{role}: gauge absent"
        elif r["bytes"] != 0:
            s, txt = FAIL, f"{role}: {r['bytes']:.0f} bytes still staged after " \
                f"{r['settle_s']:.1f}s"
        else:
            s, txt = PASS, f"{role}: 0 after {r['settle_s']:.1f}s"
        parts.append(txt)
        status = s if rank[s] > rank[status] else status
    return {"status": status, "detail": "; ".join(parts) or "not a staged mode",
            "readings": readings}


def check_alive(roles: dict[str, dict]) -> dict:
    """``roles``: role -> {"alive": bool, "health": int, "killed": bool, "tail": str}."""
    dead, problems = [], []
    for role, r in roles.items():
        up = r["alive"] and r["health"] == 200
        if r.get("killed"):
            if r["alive"]:
                problems.append(f"{role} was to be killed but is still running")
            continue
        if not up:
            dead.append(role)
            problems.append(f"{role} is dead (process {'alive' if r['alive'] else 'exited'}, "
                            f"/health {r['health'] or 'no answer'})")
    return {"status": FAIL if problems else PASS, "dead": dead,
            "detail": "; ".join(problems) or "every server alive, /health 200",
            "log_tails": {role: roles[role].get("tail", "") for role in dead}}


def verdict_of(checks: dict[str, dict]) -> str:
    states = [c["status"] for c in checks.values()]
    if FAIL in states:
        return "FAIL"
    if ABSENT in states:
        return "UNPROVEN"
    return "PASS"


def latency_stats(requests: list[dict]) -> dict:
    done = [r for r in requests if r["ok"]]
    out = {"n": len(done)}
    for key in ("e2e_s", "ttft_s", "prefill_s", "decode_s"):
        vals = [r[key] for r in done if r.get(key) is not None]
        out[key.replace("_s", "_p50_ms")] = ms(percentile(vals, 0.5))
        out[key.replace("_s", "_p90_ms")] = ms(percentile(vals, 0.9))
    return out


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)
