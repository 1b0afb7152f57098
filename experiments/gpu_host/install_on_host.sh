#!/usr/bin/env bash
# Run ON the offline GPU host, from the uploaded checkout, once every folder made by
# make_upload.sh has been copied into /tmp/wh (WH=... to use another place).
#
#   bash experiments/gpu_host/install_on_host.sh [--force-models]
#
# 1. checks the uploads against MANIFEST.sha256, naming the upload folders (LAYOUT.txt)
#    to send again when a file is missing or damaged;
# 2. reassembles the wheels that were cut into parts and checks them (SPLIT.sha256);
# 3. installs every wheel with pip --no-index --no-deps into the host's python. For vLLM
#    0.27+ the uploads carry torch (2.13 up to vLLM 0.32, 2.14 for 0.33), triton, NCCL and
#    torchvision, which replace the image's torch 2.11.0+cu130 stack (its versions are
#    printed first); for 0.26.0 the image's torch stays. Then it reports, without
#    stopping, where a package the image keeps is older than a carried one requires;
# 4. checks the GPU stack: a bf16 matmul, a Triton kernel, a cuDNN convolution (a failure
#    there is only reported: the experiments use none), then `import vllm`;
# 5. builds kvcached 0.1.6 from source against the installed torch (about 20 s);
# 6. installs kvcached-pd from a snapshot of this checkout (--no-deps --no-build-isolation);
# 7. writes the test models: /tmp/tiny (equivalence) and /tmp/kvbig (transfer benchmark).
# Safe to run again (e.g. after uploading a newer checkout: only step 6 changes).
set -euo pipefail
WH=${WH:-/tmp/wh}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FORCE_MODELS=0
[ "${1:-}" = "--force-models" ] && FORCE_MODELS=1
t0=$(date +%s)
die() { echo "install_on_host.sh: $*" >&2; exit 1; }

[ -d "$WH" ] || die "no $WH: copy every upload folder into it first (mkdir -p $WH && cp .../upN/* $WH/)"
cd "$WH"
rm -f ./*.tmp  # a reassembly cut short
for f in MANIFEST.sha256 SPLIT.sha256 LAYOUT.txt; do
  [ -f "$f" ] || die "no $f in $WH: no upload made by this checkout's make_upload.sh arrived"
done

# the upload folders that hold the files named on stdin, for the messages
folders_of() { awk 'NR == FNR {want[$0] = 1; next} ($2 in want) {print $1}' - LAYOUT.txt \
               | sort -u -V | tr '\n' ' '; }
# the parts a wheel was cut into
parts_of() { awk -v n="$1.part" 'index($2, n) == 1 {print $2}' LAYOUT.txt; }

# A wheel or archive of another upload set (say 0.26.0's, on a host still warm) would be
# installed beside this set's, and two versions of a package stop pip.
stale=$(ls | grep -E '\.(whl|tar\.gz)$' | grep -vxF -f <(awk '{print $2}' LAYOUT.txt; awk '{print $2}' SPLIT.sha256) || true)
[ -z "$stale" ] || die "$WH holds files of another upload set: rm" $stale

# 1. Every part and file arrived, and is intact. The parts of a wheel already reassembled
#    (an earlier run) are gone on purpose; SPLIT.sha256 checks that wheel below.
missing=$(while read -r _ name; do
  [ -f "$name" ] && continue
  if [[ "$name" =~ ^(.+)\.part[0-9][0-9]$ ]] && [ -f "${BASH_REMATCH[1]}" ]; then continue; fi
  echo "$name"
done < LAYOUT.txt)
if [ -n "$missing" ]; then
  echo "missing from $WH:" $missing >&2
  die "upload again: $(echo "$missing" | folders_of)"
fi
bad=$(awk '{name = substr($0, 67)} system("test -f \"" name "\"") == 0' MANIFEST.sha256 \
      | sha256sum -c - 2>/dev/null | sed -n 's/: FAILED.*$//p' || true)
if [ -n "$bad" ]; then
  echo "damaged in $WH:" $bad >&2
  (rm -f $bad)
  die "upload again: $(echo "$bad" | folders_of)"
fi

# 2. Reassemble the wheels that were cut into parts (in name order: .part00, .part01, ...).
while read -r sum name; do
  [ -n "$name" ] || continue
  if [ -f "$name.part00" ]; then
    cat "$name".part[0-9][0-9] > "$name.tmp" && mv "$name.tmp" "$name"
  fi
  if ! echo "$sum  $name" | sha256sum -c --quiet - 2>/dev/null; then
    rm -f "$name"
    die "$name does not match SPLIT.sha256: upload again: $(parts_of "$name" | folders_of)"
  fi
  rm -f "$name".part[0-9][0-9]
done < SPLIT.sha256

# 3. Install. Where torch is carried it replaces the image's: show what it replaces.
if ls torch-*.whl >/dev/null 2>&1; then
  "$PY" - <<'PYEOF'
from importlib import metadata
for d in ("torch", "triton", "torchvision", "torchaudio", "nvidia-nccl-cu13", "nvidia-cudnn-cu13",
          "nvidia-cublas", "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13", "nvidia-cuda-runtime",
          "cuda-toolkit", "cuda-bindings", "setuptools", "numba"):
    try:
        v = metadata.version(d)
    except metadata.PackageNotFoundError:
        v = "-"
    print(f"before: {d:<24} {v}")
PYEOF
fi
"$PY" -m pip install -q --no-index --no-deps --no-cache-dir --no-compile ./*.whl
# What the image keeps below what a carried package declares (e.g. vLLM 0.33's floors on
# requests, certifi, aiohttp, pillow, whose versions on the image were never read): only
# reported, as --no-deps installs without looking; numba and numpy<2.4 (mistral-common) are
# known and served vLLM 0.30 (see the requirements list).
carried=$(ls ./*.whl | sed 's#^\./##; s/-.*//' | tr 'A-Z_.' 'a-z--' | sort -u)
"$PY" -m pip check 2>/dev/null | grep ' has requirement ' \
  | awk 'NR == FNR {c[$1] = 1; next} {n = tolower($1); gsub(/[_.]/, "-", n)} n in c' \
      <(echo "$carried") - | sed 's/^/note: /' || true

# 4. The GPU stack works before anything is built on it. From a file: Triton reads a
#    kernel's source, which a script on stdin does not have.
smoke=$(mktemp --suffix=.py)
cat > "$smoke" <<'PYEOF'
import os, sys
import torch
import triton
import triton.language as tl



def loaded_nccl() -> str:
    """The NCCL this process loaded (torch.cuda.nccl.version() is the one torch was built
    with)."""
    import ctypes

    for line in open("/proc/self/maps"):
        if "libnccl.so" in line:
            path = line.split()[-1]
            code = ctypes.c_int()
            ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
            return f"{code.value} from {path}"
    return "not loaded"


print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"NCCL built {'.'.join(map(str, torch.cuda.nccl.version()))} / loaded {loaded_nccl()}, "
      f"cuDNN built {torch._C._cudnn.getCompileVersion()} / loaded "
      f"{torch._C._cudnn.getRuntimeVersion()}")
assert torch.cuda.is_available(), "torch sees no GPU"
a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
ref = a.float() @ a.float()
err = ((a @ a).float() - ref).abs().max().item() / ref.abs().max().item()
assert err < 1e-2, f"bf16 matmul off by {err:.3g} (relative)"


@triton.jit
def _add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)


x = torch.randn(5000, device="cuda")
out = torch.empty_like(x)
_add[(triton.cdiv(5000, 1024),)](x, x, out, 5000, BLOCK=1024)
assert torch.equal(out, x + x), "Triton kernel gave a wrong sum"
try:
    w = torch.randn(8, 3, 3, 3, device="cuda")
    torch.nn.functional.conv2d(torch.randn(2, 3, 32, 32, device="cuda"), w)
    torch.cuda.synchronize()
    print("cuDNN convolution: ok")
except Exception as e:  # the experiments run no convolution
    print(f"WARNING: cuDNN convolution failed ({type(e).__name__}: {e}); "
          "vLLM's text models do not use cuDNN", file=sys.stderr)
import vllm
print(f"vllm {vllm.__version__}: GPU stack ok")
PYEOF
"$PY" "$smoke"
rm -f "$smoke"

# 5. kvcached ships as a source archive: build it against the installed CUDA torch, offline.
#    kvcached 0.1.6 builds against libtorch's stable ABI (torch >= 2.10), so a build made
#    before torch was replaced keeps working.
if ! "$PY" -c "import kvcached.integration.vllm.interfaces" 2>/dev/null; then
  # One of the two paths is always missing, so ls fails: under pipefail that ended this
  # script silently on the host (2026-11-21), before kvcached was built.
  libcuda=$( (ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null || true) | head -1)
  [ -n "$libcuda" ] || die "no libcuda.so.1 found: cannot build kvcached"
  ln -sf "$libcuda" /tmp/libcuda.so
  LIBRARY_PATH=/tmp:/usr/local/cuda/lib64/stubs:${LIBRARY_PATH:-} \
    "$PY" -m pip install -q --no-build-isolation --no-index --no-deps --no-cache-dir ./kvcached-*.tar.gz
fi

# 6. kvcached-pd from this checkout. --no-build-isolation: build with the host's setuptools
# (installed above), as there is no index to fetch a build environment from. Built from a
# snapshot of the checkout: pip builds in the source tree, and the device tool copies the
# working tree again on every later call (the next upload folders). On 2026-11-27 this
# build, started with the last 0.26.0 upload and followed by 33 more calls, ended in
# "Failed building wheel for kvcached-pd" (only the log's tail came back, so the race is
# the likely cause, not a proven one), while the same tree copied to /tmp first built fine
# for vLLM 0.30.0 in the same lease.
SNAP=$(mktemp -d /tmp/kvpd-src.XXXXXX)
tar -C "$REPO" --exclude='./.gpu*' --exclude='./.venv*' --exclude=./.cache --exclude=./.git \
  --exclude=./build --exclude='./*.egg-info' -cf - . | tar -C "$SNAP" -xf -
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir "$SNAP"
rm -rf "$SNAP"

"$PY" - <<'PYEOF'
import importlib
for mod in ("torch", "triton", "vllm", "nixl", "kvcached.integration.vllm.interfaces", "wrapt",
            "kvcached_pd"):
    m = importlib.import_module(mod)
    print(f"{mod:<40} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
PYEOF

make_model() {  # OUT PRESET
  if [ $FORCE_MODELS = 1 ] || [ ! -f "$1/config.json" ] || [ ! -f "$1/kvpd_model_info.json" ]; then
    rm -rf "$1"
    "$PY" "$REPO/experiments/gpu_host/make_test_model.py" "$1" --preset "$2" 2>&1 | grep -v "Writing model shards" | tail -1
  else
    echo "$1 exists (--force-models to rebuild)"
  fi
}
make_model /tmp/tiny tiny
make_model /tmp/kvbig kvbig
echo "install_on_host.sh: done in $(( $(date +%s) - t0 ))s"
