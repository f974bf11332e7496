#!/usr/bin/env bash
# Build DeepEP from your own checkout for this environment's torch and CUDA, and install it.
#
# Usage: benchmarks/build_deepep.sh [--arch X.Y] [--jobs N] [--inplace] [--check] [--dry-run]
#                                   /path/to/DeepEP
#
# The checkout (https://github.com/deepseek-ai/DeepEP) decides what you get:
#   tag v1.2.1         the V1 Buffer (dispatch/combine): the `deepep` backend (and `te`'s)
#   branch hybrid-ep   the V1 Buffer plus HybridEPBuffer: also `hybridep_megatron`
#   main (V2)          needs NCCL >= 2.30.4, newer than torch 2.11 bundles (2.28.9); not used here
# Do not `pip install deep-ep` from PyPI: its 1.0.0 is a stale early sdist.
#
# Options:
#   --arch X.Y   compute capability to build for (TORCH_CUDA_ARCH_LIST); default: the visible
#                GPU's, else 9.0 (Hopper). hybrid-ep alone would default to 10.0, so it is always
#                set. Below 9.0 the build drops DeepEP's SM90 features (NVSHMEM must be absent).
#   --jobs N     parallel compile jobs (MAX_JOBS); default: this machine's cores
#   --inplace    `python setup.py build_ext --inplace` and print the PYTHONPATH to export,
#                instead of `pip install --no-build-isolation .` of the checkout (the default)
#   --check      after building, import deep_ep and print Buffer (and HybridEPBuffer)
#   --dry-run    print the environment and the commands, build nothing
#   -h, --help   this text
#
# NVSHMEM: when NVSHMEM_DIR is set or the NVSHMEM wheel (nvidia-nvshmem-cu12/-cu13, module
# nvidia.nvshmem) is importable, DeepEP builds its internode kernels too, and its C++ side then
# needs CUDA's CCCL headers on CPATH ($CUDA_HOME/include/cccl, for CUDA 13); without NVSHMEM it
# builds intranode kernels only (-DDISABLE_NVSHMEM), enough for EP within one node.
# Env: PYTHON (default python3, the environment's torch), CUDA_HOME (default: nvcc on PATH, else
# /usr/local/cuda), NVSHMEM_DIR.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
warn() { echo "warning: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
value() { [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value (see --help)"; }

arch="" jobs="" inplace=0 check=0 dry_run=0 src=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --arch) value "$@"; arch=$2; shift 2 ;;
    --arch=*) arch=${1#*=}; shift ;;
    --jobs | -j) value "$@"; jobs=$2; shift 2 ;;
    --jobs=*) jobs=${1#*=}; shift ;;
    --inplace) inplace=1; shift ;;
    --check) check=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) die "option $1 is unknown: allowed --arch, --jobs, --inplace, --check, --dry-run, --help" ;;
    *) [[ -z $src ]] || die "one DeepEP checkout expected, got '$src' and '$1'"
       src=$1; shift ;;
  esac
done

# --- the arguments ------------------------------------------------------------------------------
if [[ -n $arch ]] && ! [[ $arch =~ ^([1-9][0-9]*)\.[0-9]$ && ${BASH_REMATCH[1]} -ge 8 ]]; then
  die "arch='$arch' is invalid: allowed MAJOR.MINOR of at least 8.0, e.g. 9.0 (Hopper), 10.0"
fi
if [[ -n $jobs ]] && ! [[ $jobs =~ ^[1-9][0-9]*$ ]]; then
  die "jobs='$jobs' is invalid: allowed a positive integer"
fi
[[ -n $src ]] || die "no DeepEP checkout given: usage: $0 [options] /path/to/DeepEP (--help)"
[[ -e $src ]] || die "DeepEP checkout '$src' does not exist: clone it first" \
  "(git clone -b v1.2.1 https://github.com/deepseek-ai/DeepEP)"
[[ -d $src ]] || die "'$src' is not a DeepEP checkout: it is a file, not a folder"
src=$(cd "$src" && pwd -P)
[[ -f $src/setup.py && -d $src/deep_ep ]] \
  || die "'$src' is not a DeepEP checkout (no setup.py or no deep_ep/ folder)"

if [[ -f $src/deep_ep/hybrid_ep_buffer.py ]]; then
  flavour="hybrid-ep" api="V1 Buffer + HybridEPBuffer: deepep and hybridep_megatron"
elif [[ -d $src/deep_ep/buffers ]]; then
  flavour="main" api="V2 ElasticBuffer: no mokbench backend uses it"
else
  flavour="v1" api="V1 Buffer: the deepep backend"
fi
rev=""
if command -v git > /dev/null && git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then
  rev=$(git -C "$src" describe --tags --exact-match 2> /dev/null \
    || git -C "$src" rev-parse --abbrev-ref HEAD 2> /dev/null || true)
fi

# --- python and torch -----------------------------------------------------------------------------
python=${PYTHON:-python3}
command -v "$python" > /dev/null || die "python '$python' not found: set PYTHON to your env's python"
python=$(command -v "$python")
probe=$("$python" - 2> /dev/null << 'EOF' || true
import importlib.util
import sys
from pathlib import Path

print(f"python={sys.executable}")

try:
    import torch
except Exception as exc:  # reported by the script as one line
    print(f"torch_error={type(exc).__name__}: {exc}")
    raise SystemExit(0)
print(f"torch={torch.__version__}")
print(f"torch_cuda={torch.version.cuda or ''}")
try:
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
except Exception:  # no usable GPU: the default arch applies
    cap = None
print(f"gpu_arch={'%d.%d' % cap if cap else ''}")
try:
    print("nccl=" + ".".join(map(str, torch.cuda.nccl.version())))
except Exception:  # a CPU build has no NCCL
    print("nccl=")
try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
    where = list(spec.submodule_search_locations or []) if spec else []
except Exception:  # no nvidia namespace package
    where = []
# as DeepEP's setup.py: the wheel counts when it holds libnvshmem_host.so.*
found = [w for w in where if any(Path(w, "lib").glob("libnvshmem_host.so*"))]
print(f"nvshmem={found[0] if found else ''}")
try:
    from importlib.metadata import version
    print(f"installed={version('deep_ep')}")
except Exception:  # not installed
    print("installed=")
EOF
)
get() { sed -n "s/^$1=//p" <<< "$probe" | head -n 1; }
[[ -n $probe ]] || die "$python could not run: set PYTHON to your environment's python"
python=$(get python)
torch_error=$(get torch_error)
[[ -z $torch_error ]] || die "torch is not importable by $python ($torch_error):" \
  "install a CUDA build of PyTorch in this environment first"
torch_version=$(get torch) torch_cuda=$(get torch_cuda) nccl=$(get nccl)
[[ -n $torch_cuda ]] || die "torch $torch_version is a CPU-only build: DeepEP needs a CUDA build"

# --- CUDA toolkit ---------------------------------------------------------------------------------
cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
if [[ -z $cuda_home ]]; then
  if nvcc_path=$(command -v nvcc); then
    cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
    # a wrapper script (/usr/local/bin/nvcc) is not a toolkit: fall back to the usual one
    [[ -f $cuda_home/include/cuda_runtime.h || ! -x /usr/local/cuda/bin/nvcc ]] \
      || cuda_home=/usr/local/cuda
  else
    cuda_home=/usr/local/cuda
  fi
fi
nvcc=$cuda_home/bin/nvcc
[[ -x $nvcc ]] || die "nvcc not found ($nvcc): DeepEP compiles CUDA kernels; install a CUDA" \
  "toolkit >= 12.3 and set CUDA_HOME (or put its bin/ on PATH)"
nvcc_cuda=$("$nvcc" --version 2> /dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' \
  | head -n 1 || true)
[[ -n $nvcc_cuda ]] || die "$nvcc --version names no CUDA release: allowed a CUDA toolkit's nvcc"
IFS=. read -r nvcc_major nvcc_minor <<< "$nvcc_cuda"
((nvcc_major > 12 || (nvcc_major == 12 && nvcc_minor >= 3))) \
  || die "nvcc is CUDA $nvcc_cuda ($nvcc): DeepEP needs CUDA >= 12.3"
[[ ${torch_cuda%%.*} == "$nvcc_major" ]] || die "nvcc is CUDA $nvcc_cuda but torch" \
  "$torch_version was built with CUDA $torch_cuda: set CUDA_HOME to a CUDA ${torch_cuda%%.*} toolkit"

# --- the build's settings -------------------------------------------------------------------------
arch_note="given"
if [[ -z $arch ]]; then
  arch=$(get gpu_arch) arch_note="this GPU"
  [[ -n $arch ]] || arch=9.0 arch_note="default: no GPU visible"
fi
[[ -n $jobs ]] || jobs=$(nproc 2> /dev/null || getconf _NPROCESSORS_ONLN)
nvshmem=${NVSHMEM_DIR:-$(get nvshmem)}
[[ -z ${NVSHMEM_DIR:-} || -d $NVSHMEM_DIR ]] \
  || die "NVSHMEM_DIR='$NVSHMEM_DIR' is not a folder: allowed an NVSHMEM install, or unset it"
env_names=(TORCH_CUDA_ARCH_LIST MAX_JOBS CUDA_HOME)
export TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$jobs CUDA_HOME=$cuda_home
if [[ -n $nvshmem ]]; then
  nvshmem_note="NVSHMEM at $nvshmem: intranode and internode kernels"
  export CPATH=$cuda_home/include/cccl:$cuda_home/include${CPATH:+:$CPATH}
  env_names+=(CPATH)
else
  nvshmem_note="no NVSHMEM (NVSHMEM_DIR unset, nvidia.nvshmem not importable): intranode kernels"
  nvshmem_note+=" only (-DDISABLE_NVSHMEM); for internode: pip install nvidia-nvshmem-cu$nvcc_major"
fi
if ((${arch%%.*} < 9)); then
  [[ -z $nvshmem ]] || die "arch=$arch builds DeepEP without its SM90 features, which DeepEP" \
    "allows only without NVSHMEM, but NVSHMEM is at $nvshmem: allowed arch 9.0 or above here"
  export DISABLE_SM90_FEATURES=1
  env_names+=(DISABLE_SM90_FEATURES)
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
env_names+=(NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS)

if ((inplace)); then
  build=("$python" setup.py build_ext --inplace)
else
  # --no-deps: hybrid-ep asks for pynvml (nvidia-ml-py provides it; an offline pip cannot fetch it)
  build=("$python" -m pip install --no-build-isolation --no-deps .)
fi
check_code="import deep_ep; print(deep_ep.Buffer)"
[[ $flavour != hybrid-ep ]] \
  || check_code+="; print(deep_ep.HybridEPBuffer)"
check_path=""
((inplace == 0)) || check_path=$src${PYTHONPATH:+:$PYTHONPATH}

if [[ $flavour == main ]]; then
  warn "this checkout is DeepEP main (V2 API): it needs NCCL >= 2.30.4 (torch $torch_version" \
    "bundles ${nccl:-an unknown NCCL}), and mokbench's adapters use the V1 Buffer of tag v1.2.1" \
    "or branch hybrid-ep"
fi
installed=$(get installed)
[[ $installed != 1.0.0 ]] || warn "the installed deep_ep 1.0.0 looks like PyPI's stale sdist;" \
  "this build replaces it (pip uninstall deep-ep if the import still finds it)"

# --- say it, then do it ---------------------------------------------------------------------------
echo "DeepEP checkout: $src (git: ${rev:-none}; $api)"
echo "torch $torch_version (CUDA $torch_cuda, NCCL ${nccl:-?}); nvcc CUDA $nvcc_cuda ($nvcc)"
echo "arch $arch ($arch_note); $jobs jobs; $nvshmem_note"
echo "environment:"
for name in "${env_names[@]}"; do
  printf '  export %s=%q\n' "$name" "${!name}"
done
echo "build:"
printf '  cd %q &&' "$src"
printf ' %q' "${build[@]}"
echo
if ((check)); then
  echo "check:"
  printf '  cd / && '
  [[ -z $check_path ]] || printf 'PYTHONPATH=%q ' "$check_path"
  printf "%q -c '%s'\n" "$python" "$check_code"
fi
if ((dry_run)); then
  echo "dry run: nothing built"
  exit 0
fi

start=$SECONDS
if ! (cd "$src" && "${build[@]}"); then
  echo "error: the DeepEP build failed after $((SECONDS - start)) s (its output is above)" >&2
  exit 1
fi
took=$((SECONDS - start))
what=$([[ $inplace == 1 ]] && echo "built in place" || echo "built and installed")
echo "DeepEP ($flavour) $what in $((took / 60)) min $((took % 60)) s"
if ((inplace)); then
  echo "to import it from here:"
  printf '  export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$src"
fi
if ((check)); then
  (cd / && PYTHONPATH=${check_path:-${PYTHONPATH:-}} "$python" -c "$check_code") \
    || { echo "error: the build finished but 'import deep_ep' failed (above)" >&2; exit 1; }
fi
[[ $flavour != hybrid-ep ]] || echo "HybridEP JIT-compiles its kernels at run time: keep" \
  "CUDA_HOME=$cuda_home (nvcc) reachable when you run it"
# A statically linked C++ runtime crashes HybridEPBuffer. baselines.hybridep_megatron's
# hybridep_runtime_reason says so at run time; here its ELF check (native_libs, standard
# library only) is called directly, without importing torch.
if [[ $flavour == hybrid-ep ]]; then
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  runtime=$(cd / && PYTHONPATH=$repo${check_path:+:$check_path}${PYTHONPATH:+:$PYTHONPATH} \
    "$python" -c 'import importlib.util as u
from baselines.native_libs import elf_needed, static_cxx_runtime_reason as why
s = u.find_spec("hybrid_ep_cpp")
print(why(elf_needed(s.origin), "") or "" if s and s.origin else "")' 2>/dev/null) || runtime=""
  [[ -z $runtime ]] || echo "warning: $runtime" >&2
fi
echo "run with: export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
