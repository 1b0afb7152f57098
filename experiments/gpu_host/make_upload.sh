#!/usr/bin/env bash
# Build, on a machine that reaches PyPI, every wheel the offline 2xH200 GPU host needs to
# run kvcached-pd's experiments: vLLM (slimmed for Hopper), NIXL 1.5.1 + nixl-cu13, the
# packages of host-requirements-vllm-$VLLM_VERSION.txt (vLLM's missing dependencies,
# wrapt for kvcached-pd; for vLLM 0.27+ also torch, triton, NCCL and torchvision, which
# replace the image's), and the kvcached 0.1.6 source archive. pack_uploads.py then cuts
# the wheels larger than a folder into parts and packs everything into the fewest upload
# folders of at most FOLDER_MIB: the host accepts 64 MiB per command, and the checkout
# travels with every upload.
#
# usage: [VLLM_VERSION=0.26.0] [PART_MIB=40] [FOLDER_MIB=40] make_upload.sh OUT_DIR
#   (both default to 40, or to what the checkout leaves of 64 MiB less 4 when that is less)
#   -> OUT_DIR/up1 .. OUT_DIR/upN, each with MANIFEST.sha256, SPLIT.sha256 and LAYOUT.txt
# OUT_DIR is replaced; keep it inside the checkout but ignored (e.g. .gpu, which .gitignore
# ignores, or a folder named in .git/info/exclude).
# Then see experiments/gpu_host/README.md: upload each folder, copy it into /tmp/wh on
# the host, and run `bash experiments/gpu_host/install_on_host.sh` from the checkout.
set -euo pipefail
OUT=${1:?usage: make_upload.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VLLM=${VLLM_VERSION:-0.26.0}
REQS="$HERE/host-requirements-vllm-$VLLM.txt"
[ -f "$REQS" ] || { echo "no $REQS: only vLLM versions with a requirements list are supported" >&2; exit 2; }
# A folder + the checkout stays under the 64 MiB a command takes (the checkout was 8 MiB
# early in 2026-11 and 17 MiB on 2026-11-26, when 50 MiB folders no longer fit): lower
# both when the checkout grows (the warning below says when).
# What travels beside each folder: the checkout's tracked and untracked, not ignored files.
REPO=$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null || true)
tree=0
if [ -n "$REPO" ]; then
  tree=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
         | { xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
fi
# Default: 40 MiB, or less where the checkout leaves less, with 4 MiB for what the
# checkout gains before the lease (check_uploads.sh tells, before a lease, whether
# folders built earlier still fit).
room=$(( (64 * 1024 * 1024 - tree) / 1024 / 1024 - 4 ))
PART_MIB=${PART_MIB:-$(( room < 40 ? room : 40 ))}     # parts of the wheels larger than a folder
FOLDER_MIB=${FOLDER_MIB:-$(( room < 40 ? room : 40 ))} # each upload folder
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ -n "$REPO" ]; then
  if [ $((tree + FOLDER_MIB * 1024 * 1024)) -gt $((64 * 1024 * 1024)) ]; then
    echo "warning: the checkout ($((tree / 1024)) KiB) + FOLDER_MIB=$FOLDER_MIB exceed the" \
         "64 MiB a command takes: lower FOLDER_MIB and PART_MIB" >&2
  fi
fi

# The host: CPython 3.12, x86_64, glibc new enough for manylinux_2_35 wheels. NCCL's
# wheels are tagged manylinux_2_18 alone, so every tag from 2_5 to 2_35 is named.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 5 35); do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done

mkdir -p "$TMP/dl" "$TMP/wh"
echo "downloading vllm==$VLLM ..."
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" "vllm==$VLLM"
echo "downloading NIXL and $(grep -cv '^\s*\(#\|$\)' "$REQS") packages of $(basename "$REQS") ..."
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" nixl==1.5.1 nixl-cu13==1.5.1
# kvcached-pd and kvcached build with the host's setuptools: a list that pins none gets 81.0.0
grep -qi '^setuptools==' "$REQS" || pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" setuptools==81.0.0
pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" -r "$REQS"
dups=$(ls "$TMP/dl" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups (one stops the whole install)" >&2; exit 1; }
echo "downloading the kvcached source archive ..."
python3 "$HERE/fetch_sdist.py" kvcached 0.1.6 "$TMP/wh" >/dev/null
ls "$TMP/wh"/kvcached-0.1.6.* >/dev/null

# The torch the host will run: the one carried, else the image's (2.11).
TORCH=$(sed -n 's/^torch==\([0-9][0-9.]*\).*/\1/p' "$REQS")
TORCH=${TORCH:-2.11}
echo "slimming vLLM, Triton and nixl-cu13 (for torch $TORCH) ..."
for w in "$TMP/dl"/*.whl; do
  case "$(basename "$w")" in
    vllm-*|triton-*|nixl_cu1[23]-*)
      python3 "$HERE/slim_wheel.py" "$w" "$TMP/wh" --torch "$TORCH" | tail -1 ;;
    *) mv "$w" "$TMP/wh/" ;;
  esac
done

python3 "$HERE/pack_uploads.py" "$TMP/wh" "$OUT" --folder-mib "$FOLDER_MIB" --part-mib "$PART_MIB" | tail -1
du -sh "$OUT"/up*
n=$(ls -d "$OUT"/up* | wc -l)
echo "upload $OUT/up1 .. $OUT/up$n one per command, each copied into /tmp/wh on the host;"
echo "then, from the checkout on the host: bash experiments/gpu_host/install_on_host.sh"
