#!/usr/bin/env bash
# Before a lease: does each upload folder still fit the 64 MiB a command takes, beside
# the checkout that travels with it? The checkout grows with every session's results
# (17 MiB on 2026-11-26, 24.4 MiB on 2026-11-27), and folders built for an older, smaller
# checkout stop fitting: on 2026-11-27 all 28 vLLM 0.30.0 uploads of 40 MiB were refused
# mid-lease ("the working tree is larger than 64 MiB") and that release's steps never ran.
#
# usage: check_uploads.sh UPLOAD_DIR...   (e.g. .gpu/v5 .gpu030)
# Prints the checkout's size and the largest folder of each set; exit 1 when one does not
# fit, naming the FOLDER_MIB to rebuild it with (make_upload.sh).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: check_uploads.sh UPLOAD_DIR..." >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
LIMIT=$((64 * 1024 * 1024))
tree=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
       | { xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
echo "checkout: $((tree / 1024)) KiB (tracked and untracked, not ignored)"
status=0
for set in "$@"; do
  largest=0 name=""
  for folder in "$set"/up*; do
    [ -d "$folder" ] || continue
    size=$(du -sb "$folder" | cut -f1)
    if [ "$size" -gt "$largest" ]; then largest=$size name=$folder; fi
  done
  if [ -z "$name" ]; then echo "$set: no upload folders" >&2; status=1; continue; fi
  total=$((tree + largest))
  if [ "$total" -gt "$LIMIT" ]; then
    fit=$(( (LIMIT - tree) / 1024 / 1024 - 2 ))
    echo "$set: does NOT fit: $name $((largest / 1024)) KiB + the checkout = $((total / 1024)) KiB" \
         "> 65536 KiB; rebuild with FOLDER_MIB=$fit PART_MIB=$fit make_upload.sh $set"
    status=1
  else
    echo "$set: fits ($name, the largest, $((largest / 1024)) KiB; $(( (LIMIT - total) / 1024 )) KiB to spare)"
  fi
done
exit $status
