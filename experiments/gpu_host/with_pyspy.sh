#!/usr/bin/env bash
# Run one command while py-spy samples every vLLM engine-core process it starts, then
# leave each process's stacks in WORKDIR/pyspy/.
#
#   bash experiments/gpu_host/with_pyspy.sh WORKDIR COMMAND...
#
# Why: on the tiny model (135.5M parameters) a decode step's GPU work is well under a
# millisecond, yet D's engine steps took 4.2 ms p50 alone and a step that admits loaded
# requests 6.6-8.5 ms on vLLM 0.30.0 (2026-11-29c, one H200): the steps are the engine
# process's host time, and the traces say only how long they took, not where it went.
# py-spy samples the Python stacks of a running process from outside (no change to
# vLLM or to the process), so one instance without PD and D of the same load can be
# compared function by function (experiments/pyspy_summary.py).
#
# A watcher looks for new processes whose command line names vLLM's engine core
# ("EngineCore", its process title) every half second and starts one
# ``py-spy record --pid PID --format raw PYSPY_FLAGS`` for each, at PYSPY_RATE samples a
# second (default 200); py-spy writes WORKDIR/pyspy/PID.txt when the process exits (its
# collapsed stacks: "thread (TID): NAME;frame;frame COUNT") and its own messages, with
# its counts of samples and errors, to PID.log. Nothing else on the host is touched.
# py-spy: PYSPY, else py-spy on PATH, else /tmp/py-spy. Exit: COMMAND's, or 3 where
# py-spy cannot be found (nothing run).
#
# PYSPY_FLAGS (default "--threads --idle --nonblocking": every thread, waits included,
# the process never paused to be read). First run (2026-11-29d, one H200, vLLM 0.30.0,
# py-spy 0.4.1, colo-h.spy): all eight engine processes were sampled through start-up
# (model load, Triton compilation, KV registration) and then not at all while they
# served: no sample of any process passed through vLLM's run_busy_loop, each log counts
# 2 449-73 547 samples and 114-1 262 errors over a 2-minute life, two say py-spy fell
# 1.4-5.1 s behind. Not understood; what was not tried: py-spy pausing the process
# (PYSPY_FLAGS without --nonblocking), the GIL holder alone (--gil), a lower rate.
set -uo pipefail
W=${1:?usage: with_pyspy.sh WORKDIR COMMAND...}
shift
[ $# -ge 1 ] || { echo "usage: with_pyspy.sh WORKDIR COMMAND..." >&2; exit 2; }
SPY=${PYSPY:-$(command -v py-spy || echo /tmp/py-spy)}
if [ ! -x "$SPY" ]; then
  echo "no py-spy: $SPY is not an executable (PYSPY, PATH or /tmp/py-spy)" >&2
  exit 3
fi
mkdir -p "$W/pyspy"
RATE=${PYSPY_RATE:-200}
read -r -a FLAGS <<< "${PYSPY_FLAGS:---threads --idle --nonblocking}"
PATTERN=${PYSPY_PATTERN:-EngineCore}
watch() {
  local seen=" " pid
  while :; do
    for pid in $(pgrep -f "$PATTERN" 2>/dev/null); do
      [ "$pid" = "$$" ] && continue
      case $seen in *" $pid "*) continue ;; esac
      seen="$seen$pid "
      tr '\0' ' ' < /proc/$pid/cmdline > "$W/pyspy/$pid.cmd" 2>/dev/null
      "$SPY" record --pid "$pid" --rate "$RATE" --format raw "${FLAGS[@]}" \
        --output "$W/pyspy/$pid.txt" > "$W/pyspy/$pid.log" 2>&1 &
    done
    sleep 0.5
  done
}
watch &
WATCHER=$!
stop() {
  kill "$WATCHER" 2> /dev/null
  # py-spy writes its file when its process has exited: give the last ones time
  for _ in $(seq 20); do pgrep -f "$SPY record" > /dev/null || break; sleep 0.5; done
  echo "py-spy: $(ls "$W"/pyspy/[0-9]*.txt 2>/dev/null | wc -l) engine process(es) recorded" \
    "at $RATE Hz ($(date '+%F %T'))" >> "$W/pyspy/README.txt"
}
trap stop EXIT
echo "$("$SPY" --version 2>&1) on processes matching '$PATTERN', flags ${FLAGS[*]}" \
  "($(date '+%F %T'))" \
  > "$W/pyspy/README.txt"
"$@"
