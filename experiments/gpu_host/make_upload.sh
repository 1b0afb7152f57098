#!/usr/bin/env bash
# Build, on a machine that reaches PyPI, every wheel the offline 2xH200 GPU host needs to
# run kvcached-pd's experiments (vLLM 0.26.0 slimmed for Hopper, NIXL 1.5.1 + nixl-cu13,
# vLLM's missing dependencies, wrapt for kvcached-pd, the kvcached 0.1.6 source archive),
# split into upload folders of at most 60 MiB: the host accepts 64 MiB per command and
# the checkout travels with every upload.
#
# usage: make_upload.sh OUT_DIR        (e.g. .gpu, which .gitignore already ignores)
#   -> OUT_DIR/up1 .. OUT_DIR/upN and OUT_DIR/MANIFEST.sha256 (also inside the last folder)
# Then see experiments/gpu_host/README.md: upload each folder, copy it into /tmp/wh on
# the host, and run `bash experiments/gpu_host/install_on_host.sh` from the checkout.
set -euo pipefail
OUT=${1:?usage: make_upload.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VLLM=${VLLM_VERSION:-0.26.0}
REQS="$HERE/host-requirements-vllm-$VLLM.txt"
[ -f "$REQS" ] || { echo "no $REQS: only vLLM versions with a requirements list are supported" >&2; exit 2; }
PART_MIB=${PART_MIB:-57}   # vLLM wheel parts (the checkout travels too: lower both when it grows)
FOLDER_MIB=${FOLDER_MIB:-60} # small files per folder
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The host: CPython 3.12, x86_64, glibc new enough for manylinux_2_35 wheels.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for tag in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLAT+=(--platform "${tag}_x86_64")
done

mkdir -p "$TMP/big" "$TMP/small"
echo "downloading vllm==$VLLM ..."
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/big" "vllm==$VLLM"
python3 "$HERE/slim_wheel.py" "$TMP/big"/vllm-*.whl "$TMP/slim" | tail -1
echo "downloading NIXL and vLLM's missing dependencies ..."
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/small" nixl==1.5.1 nixl-cu13==1.5.1 setuptools==81.0.0
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/small" -r "$REQS"
echo "downloading the kvcached source archive ..."
python3 "$HERE/fetch_sdist.py" kvcached 0.1.6 "$TMP/small" >/dev/null
ls "$TMP/small"/kvcached-0.1.6.* >/dev/null

rm -rf "$OUT"
mkdir -p "$OUT"
WHEEL=$(ls "$TMP/slim"/vllm-*.whl)
sha256sum "$WHEEL" | awk '{print $1}' > "$TMP/small/vllm.sha256"
basename "$WHEEL" > "$TMP/small/vllm.name"
split -b "${PART_MIB}M" -d -a 2 "$WHEEL" "$TMP/part."
n=0
for part in "$TMP"/part.*; do
  n=$((n + 1)); mkdir -p "$OUT/up$n"
  mv "$part" "$OUT/up$n/vllm.whl.${part##*.}"
done
# first-fit by size, largest first, into folders of <= FOLDER_MIB
n=$((n + 1)); mkdir -p "$OUT/up$n"; used=0
while read -r f; do
  s=$(stat -c %s "$TMP/small/$f")
  if [ $((used + s)) -gt $((FOLDER_MIB * 1024 * 1024)) ]; then
    n=$((n + 1)); mkdir -p "$OUT/up$n"; used=0
  fi
  cp "$TMP/small/$f" "$OUT/up$n/"
  used=$((used + s))
done < <(ls -S "$TMP/small")
# A manifest of every file, so the host can tell a missing or damaged upload at once.
(cd "$OUT" && find . -path ./MANIFEST.sha256 -prune -o -type f -printf '%P\n' | sort \
   | while read -r p; do printf '%s  %s\n' "$(sha256sum "$p" | awk '{print $1}')" "$(basename "$p")"; done) \
   > "$OUT/MANIFEST.sha256"
cp "$OUT/MANIFEST.sha256" "$OUT/up$n/"
du -sh "$OUT"/up*
echo "upload $OUT/up1 .. $OUT/up$n one per command, each copied into /tmp/wh on the host;"
echo "then, from the checkout on the host: bash experiments/gpu_host/install_on_host.sh"
