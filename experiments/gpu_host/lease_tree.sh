#!/usr/bin/env bash
# For a lease: take experiments/results/ out of what travels with every device call, and
# put it back after.
#
# Why: the checkout travels with each call beside its upload folder, 64 MiB together, and
# on 2026-11-29 it was 32 MiB, 30 of them experiments/results/ (every session's
# summaries). Without them the checkout is 2 MiB and a folder can be 58 MiB instead of 29:
# vLLM 0.30.0's 1 104 MiB of wheels went up in 20 calls instead of about 40 (5 s each on
# one H200, 2026-11-29b). Nothing on the host reads experiments/results/ (session.sh
# writes its own results under /tmp and $OUT).
#
# usage: lease_tree.sh slim      before make_upload.sh / check_uploads.sh and the lease
#        lease_tree.sh restore   right after the lease, before any commit
#        lease_tree.sh status    what travels now, in KiB, and whether the tree is slim
#
# slim removes experiments/results/ from the index only (the files stay on disk) and names
# it in .git/info/exclude, so git neither tracks nor offers it: the device tool sends the
# tracked and the untracked, not ignored files. It refuses when anything else is staged,
# so that restore (git reset of that one folder) gives back exactly what was there. While
# slim, do not commit: the commit would delete the results.
set -euo pipefail
ACTION=${1:?usage: lease_tree.sh slim|restore|status}
REPO=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
cd "$REPO"
DIR=experiments/results
LINE="/$DIR/"
EXCLUDE=$(git rev-parse --git-path info/exclude)

travels() {
  git ls-files -z --cached --others --exclude-standard \
    | { xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print int(s / 1024)}'
}
is_slim() { [ -f "$EXCLUDE" ] && grep -qxF "$LINE" "$EXCLUDE"; }

case $ACTION in
slim)
  if is_slim; then echo "already slim ($(travels) KiB travel)"; exit 0; fi
  if ! git diff --cached --quiet; then
    echo "lease_tree.sh: changes are staged; commit or unstage them first (restore" \
         "resets $DIR in the index and must not touch anything else)" >&2
    exit 1
  fi
  before=$(travels)
  git rm -r --cached -q "$DIR"
  mkdir -p "$(dirname "$EXCLUDE")"
  echo "$LINE" >> "$EXCLUDE"
  echo "slim: $before KiB -> $(travels) KiB travel; run lease_tree.sh restore after the lease"
  ;;
restore)
  if ! is_slim; then echo "not slim: nothing to restore"; exit 0; fi
  git reset -q -- "$DIR"
  grep -vxF "$LINE" "$EXCLUDE" > "$EXCLUDE.tmp" || true
  mv "$EXCLUDE.tmp" "$EXCLUDE"
  echo "restored: $(travels) KiB travel"
  ;;
status)
  if is_slim; then echo "slim: $(travels) KiB travel"; else echo "full: $(travels) KiB travel"; fi
  ;;
*) echo "usage: lease_tree.sh slim|restore|status" >&2; exit 2 ;;
esac
