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


def check_wire(expected: str | None, wires: list[str], fallbacks: float | None,
               counter_readable: bool = True) -> dict:
    """Which wire served D's staged peer: ``wires`` as D's log names them
    (pd_servers.wire_evidence), ``fallbacks`` D's growth of
    vllm:kvcached_pd_wire_fallbacks_total (None: not exported). ``expected`` None: only
    reported. ``counter_readable`` False (D was killed): the log alone decides."""
    seen = "/".join(wires) or "none named"
    detail = f"D's log: wire {seen}; IPC->NIXL fallbacks " + \
        ("-" if fallbacks is None else f"{fallbacks:.0f}")
    if expected is None:
        return {"status": NA, "detail": detail + " (no wire expected)", "wires": wires}
    if not wires:
        return {"status": ABSENT, "wires": wires,
                "detail": f"D's log names no wire for its staged peer (expected {expected})"}
    if wires != [expected]:
        return {"status": FAIL, "wires": wires, "detail": detail + f"; expected {expected} only"}
    if expected == "ipc" and fallbacks:
        return {"status": FAIL, "wires": wires,
                "detail": detail + ": a peer fell back from IPC to NIXL"}
    if expected == "ipc" and fallbacks is None and counter_readable:
        return {"status": ABSENT, "wires": wires,
                "detail": detail + " (D exports no " + M.KVPD_WIRE_FALLBACKS + ")"}
    return {"status": PASS, "wires": wires, "detail": detail}


def check_memory_returned(killed: str, before: dict, idle: dict,
                          gpu_before: float | None, gpu_idle: float | None,
                          survivor_kvcached: bool = True, kv_tolerance_mib: float = 64,
                          gpu_tolerance_mib: float = 512) -> dict:
    """After ``killed`` (prefill | decode) died mid-load and the settle window passed:

    - the survivor's KV memory returned: kvcached's pages in use no more than before the
      load (+ ``kv_tolerance_mib``, two pages of the tiny model's contiguous layout; n/a
      for a survivor without kvcached);
    - the dead instance's device memory came back to its GPU: the memory in use on the
      dead one's GPU (``gpu_before``/``gpu_idle``: that GPU's readings, the survivor's
      too when they share it) fell by at least what the dead one held before the load,
      less ``gpu_tolerance_mib`` (the survivor's kvcached may map a few pages ahead
      meanwhile). Where the survivor still maps memory the dead one exported (a staging
      region opened through CUDA IPC), that memory stays allocated and the drop falls
      short by its size.

    ``before``/``idle``: role -> instance reading (gpu_memory.instance_memory). A part
    that cannot be read is absent; n/a only when the machine gives no reading at all
    (no nvidia-smi, no kvcached segment: the offline fake)."""
    survivor = "decode" if killed == "prefill" else "prefill"
    parts, states = [], []
    kv_b = ((before.get(survivor) or {}).get("kvcached") or {}).get("used")
    kv_i = ((idle.get(survivor) or {}).get("kvcached") or {}).get("used")
    if not survivor_kvcached:
        parts.append(f"{survivor} runs without kvcached")
        states.append(NA)
    elif kv_b is None or kv_i is None:
        parts.append(f"{survivor}'s kvcached pages: not readable")
        states.append(ABSENT)
    else:
        grew = (kv_i - kv_b) / 2**20
        ok = grew <= kv_tolerance_mib
        states.append(PASS if ok else FAIL)
        parts.append(f"{survivor}'s KV pages in use {kv_b / 2**20:.0f} MiB before the load, "
                     f"{kv_i / 2**20:.0f} MiB once settled" + ("" if ok else " (not returned)"))
    held = (before.get(killed) or {}).get("device_mib")
    if held is None or gpu_before is None or gpu_idle is None:
        parts.append("GPU memory in use: not readable")
        states.append(ABSENT)
    else:
        drop = gpu_before - gpu_idle
        ok = drop >= held - gpu_tolerance_mib
        states.append(PASS if ok else FAIL)
        parts.append(f"the memory in use on {killed}'s GPU fell by {drop:.0f} MiB, {killed} held "
                     f"{held:.0f} MiB" + ("" if ok else " (not all returned)"))
    readable = [x for x in states if x != ABSENT]
    if FAIL in states:
        status = FAIL
    elif not readable or readable == [NA]:
        status = NA if held is None and gpu_before is None and gpu_idle is None and \
            kv_b is None and kv_i is None else ABSENT
    else:
        status = ABSENT if ABSENT in states else PASS
    return {"status": status, "detail": "; ".join(parts), "survivor": survivor}


def check_kill_in_flight(requests: list[dict], killed_at: float | None) -> dict:
    """Whether a kill landed while the load still had requests on their way: one sent
    before it and not ended by then, or one sent after it. A kill that lands after the
    last request ended tests a survivor with nothing in flight, not a peer dying
    mid-handoff: 2026-11-29d (one H200, vLLM's CUDA graphs) the 128-request load took
    about a second and "kill P at +1 s" came after its last request; that run passed
    every other check. ``killed_at``: the kill's ``time.time()``; None, it never fired
    (``--kill-after N`` with fewer completions)."""
    if killed_at is None:
        return {"status": FAIL, "detail": "the kill never fired"}
    in_flight = sent_after = 0
    last_end = None
    for r in requests:
        start = r.get("started_at")
        if start is None:
            continue
        end = start + r["e2e_s"] if r.get("e2e_s") is not None else None
        if end is not None:
            last_end = end if last_end is None else max(last_end, end)
        if start > killed_at:
            sent_after += 1
        elif end is None or end >= killed_at:
            in_flight += 1
    detail = f"{in_flight} request(s) in flight at the kill, {sent_after} sent after it"
    if in_flight or sent_after:
        return {"status": PASS, "detail": detail}
    late = "" if last_end is None else \
        f": it landed {1e3 * (killed_at - last_end):.0f} ms after the last request ended"
    return {"status": FAIL, "detail": detail + late + " (nothing died mid-handoff)"}


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
