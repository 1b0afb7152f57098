#!/usr/bin/env bash
# Pack a results tree into a few files, because the GPU host hands back at most 8 files
# of at most 16 MiB each, no more than two folders below its output folder.
#
# usage: pack_results.sh SRC_DIR DEST_DIR
#   DEST_DIR/results.tar.gz          all of SRC_DIR (if over 15 MiB: logs cut to their last
#                                    2000 lines, and the list of what was cut inside)
#   DEST_DIR/equivalence-summary.txt SRC_DIR/equivalence/summary.txt, when present
#   DEST_DIR/bench-summary.txt       SRC_DIR/bench/summary.txt
#   DEST_DIR/bench_gbps.png, DEST_DIR/bench.csv, DEST_DIR/run_all.log
#   DEST_DIR/load-summary.txt, load-latency.csv, load-timeline.txt, traffic.log (traffic.sh)
set -uo pipefail
SRC=$(cd "${1:?usage: pack_results.sh SRC_DIR DEST_DIR}" && pwd)
DEST=${2:?usage: pack_results.sh SRC_DIR DEST_DIR}
LIMIT=$((15 * 1024 * 1024))
mkdir -p "$DEST"
tar czf "$DEST/results.tar.gz" -C "$(dirname "$SRC")" "$(basename "$SRC")"
if [ "$(stat -c %s "$DEST/results.tar.gz")" -gt "$LIMIT" ]; then
  TMP=$(mktemp -d)
  cp -r "$SRC" "$TMP/"
  find "$TMP" -name '*.log' -size +512k -print0 | while IFS= read -r -d '' f; do
    tail -n 2000 "$f" > "$f.tail" && mv "$f.tail" "$f"
    echo "${f#"$TMP"/}" >> "$TMP/$(basename "$SRC")/TRUNCATED_LOGS.txt"
  done
  tar czf "$DEST/results.tar.gz" -C "$TMP" "$(basename "$SRC")"
  rm -rf "$TMP"
fi
copy() { [ -f "$SRC/$1" ] && cp "$SRC/$1" "$DEST/$2"; }
copy equivalence/summary.txt equivalence-summary.txt
copy bench/summary.txt bench-summary.txt
copy bench/bench_gbps.png bench_gbps.png
copy bench/bench.csv bench.csv
copy run_all.log run_all.log
copy load/summary.txt load-summary.txt
copy load/latency.csv load-latency.csv
copy load/timeline.txt load-timeline.txt
copy traffic.log traffic.log
ls -la "$DEST"
exit 0
