#!/usr/bin/env bash
# Run one command with every CUDA process it starts as a client of its own MPS server,
# then stop that server.
#
#   bash experiments/gpu_host/with_mps.sh WORKDIR COMMAND...
#
# Why: P and D on one GPU without MPS time-slice it (each process's context gets the GPU
# in turn), so D's decode steps wait behind P's prefills; under MPS their kernels may run
# at the same time. Whether kvcached's memory and kvcached-pd's CUDA IPC wire (a VMM
# allocation exported as a POSIX fd, an IPC event) work under MPS, and what it does to the
# colocated loads against one instance and vanilla PD, all under the same server, is what
# session steps named STEP.mps run this for (session.sh). Measured 2026-11-27 (2 x H200,
# driver 580.159.04, experiments/results/2026-11-27h-h200x2-session/): both work, and the
# loads' ratios to one instance did not change.
#
# The control daemon is this command's own: its pipe and log folders are under WORKDIR
# (clients find it through CUDA_MPS_PIPE_DIRECTORY, exported to COMMAND), and it is told
# to quit when COMMAND ends, however it ends. It is started with every GPU visible, so
# that the GPU indices COMMAND's processes set in CUDA_VISIBLE_DEVICES keep their meaning:
# a daemon started with CUDA_VISIBLE_DEVICES=1 renumbers that GPU 0 for its clients (as
# NVIDIA's MPS documentation says), and on 2026-11-27 every vLLM server of a step that
# asked it for GPU 1 failed with "No CUDA GPUs are available". Nothing else on the
# host (no other process, no GPU setting: compute mode, clocks and MIG stay as they are)
# is touched. WORKDIR/mps.txt says what happened. Exit: COMMAND's, or 3 where no MPS
# control daemon can be started (nothing run).
set -uo pipefail
W=${1:?usage: with_mps.sh WORKDIR COMMAND...}
shift
[ $# -ge 1 ] || { echo "usage: with_mps.sh WORKDIR COMMAND..." >&2; exit 2; }
mkdir -p "$W/mps-pipe" "$W/mps-log"
export CUDA_MPS_PIPE_DIRECTORY=$W/mps-pipe CUDA_MPS_LOG_DIRECTORY=$W/mps-log
CTL=${MPS_CONTROL:-nvidia-cuda-mps-control}
if ! command -v "$CTL" > /dev/null; then
  echo "no MPS: $CTL not found on PATH" | tee "$W/mps.txt" >&2
  exit 3
fi
if ! env -u CUDA_VISIBLE_DEVICES "$CTL" -d; then
  echo "no MPS: $CTL -d failed" | tee "$W/mps.txt" >&2
  exit 3
fi
stop() {
  echo quit | "$CTL" > /dev/null 2>&1
  { echo "== control log"; tail -20 "$W/mps-log/control.log" 2>/dev/null
    echo "== server log"; tail -40 "$W/mps-log/server.log" 2>/dev/null; } >> "$W/mps.txt"
}
trap stop EXIT
echo "MPS control daemon (every GPU visible), pipes in $CUDA_MPS_PIPE_DIRECTORY ($(date '+%F %T'))" \
  > "$W/mps.txt"
"$@"
rc=$?
# how many client connections the daemon's and the server's logs record
echo "command rc=$rc; client connections logged: $(cat "$W"/mps-log/*.log 2>/dev/null \
  | grep -ci 'new client')" >> "$W/mps.txt"
exit $rc
