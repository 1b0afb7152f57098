#!/usr/bin/env python3
"""Where vLLM's engine processes spent a load, function by function: py-spy's stacks of
each engine process (``gpu_host/with_pyspy.sh``), named by the instance whose log it is.

usage: pyspy_summary.py PYSPY_DIR LOG_DIR [LOG_DIR...] [--rate 200] [--top 40]
                        [--against kvcached-single-single] [--json OUT]

Why: on the tiny model the GPU's share of an engine step is well under a millisecond, so
a step's length is the engine process's host time; on vLLM 0.30.0 D's steps took 4.2 ms
alone (0.26.0: 2.9) and steps that admit loaded requests 6.6-8.5 ms (2026-11-29c). The
traces time the steps; these stacks say what each step's host time was spent on, and
set beside one instance without PD (the same requests, the same tokens) they say what
D adds.

PYSPY_DIR holds ``PID.txt`` (py-spy ``--format raw --threads --idle``: one line per
distinct stack, ``thread (TID): NAME;frame;...;frame COUNT``, outermost frame first).
Each LOG_DIR is searched for ``*.log`` files naming ``(EngineCore pid=PID)``: the file's
name without ``.log`` names that process (e.g. ``kvpd-push-p-sync-decode``). Only the
samples of the engine's serving loop count (stacks through ``run_busy_loop``: vLLM's
start-up, compilation and CUDA graph capture are left out; so is the loop blocked in
``queue.get`` for want of a request), each sample 1/rate seconds
(``--idle``: waiting counts too, which is the point: a step may wait on the device or a
lock). Printed per process: its serving seconds, then the functions with the most
inclusive seconds (a function counted once per sample it is anywhere on the stack of);
with ``--against NAME``, the top functions by how many more seconds each process spent in
them than NAME's process did.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import Counter

LOOP = "run_busy_loop"
INPUT_WAIT = "_process_input_queue (core.py)"
IDLE_LEAVES = {"wait (threading.py)", "get (queue.py)"}
_PID = re.compile(r"\(EngineCore(?:_DP\d+)? pid=(\d+)\)")
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<where>[^()]*)\)$")


def parse_raw(lines) -> list[tuple[str, list[str], int]]:
    """(thread name, frames outermost first, samples) per line of py-spy's raw output."""
    out = []
    for line in lines:
        m = _LINE.match(line.rstrip("\n"))
        if not m:
            continue
        stack, count = m.group("stack"), int(m.group("count"))
        head, _, rest = stack.partition(": ")
        if not head.startswith("thread ("):  # py-spy without --threads
            head, rest = "", stack
        parts = rest.split(";") if rest else []
        thread = parts.pop(0) if head and parts else ""
        out.append((thread, parts, count))
    return out


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one name per function,
    whatever line of it the sample was on."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    where = m.group("where").rsplit(":", 1)[0]
    return f"{m.group('func')} ({os.path.basename(where)})"


def idle_for_work(names: list[str]) -> bool:
    """A stack of the engine waiting for its next request with nothing to run (vLLM's
    ``_process_input_queue`` blocked in ``queue.get``): time without a step, and where a
    process stopped by the load harness (``--freeze-others``: SIGSTOP while another
    mode is measured) is sampled."""
    return INPUT_WAIT in names and bool(names) and names[-1] in IDLE_LEAVES


def serving_profile(stacks: list[tuple[str, list[str], int]]) -> tuple[int, Counter]:
    """(samples in the serving loop, inclusive samples per function) of one process: the
    stacks that pass through ``run_busy_loop``, each function once per stack, less those
    of the engine idle for want of work (:func:`idle_for_work`)."""
    total, inclusive = 0, Counter()
    for _thread, frames, count in stacks:
        names = [frame_name(f) for f in frames]
        if not any(n.startswith(LOOP + " ") for n in names) or idle_for_work(names):
            continue
        total += count
        for name in set(names):
            inclusive[name] += count
    return total, inclusive


def process_names(log_dirs: list[str]) -> dict[str, str]:
    """PID -> the log's name (``<mode>-<role>``) for every engine process a log names."""
    names: dict[str, str] = {}
    for d in log_dirs:
        for path in sorted(glob.glob(os.path.join(d, "**", "*.log"), recursive=True)):
            name = os.path.basename(path)[:-len(".log")]
            try:
                with open(path, errors="replace") as f:
                    for line in f:
                        m = _PID.search(line)
                        if m:
                            names.setdefault(m.group(1), name)
                            break
            except OSError:
                continue
    return names


def summarize(pyspy_dir: str, log_dirs: list[str], rate: float) -> dict[str, dict]:
    """Per named process: serving seconds and inclusive seconds per function."""
    names = process_names(log_dirs)
    out: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(pyspy_dir, "*.txt"))):
        pid = os.path.basename(path)[:-len(".txt")]
        if not pid.isdigit():
            continue
        with open(path, errors="replace") as f:
            total, inclusive = serving_profile(parse_raw(f))
        name = names.get(pid, f"pid {pid}")
        out[name] = {"pid": int(pid), "serving_s": total / rate,
                     "functions": {k: v / rate for k, v in inclusive.items()}}
    return out


def render(summary: dict[str, dict], top: int = 40, against: str | None = None) -> str:
    lines = []
    for name, proc in sorted(summary.items()):
        lines.append(f"== {name} (pid {proc['pid']}): {proc['serving_s']:.2f} s in the "
                     "serving loop; inclusive seconds, share of that")
        serving = proc["serving_s"] or 1.0
        ranked = sorted(proc["functions"].items(), key=lambda kv: -kv[1])[:top]
        for func, secs in ranked:
            lines.append(f"  {secs:8.2f} {100 * secs / serving:5.1f}%  {func}")
    if against and against in summary:
        base = summary[against]["functions"]
        for name, proc in sorted(summary.items()):
            if name == against:
                continue
            lines.append(f"== {name} against {against}: seconds more (+) or fewer (-) than "
                         f"its process ({proc['serving_s']:.2f} against "
                         f"{summary[against]['serving_s']:.2f} s in the loop)")
            keys = set(base) | set(proc["functions"])
            diff = {k: proc["functions"].get(k, 0.0) - base.get(k, 0.0) for k in keys}
            for func, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
                lines.append(f"  {d:+8.2f}  {proc['functions'].get(func, 0.0):8.2f}  "
                             f"{base.get(func, 0.0):8.2f}  {func}")
    elif against:
        lines.append(f"(no process named {against}: {', '.join(sorted(summary))})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pyspy_dir")
    ap.add_argument("log_dirs", nargs="+")
    ap.add_argument("--rate", type=float, default=200.0,
                    help="py-spy's samples a second (with_pyspy.sh's PYSPY_RATE)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--against", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    summary = summarize(args.pyspy_dir, args.log_dirs, args.rate)
    if not summary:
        print(f"no py-spy records (PID.txt) in {args.pyspy_dir}", file=sys.stderr)
        return 1
    print(render(summary, args.top, args.against))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
