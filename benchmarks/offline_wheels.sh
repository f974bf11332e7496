#!/usr/bin/env bash
# TransformerEngine (PyTorch) and Megatron-Core for a GPU machine without a package index, carried
# in batches of a bounded size. See usage() below.
set -euo pipefail

TE_VERSION=${TE_VERSION:-2.20.2}
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
PYDANTIC_VERSION=${PYDANTIC_VERSION:-2.14.4}   # TE asks for any pydantic; this one is pinned
CUDA_MAJOR=${CUDA_MAJOR:-13}
# Installed only where the environment lacks a version that satisfies them (torch's environment
# usually has them): typing-extensions (pydantic's floor), packaging (megatron-core's floor) and
# wheel (transformer-engine-torch's setup.py imports wheel.bdist_wheel).
IF_MISSING=if-missing.txt
PROG=$(basename "$0")
MIB_BYTES=1048576

usage() {
  cat <<EOF
Usage: $PROG download DIR
       $PROG split DIR OUTDIR [MIB]
       $PROG gather BATCHDIR STORE
       $PROG install [--dry-run] [--wait S] STORE

Install TransformerEngine $TE_VERSION (PyTorch, CUDA $CUDA_MAJOR) and Megatron-Core $MCORE_VERSION on a
machine without a package index, when files can only be carried in batches of limited size.

  download DIR          on a machine with an index: fetch into DIR, for CPython 3.12 on
                        manylinux x86_64, the transformer-engine-cu$CUDA_MAJOR core wheel, the
                        transformer-engine wheel, the transformer-engine-torch sdist (built on the
                        target against its torch), the megatron-core wheel, pydantic $PYDANTIC_VERSION
                        and the versions of its dependencies its metadata asks for, and $IF_MISSING
                        (typing-extensions, packaging, wheel: installed only where missing or older)
  split DIR OUTDIR [MIB]
                        split every file over MIB MiB (default 60; leave room for whatever else
                        travels in the same transfer) into parts, write OUTDIR/MANIFEST
                        (sha256 of every original file) and OUTDIR/CONTENTS (sha256, size and batch
                        of every carried piece), and group everything into OUTDIR/batch-1, batch-2,
                        ..., each at most MIB*1.05 MiB in total (MANIFEST and CONTENTS included):
                        carry each batch folder in one transfer
  gather BATCHDIR STORE on the target: move one carried batch's files into STORE (e.g. /tmp/wheels);
                        once per batch; says which batches are still to come
  install STORE         on the target, in the environment to install into: reassemble split files,
                        check every sha256, pip install the wheels (--no-index --no-deps), build
                        transformer-engine-torch from its sdist (--no-build-isolation; env below),
                        then import transformer_engine.pytorch and megatron.core
    --dry-run           reassemble and check, then print the pip and python commands instead of
                        running them
    --wait S            first wait up to S seconds for batches still being gathered (another
                        process gathers them, one per transfer), then install; when S pass
                        with batches missing, name them and install nothing

Environment: PYTHON (default python3; runs pip, and for install it is the environment installed
into); PIP_INDEX_URL (download; default https://pypi.org/simple); NVTE_CUDA_ARCHS (default 90) and
MAX_JOBS (default nproc) for the build; TE_VERSION, MCORE_VERSION, PYDANTIC_VERSION.
download needs pip and unzip; the other subcommands need coreutils, and install needs pip.

Example: $PROG download offline-wheels/dl
         $PROG split offline-wheels/dl offline-wheels/out 48
         then on the target, once per carried batch: $PROG gather batch-N /tmp/wheels
         and at last: $PROG install /tmp/wheels
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 1; }
bad_usage() { echo "$PROG: error: $*" >&2; echo "Run '$PROG --help' for usage." >&2; exit 2; }

mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }
human() { awk -v b="$1" 'BEGIN { if (b < 1048576) printf "%.1f KiB", b / 1024; else printf "%.1f MiB", b / 1048576 }'; }
fsize() { stat -c %s -- "$1"; }
sha() { sha256sum -- "$1" | cut -d' ' -f1; }
# Distribution name as pip compares it: lower case, runs of - _ . as one _.
norm() { printf '%s\n' "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'; }

# Requires-Dist of a wheel without extras and markers, one requirement a line.
requires_dist() {
  unzip -p "$1" '*.dist-info/METADATA' | awk '
    /^\r?$/ { exit }
    sub(/^Requires-Dist: */, "") {
      if ($0 ~ /extra *==/) next
      sub(/ *;.*/, ""); gsub(/[ ()\r]/, ""); print
    }'
}

# ---------------------------------------------------------------------------------------------
cmd_download() {
  [[ $# -eq 1 ]] || bad_usage "download takes one argument: DIR"
  local dir=$1 py=${PYTHON:-python3}
  command -v unzip >/dev/null || die "download needs unzip (to read the wheels' Requires-Dist)"
  mkdir -p -- "$dir"
  local target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
  "$py" -m pip download "${target[@]}" -d "$dir" \
    "transformer-engine-cu${CUDA_MAJOR}==$TE_VERSION" "transformer-engine==$TE_VERSION" \
    "megatron-core==$MCORE_VERSION" "pydantic==$PYDANTIC_VERSION"

  # pydantic's own requirements (pydantic-core is pinned exactly there) and megatron-core's
  # packaging floor, as their metadata states them.
  local req name forced=() helpers=()
  local pyd=("$dir"/pydantic-"$PYDANTIC_VERSION"-*.whl)
  local mcore=("$dir"/megatron_core-"$MCORE_VERSION"-*.whl)
  [[ -f ${pyd[0]} && -f ${mcore[0]} ]] || die "pip download left no pydantic or megatron-core wheel in $dir"
  while read -r req; do
    name=$(norm "$(sed -E 's/[<>=!~].*//' <<<"$req")")
    case $name in
      typing_extensions|packaging|wheel) helpers+=("$req") ;;
      *) forced+=("$req") ;;
    esac
  done < <(requires_dist "${pyd[0]}")
  req=$(requires_dist "${mcore[0]}" | awk '/^packaging([<>=!~]|$)/ { print; exit }')
  helpers+=("${req:-packaging}" wheel)
  {
    echo "# Installed only where the environment lacks a satisfying version."
    printf '%s\n' "${helpers[@]}"
  } >"$dir/$IF_MISSING"
  "$py" -m pip download "${target[@]}" -d "$dir" "${forced[@]}" "${helpers[@]}"

  # transformer-engine-torch as its sdist. Not through pip download: pip prepares an sdist's
  # metadata before saving it, and this one's setup.py needs torch, wheel and a CUDA toolkit to do
  # that. Fetched from the index's simple API instead, checked against the sha256 it lists.
  "$py" - "${PIP_INDEX_URL:-https://pypi.org/simple}" transformer-engine-torch \
    "transformer_engine_torch-$TE_VERSION.tar.gz" "$dir" <<'PY'
import hashlib, json, os, re, sys, urllib.parse, urllib.request
index, project, filename, dest = sys.argv[1:]
url = index.rstrip("/") + "/" + project + "/"
req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json, "
                                           "text/html;q=0.1"})
with urllib.request.urlopen(req, timeout=60) as r:
    body, ctype = r.read().decode(), r.headers.get("Content-Type", "")
if "json" in ctype:
    files = {f["filename"]: (urllib.parse.urljoin(url, f["url"]), f["hashes"].get("sha256"))
             for f in json.loads(body)["files"]}
else:
    files = {}
    for href in re.findall(r'href="([^"]+)"', body):
        link, _, frag = href.partition("#")
        name = urllib.parse.unquote(link.rsplit("/", 1)[-1])
        files[name] = (urllib.parse.urljoin(url, link),
                       frag[7:] if frag.startswith("sha256=") else None)
if filename not in files:
    sys.exit(f"error: {filename} is not listed at {url}")
link, want = files[filename]
path = os.path.join(dest, filename)
if not (os.path.exists(path) and want
        and hashlib.sha256(open(path, "rb").read()).hexdigest() == want):
    print(f"Downloading {link}")
    with urllib.request.urlopen(link, timeout=300) as r:
        data = r.read()
    if want and hashlib.sha256(data).hexdigest() != want:
        sys.exit(f"error: sha256 of {filename} is not the one {url} lists")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
print(f"Saved {path}")
PY

  echo
  echo "In $dir:"
  local f total=0
  for f in "$dir"/*; do
    [[ -f $f ]] || continue
    printf '  %10s  %s\n' "$(human "$(fsize "$f")")" "$(basename -- "$f")"
    total=$((total + $(fsize "$f")))
  done
  echo "  total $(mib "$total")"
}

# ---------------------------------------------------------------------------------------------
cmd_split() {
  [[ $# -eq 2 || $# -eq 3 ]] || bad_usage "split takes DIR OUTDIR [MIB]"
  local dir=$1 out=$2 mibs=${3:-60}
  [[ $mibs =~ ^[1-9][0-9]*$ ]] || bad_usage "MIB must be a whole number of MiB >= 1, not '$mibs'"
  [[ -d $dir ]] || die "no such folder: $dir"
  if [[ -e $out ]]; then
    [[ -d $out && -z $(ls -A -- "$out") ]] || die "OUTDIR must be new or empty: $out"
  fi
  local piece=$((mibs * MIB_BYTES)) limit=$((mibs * MIB_BYTES * 105 / 100))

  local f name files=()
  for f in "$dir"/*; do
    [[ -f $f ]] || continue
    name=$(basename -- "$f")
    [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._+-]*$ ]] || die "file name with odd characters: $name"
    [[ $name != MANIFEST && $name != CONTENTS && $name != *.part-[0-9][0-9][0-9] ]] \
      || die "file name reserved for the bundle: $name"
    files+=("$f")
  done
  [[ ${#files[@]} -gt 0 ]] || die "no files in $dir"

  mkdir -p -- "$out"
  local stage=$out/.stage
  mkdir -- "$stage"
  : >"$out/MANIFEST"
  for f in "${files[@]}"; do
    name=$(basename -- "$f")
    printf '%s  %s\n' "$(sha "$f")" "$name" >>"$out/MANIFEST"
    if (($(fsize "$f") > piece)); then
      split -b "$piece" -d -a 3 -- "$f" "$stage/$name.part-"
    else
      cp -- "$f" "$stage/$name"
    fi
  done

  # Pieces, largest first, each into the first batch with room (first-fit decreasing). Every
  # batch also holds MANIFEST and CONTENTS; CONTENTS is written after packing, so its size is
  # bounded from above first: one line per piece, "sha256  size  batch-N  name".
  local items=() sizes=() n
  while read -r n name; do items+=("$name"); sizes+=("$n"); done < <(
    for f in "$stage"/*; do printf '%s %s\n' "$(fsize "$f")" "$(basename -- "$f")"; done \
      | sort -k1,1nr -k2,2)
  local digits=${#items[@]}; digits=${#digits}
  local reserve i
  reserve=$(fsize "$out/MANIFEST")
  for name in "${items[@]}"; do
    reserve=$((reserve + 64 + 2 + ${#limit} + 2 + 6 + digits + 2 + ${#name} + 1))
  done
  local room=$((limit - reserve)) used=() batch_of=()
  for i in "${!items[@]}"; do
    ((sizes[i] <= room)) || die "batch limit $(mib "$limit") leaves no room for ${items[i]} ($(mib "${sizes[i]}")) beside MANIFEST and CONTENTS"
    local b=0
    while ((b < ${#used[@]} && used[b] + sizes[i] > room)); do b=$((b + 1)); done
    used[b]=$((${used[b]:-0} + sizes[i]))
    batch_of[i]=$((b + 1))
  done

  : >"$out/CONTENTS"
  for i in "${!items[@]}"; do
    printf '%s  %s  batch-%s  %s\n' "$(sha "$stage/${items[i]}")" "${sizes[i]}" "${batch_of[i]}" \
      "${items[i]}" >>"$out/CONTENTS"
  done
  for i in "${!used[@]}"; do
    mkdir -- "$out/batch-$((i + 1))"
    cp -- "$out/MANIFEST" "$out/CONTENTS" "$out/batch-$((i + 1))/"
  done
  for i in "${!items[@]}"; do mv -- "$stage/${items[i]}" "$out/batch-${batch_of[i]}/"; done
  rmdir -- "$stage"

  local bdir total names
  for i in "${!used[@]}"; do
    bdir=$out/batch-$((i + 1))
    total=0
    for f in "$bdir"/*; do total=$((total + $(fsize "$f"))); done
    names=$(awk -v b="batch-$((i + 1))" '$3 == b { printf "%s%s", sep, $4; sep = ", " }' \
      "$out/CONTENTS")
    printf 'batch-%s  %10s  %s\n' "$((i + 1))" "$(mib "$total")" "$names"
  done
  echo "${#used[@]} batches in $out, each at most $(mib "$limit") (MANIFEST and CONTENTS in each)."
  echo "Carry each batch folder; on the target: $PROG gather batch-N STORE, then $PROG install STORE"
}

# ---------------------------------------------------------------------------------------------
# The batches (space-separated, in CONTENTS order) with a piece not yet in STORE; empty when
# every batch is in (or STORE has no CONTENTS yet: then "all"). A part whose whole file was
# already reassembled counts as there.
missing_batches() {
  local store=$1 missing=() psha psize pbatch pname
  [[ -f $store/CONTENTS ]] || { echo all; return; }
  while read -r psha psize pbatch pname; do
    [[ -n $pname && ! -f $store/$pname ]] || continue
    [[ $pname == *.part-[0-9][0-9][0-9] && -f $store/${pname%.part-*} ]] && continue
    [[ " ${missing[*]} " == *" $pbatch "* ]] || missing+=("$pbatch")
  done <"$store/CONTENTS"
  echo "${missing[*]}"
}

# ---------------------------------------------------------------------------------------------
cmd_gather() {
  [[ $# -eq 2 ]] || bad_usage "gather takes BATCHDIR STORE"
  local bdir=$1 store=$2 f name
  [[ -d $bdir ]] || die "no such folder: $bdir"
  [[ -f $bdir/MANIFEST && -f $bdir/CONTENTS ]] || die "not a batch folder (no MANIFEST and CONTENTS): $bdir"
  mkdir -p -- "$store"
  for name in MANIFEST CONTENTS; do
    if [[ -f $store/$name ]] && ! cmp -s -- "$bdir/$name" "$store/$name"; then
      die "$bdir belongs to another bundle than $store ($name differs)"
    fi
  done
  local moved=0
  for f in "$bdir"/*; do
    name=$(basename -- "$f")
    [[ -f $f ]] || continue
    if [[ $name == MANIFEST || $name == CONTENTS ]]; then
      [[ -f $store/$name ]] || cp -- "$f" "$store/$name"
      continue
    fi
    awk -v n="$name" '$4 == n { found = 1 } END { exit !found }' "$bdir/CONTENTS" \
      || die "$name is not in $bdir/CONTENTS"
    mv -f -- "$f" "$store/$name"
    moved=$((moved + 1))
  done
  echo "moved $moved file(s) from $bdir into $store"
  local missing
  missing=$(missing_batches "$store")
  if [[ -n $missing ]]; then
    echo "still to gather: $missing"
  else
    echo "every batch is in $store: $PROG install $store"
  fi
}

# ---------------------------------------------------------------------------------------------
# Reassemble split files in STORE and check every sha256 (parts, then whole files).
reassemble() {
  local store=$1 want name
  [[ -f $store/MANIFEST && -f $store/CONTENTS ]] || die "no MANIFEST and CONTENTS in $store (gather the batches first)"
  local psha psize pbatch pname
  while read -r psha psize pbatch pname; do
    [[ -n $pname ]] || continue
    if [[ ! -f $store/$pname ]]; then
      if [[ $pname == *.part-[0-9][0-9][0-9] && -f $store/${pname%.part-*} ]] \
        && [[ $(sha "$store/${pname%.part-*}") == $(awk -v n="${pname%.part-*}" '$2 == n { print $1 }' "$store/MANIFEST") ]]; then
        continue  # already reassembled and checked; the part is not needed
      fi
      die "missing $pname (in $pbatch; gather it: $PROG gather $pbatch $store)"
    fi
    [[ $(fsize "$store/$pname") == "$psize" && $(sha "$store/$pname") == "$psha" ]] \
      || die "sha256 mismatch: $pname (corrupted in transfer; carry $pbatch again)"
  done <"$store/CONTENTS"

  while read -r want name; do
    [[ -n $name ]] || continue
    local parts=()
    mapfile -t parts < <(awk -v n="$name" 'index($4, n ".part-") == 1 && length($4) == length(n) + 9 { print $4 }' "$store/CONTENTS" | sort)
    if ((${#parts[@]} > 0)) && ! { [[ -f $store/$name ]] && [[ $(sha "$store/$name") == "$want" ]]; }; then
      local p paths=()
      for p in "${parts[@]}"; do paths+=("$store/$p"); done
      cat -- "${paths[@]}" >"$store/$name.tmp"
      mv -f -- "$store/$name.tmp" "$store/$name"
      echo "reassembled $name from ${#parts[@]} parts"
    fi
    [[ -f $store/$name ]] || die "missing $name"
    [[ $(sha "$store/$name") == "$want" ]] || die "sha256 mismatch: $name (against MANIFEST)"
  done <"$store/MANIFEST"
}

cmd_install() {
  local dry=0 store="" wait_s="" a
  while (($#)); do
    a=$1; shift
    case $a in
      --dry-run) dry=1 ;;
      --wait)
        [[ ${1:-} =~ ^[0-9]+$ ]] || bad_usage "--wait: got '${1:-}'; allowed a whole number of seconds"
        wait_s=$1; shift ;;
      -*) bad_usage "unknown option for install: $a" ;;
      *) [[ -z $store ]] || bad_usage "install takes one STORE"; store=$a ;;
    esac
  done
  [[ -n $store ]] || bad_usage "install takes STORE"
  if [[ -n $wait_s ]]; then  # the batches arrive one transfer at a time
    local until_s=$((SECONDS + wait_s)) missing
    mkdir -p -- "$store"
    while missing=$(missing_batches "$store"); [[ -n $missing ]]; do
      ((SECONDS < until_s)) || die "after $wait_s s these batches are still not gathered in $store: $missing"
      sleep 1
    done
  fi
  [[ -d $store ]] || die "no such folder: $store"
  store=$(cd -- "$store" && pwd)
  local py=${PYTHON:-python3}
  command -v "$py" >/dev/null || die "no $py on PATH (activate the environment to install into, or set PYTHON)"

  # Before anything is installed: the environment the sdist is built in.
  if ((!dry)); then
    local lacks
    lacks=$("$py" -c '
import importlib.util, sys
v = sys.version_info[:2]
print(", ".join(([] if v == (3, 12) else [f"Python 3.12 (this is {v[0]}.{v[1]})"])
               + [m for m in ("torch", "setuptools") if importlib.util.find_spec(m) is None]))') \
      || die "$py does not run"
    [[ -z $lacks ]] || die "$(command -v "$py") lacks $lacks: activate the environment that holds torch, or set PYTHON"
    command -v nvcc >/dev/null || [[ -x ${CUDA_HOME:-/usr/local/cuda}/bin/nvcc ]] \
      || die "no nvcc on PATH or in \${CUDA_HOME:-/usr/local/cuda}/bin: the build needs the CUDA toolkit"
  fi
  local t0=$SECONDS
  reassemble "$store"
  echo "[reassemble and check] $((SECONDS - t0)) s: every sha256 in MANIFEST and CONTENTS matches"

  local helpers=() wheels=() sdists=() line name
  if [[ -f $store/$IF_MISSING ]]; then
    while read -r line; do
      line=${line%%#*}; line=${line//[[:space:]]/}
      [[ -n $line ]] && helpers+=("$(norm "$(sed -E 's/[<>=!~;].*//' <<<"$line")")")
    done <"$store/$IF_MISSING"
  fi
  while read -r _ name; do
    case $name in
      *.whl)
        local dist skip=0 h
        dist=$(norm "${name%%-*}")
        for h in "${helpers[@]}"; do [[ $dist == "$h" ]] && skip=1; done
        ((skip)) || wheels+=("$store/$name") ;;
      *.tar.gz | *.zip) sdists+=("$store/$name") ;;
    esac
  done <"$store/MANIFEST"

  local site cpath="" d
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for d in "$site/nvidia/cudnn/include" "$site/nvidia/nccl/include"; do
    [[ -d $d ]] || echo "warning: no $d (cuDNN / NCCL headers from torch's nvidia wheels)" >&2
    cpath+=${cpath:+:}$d
  done
  local build_env=(NVTE_FRAMEWORK=pytorch "NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}"
    NVTE_PYTORCH_FORCE_BUILD=TRUE "MAX_JOBS=${MAX_JOBS:-$(nproc)}" "CPATH=$cpath${CPATH:+:$CPATH}")

  step() {  # step LABEL COMMAND...: run it and say how long it took, or print it
    local label=$1 t=$SECONDS; shift
    if ((dry)); then
      local a line=""
      for a in "$@"; do
        [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]] || a="'${a//\'/\'\\\'\'}'"
        line+=${line:+ }$a
      done
      echo "$line"
    else
      echo "[$label] $*"
      "$@" || die "$label failed (exit $?): $*"
      echo "[$label] $((SECONDS - t)) s"
    fi
  }
  ((dry)) && echo "# dry run: the commands install would run, in order (after checking for" \
    "Python 3.12, torch, setuptools and nvcc)"
  if [[ -f $store/$IF_MISSING ]]; then
    step "pip install, where missing" "$py" -m pip install --no-index --no-deps \
      --find-links "$store" -r "$store/$IF_MISSING"
  fi
  ((${#wheels[@]} == 0)) || step "pip install wheels" "$py" -m pip install --no-index --no-deps "${wheels[@]}"
  local s
  for s in "${sdists[@]}"; do
    step "build $(basename -- "$s")" env "${build_env[@]}" "$py" -m pip install --no-index \
      --no-deps --no-build-isolation "$s"
  done
  step "check" "$py" -c "import transformer_engine.pytorch, megatron.core"
  ((dry)) || echo "installed in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------------
case ${1:-} in
  download) shift; cmd_download "$@" ;;
  split) shift; cmd_split "$@" ;;
  gather) shift; cmd_gather "$@" ;;
  install) shift; cmd_install "$@" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) bad_usage "unknown subcommand: $1" ;;
esac
