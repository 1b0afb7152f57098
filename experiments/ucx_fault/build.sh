#!/usr/bin/env bash
# Build the UCX fault injector (ucx_fault_injector.c) into OUT_DIR/libkvpd_ucx_fault.so and
# print that path as the last line. Where no C compiler is found, copy the prebuilt x86_64
# copy (prebuilt/, made here by `build.sh prebuilt`; needs glibc >= 2.34) instead, so the
# offline GPU host runs the injector either way; with --no-prebuilt that case fails
# (exit 3) instead, for tests that must exercise the source.
#
# usage: build.sh [--no-prebuilt] OUT_DIR       (CC picks the compiler; default cc/gcc/clang)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FALLBACK=1
if [ "${1:-}" = --no-prebuilt ]; then FALLBACK=0; shift; fi
OUT=${1:?usage: build.sh [--no-prebuilt] OUT_DIR}
case "$OUT" in prebuilt) OUT=$HERE/prebuilt ;; esac
SRC=$HERE/ucx_fault_injector.c
LIB=libkvpd_ucx_fault.so
mkdir -p "$OUT"
CC_BIN=
for c in ${CC:-} cc gcc clang; do
  if command -v "$c" >/dev/null 2>&1; then CC_BIN=$c; break; fi
done
if [ -n "$CC_BIN" ]; then
  "$CC_BIN" -shared -fPIC -O2 -Wall -Wextra -o "$OUT/$LIB.tmp" "$SRC" -ldl
  mv "$OUT/$LIB.tmp" "$OUT/$LIB"
  if [ "$OUT" = "$HERE/prebuilt" ]; then  # which source the prebuilt copy is
    (cd "$HERE" && sha256sum ucx_fault_injector.c) > "$OUT/SOURCE.sha256"
    echo "$("$CC_BIN" --version | head -1); $(ldd --version 2>&1 | head -1); $(uname -m)" \
      > "$OUT/BUILT_WITH.txt"
  fi
  echo "built $OUT/$LIB with $CC_BIN" >&2
elif [ "$FALLBACK" = 1 ] && [ -f "$HERE/prebuilt/$LIB" ]; then
  if ! (cd "$HERE" && sha256sum --quiet -c prebuilt/SOURCE.sha256) >/dev/null 2>&1; then
    echo "WARNING: prebuilt/$LIB was built from an older ucx_fault_injector.c" >&2
  fi
  [ "$OUT" -ef "$HERE/prebuilt" ] || cp "$HERE/prebuilt/$LIB" "$OUT/$LIB"
  echo "no C compiler: using the prebuilt $LIB ($(cat "$HERE/prebuilt/BUILT_WITH.txt" 2>/dev/null))" >&2
else
  echo "no C compiler (tried ${CC:+$CC }cc gcc clang)" >&2
  exit 3
fi
echo "$OUT/$LIB"
