#!/usr/bin/env bash
# Object-only compile check of the CUDA kernels (no GPU needed): every csrc/cuda/*.cu is compiled by nvcc
# for sm_80 and sm_90a (and sm_100a with SPARSEVER_CHECK_SM100=1) against the installed torch headers,
# in parallel; csrc/cuda/*.cpp (the bindings) are syntax-checked by the host compiler.
# Prints per-file time, the kernel with the most registers and every kernel that spills (the full ptxas
# register/spill/shared-memory table of every kernel goes to build/cuda_check/<file>.summary, or to stdout
# with SPARSEVER_CUDA_CHECK_VERBOSE=1); exits non-zero
# on any compiler error (or, with SPARSEVER_FAIL_ON_SPILL=1, on any register spill).
#
# Environment: PYTHON (default: .venv/bin/python, else python3), NVCC (default: PATH, /usr/local/cuda,
# else the venv's pip CUDA toolkit, installed on demand), SPARSEVER_CUDA_ARCHS (default "80 90a"),
# JOBS (default: number of cores), SPARSEVER_CUDA_CHECK_DIR (default build/cuda_check).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
OUT="${SPARSEVER_CUDA_CHECK_DIR:-$ROOT/build/cuda_check}"
JOBS="${JOBS:-$(nproc)}"
ARCHS="${SPARSEVER_CUDA_ARCHS:-80 90a}"
if [[ "${SPARSEVER_CHECK_SM100:-0}" == 1 ]]; then ARCHS="$ARCHS 100a"; fi
CUDA_TOOLKIT_PIP_SPEC='cuda-toolkit[nvcc,cudart,cccl,crt,nvvm]==13.0.3'

find_pip_nvcc() {
  "$PYTHON" - <<'PY'
import pathlib, site, sys
for base in site.getsitepackages():
    for cand in sorted(pathlib.Path(base, "nvidia").glob("**/bin/nvcc")):
        if cand.is_file():
            print(cand)
            sys.exit(0)
PY
}

locate_nvcc() {
  if [[ -n "${NVCC:-}" ]]; then echo "$NVCC"; return; fi
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return; fi
  for cand in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    if [[ -x "$cand" ]]; then echo "$cand"; return; fi
  done
  find_pip_nvcc || true
}

NVCC_BIN="$(locate_nvcc)"
if [[ -z "$NVCC_BIN" ]]; then
  echo "nvcc not found: installing $CUDA_TOOLKIT_PIP_SPEC into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
  if ! "$PYTHON" -m pip install --quiet "$CUDA_TOOLKIT_PIP_SPEC"; then
    echo "ERROR: no nvcc and the CUDA toolkit could not be installed from PyPI; cannot check the CUDA sources" >&2
    exit 2
  fi
  NVCC_BIN="$(find_pip_nvcc || true)"
  if [[ -z "$NVCC_BIN" ]]; then
    echo "ERROR: $CUDA_TOOLKIT_PIP_SPEC installed but no nvcc found under site-packages/nvidia" >&2
    exit 2
  fi
  # The pip toolkit ships lib/; tools that expect lib64 (CMake's FindCUDAToolkit) need the link.
  TK="$(dirname "$(dirname "$NVCC_BIN")")"
  [[ -e "$TK/lib64" || ! -d "$TK/lib" ]] || ln -s lib "$TK/lib64"
fi
echo "nvcc: $NVCC_BIN ($("$NVCC_BIN" --version | grep -o 'release [0-9.]*'))"

TORCH_INCLUDES=$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))')
# Mirrors torch's own CUDA extension flags (c10::Half/BFloat16 provide the conversions, not cuda_fp16.h),
# plus the one define that lets c10/cuda headers compile against a CPU-only torch.
COMMON_FLAGS=(-std=c++20 -O3 --expt-relaxed-constexpr -Xptxas -v -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ -Xcompiler -fPIC -I"$ROOT/csrc")
for arch in $ARCHS; do COMMON_FLAGS+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done

mkdir -p "$OUT"
shopt -s nullglob
CU_FILES=("$ROOT"/csrc/cuda/*.cu)
CPP_FILES=("$ROOT"/csrc/cuda/*.cpp)
if [[ ${#CU_FILES[@]} -eq 0 ]]; then echo "ERROR: no csrc/cuda/*.cu files" >&2; exit 1; fi

compile_one() {  # $1 = source; writes $OUT/<name>.log and .status
  local src="$1" name; name="$(basename "$src")"
  local log="$OUT/$name.log" start end rc=0
  start=$(date +%s%N)
  if [[ "$src" == *.cu ]]; then
    # shellcheck disable=SC2086
    "$NVCC_BIN" "${COMMON_FLAGS[@]}" $TORCH_INCLUDES -c "$src" -o "$OUT/$name.o" >"$log" 2>&1 || rc=$?
  else
    # shellcheck disable=SC2086
    "${CXX:-c++}" -std=c++20 -fsyntax-only -I"$ROOT/csrc" $TORCH_INCLUDES "$src" >"$log" 2>&1 || rc=$?
  fi
  end=$(date +%s%N)
  printf '%s %d.%d\n' "$rc" $(( (end - start) / 1000000000 )) $(( (end - start) / 100000000 % 10 )) >"$OUT/$name.status"
}
export -f compile_one
export NVCC_BIN OUT TORCH_INCLUDES ROOT
export COMMON_FLAGS_STR="${COMMON_FLAGS[*]}"

start_all=$(date +%s)
pids=()
running=0
for src in "${CU_FILES[@]}" "${CPP_FILES[@]}"; do
  compile_one "$src" &
  pids+=($!)
  running=$((running + 1))
  if (( running >= JOBS )); then wait -n || true; running=$((running - 1)); fi
done
wait || true

failed=0
spills=0
echo
printf '%-28s %8s  %s\n' "file" "time[s]" "result"
for src in "${CU_FILES[@]}" "${CPP_FILES[@]}"; do
  name="$(basename "$src")"
  read -r rc secs <"$OUT/$name.status"
  log="$OUT/$name.log"
  if [[ "$rc" != 0 ]]; then
    printf '%-28s %8s  FAILED (exit %s)\n' "$name" "$secs" "$rc"
    failed=1
    grep -E 'error|Error' "$log" | head -30 | sed 's/^/    /'
    continue
  fi
  if [[ "$src" == *.cu ]]; then
    nkern=$(grep -c 'Compiling entry function' "$log" || true)
    maxreg=$(grep -oE 'Used [0-9]+ registers' "$log" | awk '{print $2}' | sort -n | tail -1)
    nspill=$(grep -E '[1-9][0-9]* bytes spill (stores|loads)' -c "$log" || true)
    printf '%-28s %8s  ok: %s kernel builds, max %s registers, %s with spills\n' "$name" "$secs" "$nkern" "${maxreg:-0}" "$nspill"
    # Per kernel and arch: registers, shared memory, spills (names demangled and cut to 100 chars).
    "$PYTHON" - "$log" "${SPARSEVER_CUDA_CHECK_VERBOSE:-0}" <<'PY' || true
import re, shutil, subprocess, sys
text = open(sys.argv[1]).read().splitlines()
rows, fn, arch, spill = [], None, None, ""
for line in text:
    m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
    if m:
        fn, arch, spill = m.group(1), m.group(2), ""
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and fn:
        spill = "" if m.group(1) == m.group(2) == "0" else f"SPILL {m.group(1)}B st/{m.group(2)}B ld"
    m = re.search(r"Used (\d+) registers", line)
    if m and fn:
        smem = re.search(r"(\d+) bytes smem", line)
        rows.append((arch, int(m.group(1)), smem.group(1) if smem else "0", spill, fn))
        fn = None
names = [r[4] for r in rows]
if names and shutil.which("c++filt"):
    names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
lines = [f"    {arch:7s} {reg:4d} regs {smem:>6s} B smem {spill:22s} {name[:110]}"
         for (arch, reg, smem, spill, _), name in sorted(zip(rows, names), key=lambda x: (x[1], x[0][0]))]
with open(sys.argv[1].replace(".log", ".summary"), "w") as f:
    f.write("\n".join(lines) + "\n")
verbose = sys.argv[2] == "1"
for line in lines:
    if verbose or "SPILL" in line:
        print(line)
if lines and not verbose:
    print(max(lines, key=lambda l: int(l.split()[1])), "(most registers)")
PY
    if (( nspill > 0 )); then spills=1; fi
  else
    printf '%-28s %8s  ok (host syntax check)\n' "$name" "$secs"
  fi
done
echo "total: $(( $(date +%s) - start_all )) s, archs: $ARCHS, jobs: $JOBS"
if (( failed )); then echo "CUDA compile check FAILED" >&2; exit 1; fi
if (( spills )) && [[ "${SPARSEVER_FAIL_ON_SPILL:-0}" == 1 ]]; then echo "register spills found" >&2; exit 1; fi
echo "CUDA compile check passed"
