#!/usr/bin/env bash
# Build DeepEP (v1) and DeepGEMM against the installed torch and install them into one folder.
#
#   tools/build_gpu_deps.sh --target DIR [--src DIR] [--deepep SRC] [--deepgemm SRC] [--fmt SRC]
#                           [--cutlass-include DIR | --cutlass-wheel WHL] [--only deepep|deepgemm]
#                           [--jobs N] [--work DIR] [--pack FILE.tar.xz] [--python PY]
#                           [--prepare-only] [--check] [--strip]
#
# SRC is a source folder or a git URL (cloned at the pinned commit; needs network). --src DIR
# is a folder holding DeepEP/, DeepGEMM/ and fmt/ (the defaults for the three). The two builds
# run in parallel, each in a copy of its source under --work (the sources stay untouched), each
# pip-installed into its own folder and merged into --target; then `export
# PYTHONPATH=DIR:$PYTHONPATH` makes `import deep_ep, deep_gemm` work. --pack writes the target as
# an xz tarball (split into <15 MiB parts FILE.partNN when larger). --prepare-only stops after
# assembling the source trees under --work (no compiler needed; what the tests check). --check
# imports both from the target and, with a GPU, runs a DeepGEMM GEMM (JIT) against torch.
# --strip drops the modules' debug info (DeepEP 26 -> 15 MB, DeepGEMM 19 -> 1.3 MB).
#
# Pinned: DeepEP v1 (deepseek-ai/DeepEP 567632d, the last v1; main is v2 and needs NCCL >= 2.30),
# DeepGEMM sgl-project/DeepGEMM a348cd9 (2.5.0), fmt 553ec11e (DeepGEMM's submodule pin).
# The fixes this applies (each one was a failure seen on an H200 image with torch 2.11+cu130):
# - DeepGEMM is compiled by the system g++ (/usr/bin/g++, CC=/usr/bin/gcc): the C++ runtime the
#   process loads is that compiler's libstdc++; another g++ (e.g. /opt/gcc) builds a module that
#   segfaults in std::regex on the first GEMM.
# - DG_FORCE_BUILD=1 (else setup.py tries to download a prebuilt wheel), DG_USE_LOCAL_VERSION=0
#   (else it asks git for a revision), pip --no-build-isolation --no-deps (build against the
#   torch that is installed, install nothing else).
# - A source snapshot has no submodules: CUTLASS/CuTe headers come from --cutlass-include (a
#   folder holding cute/ and cutlass/) or the sgl-deep-gemm wheel's deep_gemm/include/
#   (--cutlass-wheel), fmt's include/ from --fmt. They are installed inside deep_gemm/include/,
#   which DeepGEMM's JIT reads at run time (it compiles each new GEMM shape on first use; the
#   include path is <deep_gemm package>/include, so the installed tree must keep it).
# - CUDA 13 keeps libcu++ (cuda/std/...) under $CUDA_HOME/include/cccl: added for DeepEP.
# - The NVSHMEM pip package ships libnvshmem_host.so.3 and no unversioned .so: DeepEP's setup
#   finds the versioned name only when NVSHMEM_DIR is unset, so it is unset here.
set -euo pipefail

DEEPEP_COMMIT=567632dd59810d77b3cc05553df953cc0f779799
DEEPGEMM_COMMIT=a348cd95a8ddfd3ef337b595d8e8b841c0d9cf0f
FMT_COMMIT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
DEEPEP_URL=https://github.com/deepseek-ai/DeepEP.git
DEEPGEMM_URL=https://github.com/sgl-project/DeepGEMM.git
FMT_URL=https://github.com/fmtlib/fmt.git

die() { echo "build_gpu_deps: $*" >&2; exit 2; }
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

SRC="" DEEPEP="" DEEPGEMM="" FMT="" CUTLASS_INC="" CUTLASS_WHL="" ONLY="" TARGET="" PACK=""
JOBS="" WORK="" PREPARE_ONLY=0 CHECK=0 STRIP=0 PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --src) SRC=$2; shift 2 ;;
    --deepep) DEEPEP=$2; shift 2 ;;
    --deepgemm) DEEPGEMM=$2; shift 2 ;;
    --fmt) FMT=$2; shift 2 ;;
    --cutlass-include) CUTLASS_INC=$2; shift 2 ;;
    --cutlass-wheel) CUTLASS_WHL=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    --pack) PACK=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --prepare-only) PREPARE_ONLY=1; shift ;;
    --check) CHECK=1; shift ;;
    --strip) STRIP=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "build_gpu_deps: unknown argument '$1'" >&2; usage 2 ;;
  esac
done
[ -n "$TARGET" ] || die "--target DIR is required (the folder to install deep_ep and deep_gemm into)"
case "$ONLY" in ""|deepep|deepgemm) ;; *) die "--only ($ONLY) must be deepep or deepgemm" ;; esac
[ -n "$SRC" ] && { DEEPEP=${DEEPEP:-$SRC/DeepEP}; DEEPGEMM=${DEEPGEMM:-$SRC/DeepGEMM}; FMT=${FMT:-$SRC/fmt}; }
DEEPEP=${DEEPEP:-$DEEPEP_URL}; DEEPGEMM=${DEEPGEMM:-$DEEPGEMM_URL}; FMT=${FMT:-$FMT_URL}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ "$PREPARE_ONLY" = 1 ] || [ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc: set CUDA_HOME to the CUDA toolkit"
NPROC=$(nproc)
JOBS=${JOBS:-$(( NPROC > 2 ? NPROC / 2 : 1 ))}
WORK=${WORK:-$(mktemp -d /tmp/epmoe-gpu-build.XXXXXX)}
mkdir -p "$WORK" "$TARGET"
WORK=$(cd "$WORK" && pwd); TARGET=$(cd "$TARGET" && pwd)

[ "$PREPARE_ONLY" = 1 ] || "$PY" - <<'EOF' || die "the build needs torch, setuptools, wheel and packaging in '$PY' (pip install them; ninja is recommended)"
import torch, setuptools, wheel, packaging  # noqa: F401
from torch.utils.cpp_extension import is_ninja_available
print(f"build_gpu_deps: torch {torch.__version__} (CUDA {torch.version.cuda}), ninja: {is_ninja_available()}")
EOF

# fetch SRC (folder or git URL) at COMMIT into DEST (a fresh copy either way)
get_source() {
  local src=$1 commit=$2 dest=$3
  rm -rf "$dest"
  if [ -d "$src" ]; then
    cp -a "$src" "$dest"
  elif [[ "$src" == *://* || "$src" == git@* ]]; then
    git clone -q "$src" "$dest" || die "git clone $src failed (no network? pass a source folder)"
    git -C "$dest" checkout -q "$commit" || die "commit $commit not in $src"
    if [ -f "$dest/.gitmodules" ]; then  # DeepGEMM: cutlass + fmt at their pinned commits
      git -C "$dest" submodule -q update --init --depth 1 || die "submodules of $src failed"
    fi
  else
    die "source '$src' is neither a folder nor a git URL"
  fi
}

fill_cutlass() {  # DeepGEMM's third-party/cutlass/include/{cute,cutlass}
  local dst=$1/third-party/cutlass/include
  if [ -d "$dst/cute" ] && [ -d "$dst/cutlass" ]; then return; fi
  mkdir -p "$dst"
  if [ -n "$CUTLASS_INC" ]; then
    [ -d "$CUTLASS_INC/cute" ] && [ -d "$CUTLASS_INC/cutlass" ] \
      || die "--cutlass-include $CUTLASS_INC must hold cute/ and cutlass/"
    cp -a "$CUTLASS_INC/cute" "$CUTLASS_INC/cutlass" "$dst/"
  elif [ -n "$CUTLASS_WHL" ]; then
    [ -f "$CUTLASS_WHL" ] || die "--cutlass-wheel $CUTLASS_WHL is not a file"
    local tmp="$WORK/cutlass-wheel"
    rm -rf "$tmp"; mkdir -p "$tmp"
    "$PY" - "$CUTLASS_WHL" "$tmp" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = [n for n in z.namelist() if n.startswith(("deep_gemm/include/cute/", "deep_gemm/include/cutlass/"))]
if not names:
    sys.exit(f"{sys.argv[1]} has no deep_gemm/include/cute or cutlass headers")
z.extractall(sys.argv[2], names)
EOF
    cp -a "$tmp/deep_gemm/include/cute" "$tmp/deep_gemm/include/cutlass" "$dst/"
  else
    die "DeepGEMM's third-party/cutlass is empty (a snapshot has no submodules): pass
  --cutlass-include DIR (holding cute/ and cutlass/) or --cutlass-wheel sgl_deep_gemm-*.whl"
  fi
}

fill_fmt() {  # DeepGEMM's third-party/fmt/include
  local dst=$1/third-party/fmt
  if [ -f "$dst/include/fmt/format.h" ]; then return; fi
  get_source "$FMT" "$FMT_COMMIT" "$WORK/fmt"
  [ -f "$WORK/fmt/include/fmt/format.h" ] || die "--fmt $FMT has no include/fmt/format.h"
  mkdir -p "$dst"; rm -rf "$dst/include"; cp -a "$WORK/fmt/include" "$dst/include"
}

build_deepep() {
  local s="$WORK/DeepEP"
  get_source "$DEEPEP" "$DEEPEP_COMMIT" "$s"
  [ -f "$s/setup.py" ] && [ -d "$s/csrc" ] || die "$DEEPEP is not a DeepEP source tree"
  local cccl="$CUDA_HOME/include/cccl"
  [ "$PREPARE_ONLY" = 1 ] && return
  (
    cd "$s"
    unset NVSHMEM_DIR  # let setup.py find pip's nvidia.nvshmem and its libnvshmem_host.so.3
    "$PY" -c "import nvidia.nvshmem" 2>/dev/null \
      || echo "build_gpu_deps: no nvidia.nvshmem package: DeepEP builds without internode/low-latency (pip install nvidia-nvshmem-cu13 for them)"
    if [ -d "$cccl" ]; then
      export CPATH="$cccl${CPATH:+:$CPATH}"
      export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cccl"
    fi
    export CUDA_HOME MAX_JOBS=$JOBS TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir \
      --target "$WORK/out-deepep" .
  )
}

build_deepgemm() {
  local s="$WORK/DeepGEMM"
  get_source "$DEEPGEMM" "$DEEPGEMM_COMMIT" "$s"
  [ -f "$s/setup.py" ] && [ -d "$s/deep_gemm" ] || die "$DEEPGEMM is not a DeepGEMM source tree"
  fill_cutlass "$s"
  fill_fmt "$s"
  [ "$PREPARE_ONLY" = 1 ] && return
  [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] \
    || die "DeepGEMM must be compiled by the system g++ (/usr/bin/g++, the libstdc++ the process loads): install g++"
  (
    cd "$s"
    # nothing machine-specific may be baked into deep_gemm/envs.py
    unset DG_JIT_CACHE_DIR DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_CPP_STANDARD
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDA_HOME MAX_JOBS=$JOBS
    export DG_FORCE_BUILD=1 DG_USE_LOCAL_VERSION=0
    "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir \
      --target "$WORK/out-deepgemm" .
  )
}

names=(deepep deepgemm); [ -n "$ONLY" ] && names=("$ONLY")
pids=()
for n in "${names[@]}"; do
  rm -rf "$WORK/out-$n"
  # a plain background subshell keeps `set -e` (an `if`/`||` around it would switch it off)
  ( t0=$SECONDS; "build_$n" >"$WORK/$n.log" 2>&1
    echo "build_gpu_deps: $n done in $(( SECONDS - t0 )) s" ) &
  pids+=($!)
done
fail=0
for i in "${!names[@]}"; do
  if ! wait "${pids[$i]}"; then
    fail=1
    echo "build_gpu_deps: ${names[$i]} FAILED; last lines of $WORK/${names[$i]}.log:" >&2
    tail -n 60 "$WORK/${names[$i]}.log" >&2
  fi
done
[ "$fail" = 0 ] || die "a build failed (see above)"
if [ "$PREPARE_ONLY" = 1 ]; then echo "build_gpu_deps: sources prepared under $WORK"; exit 0; fi

for n in "${names[@]}"; do cp -a "$WORK/out-$n/." "$TARGET/"; done
if [ "$STRIP" = 1 ]; then
  find "$TARGET" -maxdepth 2 -name "*.so" \( -path "*deep_ep_cpp*" -o -path "*deep_gemm/_C*" \) \
    -exec strip --strip-debug {} +
fi
if [[ " ${names[*]} " == *" deepgemm "* ]]; then
  for d in deep_gemm cute cutlass; do
    [ -d "$TARGET/deep_gemm/include/$d" ] || die "installed deep_gemm lacks include/$d (its JIT needs it at run time)"
  done
fi
echo "build_gpu_deps: installed into $TARGET ($(du -sh "$TARGET" | cut -f1)); use: export PYTHONPATH=$TARGET:\$PYTHONPATH"

if [ "$CHECK" = 1 ]; then
  PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "${names[@]}" <<'EOF' \
    || die "the installed packages failed their check (above)"
import importlib, sys, time
import torch
for n in sys.argv[1:]:
    mod = importlib.import_module({"deepep": "deep_ep", "deepgemm": "deep_gemm"}[n])
    print(f"build_gpu_deps: import {mod.__name__} ok ({mod.__file__})")
if "deepgemm" in sys.argv[1:] and torch.cuda.is_available():
    import deep_gemm
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    deep_gemm.bf16_gemm_nt(a, b, d)
    torch.cuda.synchronize()
    ref = a.float() @ b.float().T
    err = float((d.float() - ref).abs().max() / ref.abs().max())
    print(f"build_gpu_deps: deep_gemm.bf16_gemm_nt 256x384x512 (JIT {time.time() - t0:.1f} s): "
          f"max rel err {err:.1e}")
    assert err < 1e-2, err
EOF
fi

if [ -n "$PACK" ]; then
  tar -C "$TARGET" -cf - . | xz -T0 -6 > "$PACK"
  size=$(stat -c %s "$PACK")
  if [ "$size" -ge $(( 15 * 1024 * 1024 )) ]; then
    split -b 15m -d "$PACK" "$PACK.part"; rm "$PACK"
    echo "build_gpu_deps: packed into $(ls "$PACK".part* | wc -l) parts: cat $PACK.part* | tar xJ -C DIR"
  else
    echo "build_gpu_deps: packed $PACK ($(( size / 1024 )) KiB): tar xJf $PACK -C DIR"
  fi
fi
