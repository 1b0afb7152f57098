#!/usr/bin/env bash
# Greedy-output equivalence of the PD modes against a no-PD reference, on the GPU host.
#
# usage: equivalence.sh OUTDIR [MODES...|all] [equivalence.py options]
#   MODES: reference vanilla kvcached-own kvcached-pd-direct kvcached-pd-staged mixed-p
#          mixed-d push push-vanilla blocksize negative   (default: all)
#   e.g.   equivalence.sh /tmp/out/eq all --parallel 6 --deadline-s 270
#
# Everything lands under OUTDIR (logs/, modes/*.json, summary.json, summary.txt,
# harness.log). Exit status: 0 only if every required mode passed (the negative control
# passes by coming out DIFFERENT); see equivalence.py for the rules.
set -uo pipefail
OUT=${1:?usage: equivalence.sh OUTDIR [MODES...] [options]}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" "$HERE/equivalence.py" "$@" 2>&1 | tee -a "$OUT/harness.log"
exit "${PIPESTATUS[0]}"
