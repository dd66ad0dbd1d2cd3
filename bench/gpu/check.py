"""The GPU check kit: build, verify and time every sparsever kernel in one command.

    python3 bench/gpu/check.py OUTDIR                    # a bare GPU machine: about 8 minutes on one H100
    python3 bench/gpu/check.py OUTDIR --device cpu --quick   # the same phases with the CPU kernels (a test)

Needs PyTorch (with CUDA for --device cuda), CMake and a C++ compiler; nvcc for CUDA; ninja if present;
pytest + hypothesis for the reused SIMT cases, tqdm for progress. Not vLLM, not the network, not
`pip install`: the build phase calls CMake directly and puts the modules next to the package, as
`setup.py build_ext --inplace`.

Phases, each timed, each written to OUTDIR/check.json and OUTDIR/check.md as soon as it ends (a run cut
short still leaves what it did):
  probe        GPU, driver, torch, CUDA, nvcc, compute-sanitizer, CMake, ninja
  build        the extension for this GPU's architecture only; every op must have a kernel for the device
  correctness  every op against vllm_sparsever/reference.py: the SIMT suite's hypothesis cases through
               tests/simt/device_ops.py, then the kit's own grid (dtypes, both KV layouts, head_dim
               64/128/256, GQA, 1-16 query tokens with tree masks, split and unsplit contexts, FFN and
               MoE at production shapes), CUDA-graph capture + replay against eager, a non-default stream
  sanitizer    compute-sanitizer memcheck and racecheck over one small call of each op (CUDA only)
  speed        each kernel against the natural dense baseline at verify shapes, with the L2 flushed
               before every timed call; achieved GB/s against the copy bandwidth measured in this run

Other files in OUTDIR: build.log, simt.log, sanitizer_memcheck.log, sanitizer_racecheck.log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "simt")]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ---- the report -----------------------------------------------------------------------------------------

class Report:
    """check.json + check.md in OUTDIR, rewritten after every phase."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out = out
        self.data = {"command": " ".join([Path(sys.executable).name] + sys.argv), "device": args.device,
                     "quick": args.quick, "commit": args.commit,
                     "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "phases": {}}

    def phase(self, name: str, fn, *a) -> dict:
        log(f"phase {name} ...")
        start = time.monotonic()
        entry: dict = {"status": "ok"}
        try:
            result = fn(*a)
            if isinstance(result, dict):
                entry.update(result)
        except Skip as e:
            entry = {"status": "skipped", "why": str(e)}
        except Exception as e:  # a phase's failure is reported; later phases still run where they can
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-4000:], **getattr(e, "partial", {})}
        entry["seconds"] = round(time.monotonic() - start, 1)
        self.data["phases"][name] = entry
        log(f"phase {name}: {entry['status']} in {entry['seconds']} s"
            + (f" ({entry.get('error') or entry.get('why')})" if entry["status"] != "ok" else ""))
        self.write()
        return entry

    def write(self) -> None:
        self.data["total_seconds"] = round(time.monotonic() - T0, 1)
        (self.out / "check.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "check.md").write_text(markdown(self.data))


class Skip(Exception):
    """A phase that does not apply (e.g. the sanitizer on CPU)."""


class CaseFailures(AssertionError):
    """Some cases of a phase failed; `partial` keeps every case's result for the report."""

    def __init__(self, msg: str, partial: dict) -> None:
        super().__init__(msg)
        self.partial = partial


def run_cmd(cmd: list[str], log_path: Path | None = None, timeout: float | None = None, env=None,
            cwd=ROOT) -> tuple[int, str]:
    """Run a command; its output goes to log_path (appended) and is returned."""
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc, text = 124, out + err + f"\n[timed out after {timeout} s]\n"
    except OSError as e:
        rc, text = 127, f"{e}\n"
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{text}\n[rc={rc}]\n")
    return rc, text


def first_line(cmd: list[str], pattern: str | None = None) -> str | None:
    rc, text = run_cmd(cmd, timeout=30)
    if rc != 0:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if pattern:
        lines = [ln for ln in lines if re.search(pattern, ln)]
    return lines[-1] if lines else None


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for cand in (f"/usr/local/cuda/bin/{name}", *sorted(map(str, Path("/usr/local").glob(f"cuda-*/bin/{name}")))):
        if os.access(cand, os.X_OK):
            return cand
    return None


def cmake_command() -> str:
    """cmake on PATH, else the one beside this Python (pip's cmake in a virtual environment)."""
    beside = Path(sys.executable).parent / "cmake"
    return shutil.which("cmake") or (str(beside) if beside.exists() else "cmake")


# ---- phase: probe ---------------------------------------------------------------------------------------

def probe(args) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cmake": first_line([cmake_command(), "--version"], "version"), "ninja": first_line(["ninja", "--version"])}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device cuda but torch {torch.__version__} sees no GPU")
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
                    driver=first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
        nvcc, sanitizer = find_tool("nvcc"), find_tool("compute-sanitizer")
        info.update(nvcc=nvcc and first_line([nvcc, "--version"], "release"), nvcc_path=nvcc,
                    compute_sanitizer=sanitizer and first_line([sanitizer, "--version"], "ersion"),
                    compute_sanitizer_path=sanitizer)
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---- phase: build ---------------------------------------------------------------------------------------

def cuda_archs() -> str:
    """SPARSEVER_CUDA_ARCHS if set, else this GPU's architecture (e.g. 90 for an H100)."""
    if os.environ.get("SPARSEVER_CUDA_ARCHS"):
        return os.environ["SPARSEVER_CUDA_ARCHS"]
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}{minor}"


def build(args, out: Path) -> dict:
    build_dir = Path(args.build_dir or ROOT / "build" / f"gpu_check_{args.device}").resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    configure = [cmake_command(), "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-DSPARSEVER_TARGET_DEVICE={args.device}"]
    info: dict = {"build_dir": str(build_dir)}
    if args.device == "cuda":
        nvcc = find_tool("nvcc")
        if nvcc is None:
            raise RuntimeError("--device cuda needs nvcc (PATH or /usr/local/cuda/bin)")
        archs = cuda_archs()
        configure += [f"-DSPARSEVER_CUDA_ARCHS={archs}", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                      f"-DCUDA_TOOLKIT_ROOT_DIR={Path(nvcc).resolve().parents[1]}"]
        info["cuda_archs"] = archs
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    configure += os.environ.get("CMAKE_ARGS", "").split()
    rc, text = run_cmd(configure, log_path, timeout=300)
    if rc != 0:
        raise RuntimeError(f"CMake configure failed (rc {rc}); end of build.log:\n{text[-3000:]}")
    if args.device == "cpu" and args.quick:
        # The compile of the CPU modules takes minutes on 2 cores; the test checks the configure only and
        # runs the installed build. A full `--device cpu` run compiles.
        info["compiled"] = False
        info["note"] = "--quick: configured only; the installed extension is checked"
    else:
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        rc, text = run_cmd([cmake_command(), "--build", str(build_dir), "-j", jobs], log_path, timeout=900)
        if rc != 0:
            errors = [ln for ln in text.splitlines() if "error" in ln.lower()][:20]
            raise RuntimeError(f"build failed (rc {rc}):\n" + "\n".join(errors or text.splitlines()[-30:]))
        modules = sorted(build_dir.glob("_C*.so"))
        if not modules:
            raise RuntimeError(f"the build produced no _C*.so in {build_dir}")
        pkg = ROOT / "vllm_sparsever"
        for stale in pkg.glob("_C*.so"):
            stale.unlink()
        for m in modules:
            shutil.copy2(m, pkg / m.name)
        info["compiled"] = True
        info["modules"] = [m.name for m in modules]
    from vllm_sparsever import _custom_ops

    info["loaded"] = _custom_ops.loaded_module()
    info["kernels"] = _custom_ops.registered_kernels()
    key = "CUDA" if args.device == "cuda" else "CPU"
    missing = [op for op in _custom_ops.OP_NAMES if key not in info["kernels"].get(op, [])]
    if missing:
        raise CaseFailures(f"no {key} kernel registered for: {', '.join(missing)}", info)
    return info


# ---- correctness helpers ---------------------------------------------------------------------------------

def to_dev(t, device):
    from device_ops import to_device_strided

    return None if t is None else to_device_strided(t, torch.device(device))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class Cases:
    """Named checks; each records ok / failed (with the message) and optional figures."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.results: list[dict] = []
        self.progress = tqdm(total=total, desc="correctness cases", unit="case", mininterval=2)  # done, time left

    def run(self, name: str, fn, **meta) -> None:
        start = time.monotonic()
        rec = {"case": name, **meta}
        try:
            figures = fn()
            rec["status"] = "ok"
            if isinstance(figures, dict):
                rec.update(figures)
        except Exception as e:
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            log(f"  FAILED {name}: {rec['error'][:300]}")
        rec["ms"] = round(1e3 * (time.monotonic() - start), 1)
        self.results.append(rec)
        self.progress.update(1)

    def summary(self) -> dict:
        self.progress.close()
        failed = [r["case"] for r in self.results if r["status"] != "ok"]
        return {"cases": len(self.results), "failed": len(failed), "failed_cases": failed[:50],
                "results": self.results}


# ---- correctness: attention, key summaries, block selection ---------------------------------------------

ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def attention_case(device: str, dtype, layout: str, head_dim: int, hkv: int, group: int, seqs, use_tree: bool,
                   top_k: int | None, block_size: int, seed: int) -> dict:
    """Summaries, selection (top_k given) and attention on `device` against the reference on CPU."""
    from kv_inputs import make_kv_cache, make_requests, make_tree_mask

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference

    gen = torch.Generator().manual_seed(seed)
    table, seq_lens, query_lens, qsl, nb = make_requests(seqs, block_size, gen)
    k_cache, v_cache = make_kv_cache(nb, hkv, block_size, head_dim, dtype, layout, gen)
    total = int(qsl[-1])
    query = torch.randn(total, hkv * group, head_dim, generator=gen).to(dtype)
    tree = make_tree_mask(query_lens, gen) if use_tree else None
    d = lambda t: to_dev(t, device)  # noqa: E731
    figures: dict = {}
    selected = num_selected = None
    if top_k is not None:
        kmin = torch.randn(nb, hkv, head_dim, generator=gen)
        kmax = torch.randn(nb, hkv, head_dim, generator=gen)
        slots = torch.arange(nb * block_size, dtype=torch.int64)
        dmin, dmax = d(kmin.clone()), d(kmax.clone())
        ops.update_block_key_summaries(d(k_cache), d(slots), block_size, dmin, dmax)
        reference.update_block_key_summaries(k_cache, slots, block_size, kmin, kmax)
        if not (torch.equal(dmin.cpu(), kmin) and torch.equal(dmax.cpu(), kmax)):
            raise AssertionError("update_block_key_summaries: min/max differ from the reference (must be exact)")
        pooled = reference.pool_queries(query, qsl)
        dsel, dnsel = ops.select_kv_blocks(d(pooled), dmin, dmax, d(table), d(seq_lens), d(query_lens), block_size,
                                           top_k, 1, 2)
        selected = torch.empty(dsel.shape, dtype=torch.int32)
        num_selected = torch.empty(dnsel.shape, dtype=torch.int32)
        reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, block_size, top_k, 1, 2,
                                   selected, num_selected)
        if not torch.equal(dnsel.cpu(), num_selected):
            raise AssertionError("select_kv_blocks: num_selected differs from the reference")
        figures["selection_equal"] = bool(torch.equal(dsel.cpu(), selected))
        # Near-tied Quest scores may flip a block: attend over the device's own selection either way.
        selected, num_selected = dsel.cpu(), dnsel.cpu()
    scale = head_dim**-0.5
    expected = torch.empty_like(query, dtype=torch.float32)
    reference.block_sparse_tree_attention(expected, query.float(), k_cache.float(), v_cache.float(), table, seq_lens,
                                          qsl, selected, num_selected, tree, scale)
    out = torch.full_like(d(query), float("nan"))
    ops.block_sparse_tree_attention(d(query), d(k_cache), d(v_cache), d(table), d(seq_lens), d(qsl), scale,
                                    d(selected), d(num_selected), d(tree), out=out)
    got = out.cpu()
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(got.float(), expected.to(dtype).float(), rtol=tol, atol=tol)
    figures["rel_err"] = rel_err(got, expected)
    return figures


def attention_grid(quick: bool) -> list[dict]:
    """The kit's attention cases: per dtype x layout x head_dim, a batch mixing short (one split) and
    long (split along the context) requests, chains and trees, dense and selected."""
    layouts = ["gpu", "cpu"]
    head_dims = [64, 128] if quick else [64, 128, 256]
    dtypes = [torch.float32, torch.bfloat16] if quick else [torch.float32, torch.float16, torch.bfloat16]
    long_ctx = 700 if quick else 6000
    shapes = [  # (hkv, group, seqs, tree, top_k)
        (2, 1, [(100, 1), (long_ctx, 1)], False, None),
        (2, 4, [(40, 4), (long_ctx, 4), (0, 3)], True, 8),
        (1, 8, [(long_ctx + 37, 16)], True, None),
        (2, 4, [(300, 16), (long_ctx, 8)], False, 4),
    ]
    if quick:
        shapes = shapes[1:3]
    cases = []
    for dtype in dtypes:
        for layout in layouts:
            for hd in head_dims:
                for i, (hkv, group, seqs, tree, top_k) in enumerate(shapes):
                    cases.append(dict(dtype=dtype, layout=layout, head_dim=hd, hkv=hkv, group=group, seqs=seqs,
                                      use_tree=tree, top_k=top_k, block_size=16, seed=100 + i + hd))
    if not quick:  # many splits (the heuristic's cap) and a block size of 32
        cases.append(dict(dtype=torch.bfloat16, layout="gpu", head_dim=128, hkv=8, group=4, seqs=[(40000, 8)],
                          use_tree=True, top_k=None, block_size=16, seed=7))
        cases.append(dict(dtype=torch.bfloat16, layout="gpu", head_dim=128, hkv=8, group=4, seqs=[(40000, 8)],
                          use_tree=True, top_k=64, block_size=32, seed=8))
    return cases


# ---- correctness: FFN and MoE ------------------------------------------------------------------------------

def ffn_case(device: str, dtype, h: int, inter: int, groups: list[int], keep_frac: float, seed: int,
             weights) -> dict:
    from op_inputs import SELECTION_TIE_RTOL, assert_ffn_matches_reference, start_loc

    from vllm_sparsever import _custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    w_gate_up, w_down_t, dw_gate_up, dw_down_t = weights
    x = torch.randn(sum(groups), h, generator=gen).to(dtype)
    gsl = start_loc(groups)
    keep = max(1, round(keep_frac * inter))
    out, sel = ops.topk_swiglu_ffn(to_dev(x, device), dw_gate_up, dw_down_t, to_dev(gsl, device), keep)
    # CUDA keeps the gate in fp32 for every dtype; the CPU kernels may round it to the weights' dtype.
    tie = SELECTION_TIE_RTOL[torch.float32 if device == "cuda" else dtype]
    equal = assert_ffn_matches_reference(out.cpu(), sel.cpu(), x, w_gate_up, w_down_t, gsl, keep, tie)
    return {"groups_equal_selection": equal}


def ffn_gated_case(device: str, dtype, h: int, inter: int, groups: list[int], seed: int) -> dict:
    from op_inputs import (SELECTION_TIE_RTOL, assert_ffn_matches_reference,
                           assert_input_sparse_gate_matches_reference, gated_ffn_problem, input_sparse_gate_problem)

    from vllm_sparsever import _custom_ops as ops

    x, gate, w_gate_up, w_down_t, gsl, keep = gated_ffn_problem(h, inter, groups, 0.25, dtype, True, seed)
    d = lambda t: to_dev(t, device)  # noqa: E731
    out, sel = ops.topk_swiglu_ffn_gated(d(x), d(gate), d(w_gate_up)[inter:], d(w_down_t), d(gsl), keep)
    tie = SELECTION_TIE_RTOL[torch.float32 if device == "cuda" else dtype]
    assert_ffn_matches_reference(out.cpu(), sel.cpu(), x, w_gate_up, w_down_t, gsl, keep, tie, gate=gate)
    x, w_gate_t, gsl, input_keep = input_sparse_gate_problem(h, inter, groups, 0.5, dtype, seed, row_pad=8)
    gate_out = torch.full((x.shape[0], inter), float("nan"), dtype=dtype, device=device)
    channels = torch.full((len(groups), input_keep), -7, dtype=torch.int32, device=device)
    ops.input_sparse_gate(d(x), d(w_gate_t), d(gsl), input_keep, gate=gate_out, channels=channels)
    assert_input_sparse_gate_matches_reference(gate_out.cpu(), channels.cpu(), x, w_gate_t, gsl, input_keep, tie)
    return {}


def linear_case(device: str, dtype, t: int, k: int, n: int, transposed: bool, seed: int) -> dict:
    """dense_linear (cuBLAS on CUDA) against the reference, a row-major or a transposed-view weight."""
    from op_inputs import TOL

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference as ref

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = (torch.randn(k, n, generator=gen).t() if transposed else torch.randn(n, k, generator=gen)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    out = ops.dense_linear(to_dev(x, device), to_dev(w, device) if not transposed else to_dev(w.t(), device).t(),
                           to_dev(b, device))
    expected = torch.empty(t, n, dtype=dtype)
    ref.dense_linear(expected, x, w, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=rtol, atol=atol * k**0.5)
    return {}


def int8_linear_case(device: str, dtype, t: int, k: int, n: int, seed: int) -> dict:
    """int8_linear (per-token int8 activations, dp4a rows on CUDA) against the reference."""
    from op_inputs import TOL

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference as ref

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=gen) * 2).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype)
    w_sum = ops.int8_weight_sums(w)
    out = ops.int8_linear(to_dev(x, device), to_dev(w, device), to_dev(scale, device), to_dev(w_sum, device),
                          to_dev(b, device))
    expected = torch.empty(t, n, dtype=dtype)
    ref.int8_linear(expected, x, w, scale, w_sum, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=rtol, atol=atol)
    return {}


def int4_linear_case(device: str, dtype, t: int, k: int, n: int, group: int, seed: int) -> dict:
    """int4_linear (per-token int8 activations, nibbles unpacked to dp4a on CUDA) against the reference."""
    from op_inputs import TOL

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference as ref

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=gen) * 2).to(dtype)
    packed = ops.pack_int4_rows(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8))
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype)
    out = ops.int4_linear(to_dev(x, device), to_dev(packed, device), to_dev(scale, device), to_dev(b, device))
    expected = torch.empty(t, n, dtype=dtype)
    ref.int4_linear(expected, x, packed, scale, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=rtol, atol=atol)
    return {}


def moe_weights(device: str, dtype, h: int, inter: int, num_experts: int, seed: int):
    """(w13 [E, 2I, H], w2 [E, H, I]) on the CPU and on `device`."""
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2, to_dev(w13, device), to_dev(w2, device)


def moe_case(device: str, dtype, h: int, inter: int, num_experts: int, top_k: int, groups: list[int],
             ratio: float, budget: int, seed: int, weights=None) -> dict:
    from op_inputs import TOL, start_loc

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference

    gen = torch.Generator().manual_seed(seed)
    n = sum(groups)
    logits = torch.randn(n, num_experts, generator=gen) * 2
    gsl = start_loc(groups)
    w, ids = ops.moe_route_and_prune(to_dev(logits, device), top_k, ratio, to_dev(gsl, device), budget, True)
    rw, rids = torch.empty(n, top_k), torch.empty(n, top_k, dtype=torch.int32)
    reference.moe_route_and_prune(logits, top_k, ratio, gsl, budget, True, rw, rids)
    if not torch.equal(ids.cpu(), rids):
        raise AssertionError("moe_route_and_prune: expert ids differ from the reference")
    torch.testing.assert_close(w.cpu(), rw, rtol=1e-5, atol=1e-6)
    x = torch.randn(n, h, generator=gen).to(dtype)
    w13, w2, dw13, dw2 = weights or moe_weights(device, dtype, h, inter, num_experts, seed + 1)
    out, used = ops.moe_grouped_dispatch(to_dev(x, device), w, ids, dw13, dw2)
    expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    reference.moe_grouped_dispatch(expected, x, rw, rids, w13, w2, rused)
    if int(used.cpu()) != int(rused):
        raise AssertionError(f"moe_grouped_dispatch: {int(used.cpu())} experts used, reference {int(rused)}")
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=rtol, atol=atol)
    return {"experts_used": int(rused), "rel_err": rel_err(out, expected)}


# ---- correctness: CUDA graphs and streams ------------------------------------------------------------------

def graph_problem(device: str, seed: int):
    """Static device inputs of one verify step's ops (attention with selection, FFN, MoE): returns
    (refill, step, buffers); `step()` runs the ops into fresh outputs, `refill(seed)` draws new inputs
    into the same buffers."""
    from kv_inputs import make_kv_cache, make_requests, make_tree_mask
    from op_inputs import start_loc

    from vllm_sparsever import _custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    bs, hkv, group, hd, dtype = 16, 2, 4, 128, torch.bfloat16
    table, seq_lens, query_lens, qsl, nb = make_requests([(2000, 4), (600, 8)], bs, gen)
    k_cache, v_cache = make_kv_cache(nb, hkv, bs, hd, dtype, "gpu", gen)
    tree = make_tree_mask(query_lens, gen)
    s = {k: to_dev(v, device) for k, v in dict(table=table, seq_lens=seq_lens, query_lens=query_lens, qsl=qsl,
                                                 tree=tree, k=k_cache, v=v_cache).items()}
    total = int(qsl[-1])
    s["query"] = torch.empty(total, hkv * group, hd, dtype=dtype, device=device)
    s["kmin"] = torch.zeros(nb, hkv, hd, device=device)
    s["kmax"] = torch.zeros(nb, hkv, hd, device=device)
    s["slots"] = torch.arange(nb * bs, device=device)
    h, inter, e, k = 512, 1024, 16, 4
    s["x"] = torch.empty(total, h, dtype=dtype, device=device)
    s["w_gate_up"] = (torch.randn(2 * inter, h, generator=gen) / h**0.5).to(dtype).to(device)
    s["w_down_t"] = (torch.randn(inter, h, generator=gen) / inter**0.5).to(dtype).to(device)
    s["gsl"] = start_loc([4, 8]).to(device)
    s["logits"] = torch.empty(total, e, device=device)
    s["w13"] = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype).to(device)
    s["w2"] = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype).to(device)

    def refill(seed2: int) -> None:
        g = torch.Generator().manual_seed(seed2)
        s["query"].copy_(torch.randn(s["query"].shape, generator=g).to(dtype))
        s["x"].copy_(torch.randn(s["x"].shape, generator=g).to(dtype))
        s["logits"].copy_(torch.randn(s["logits"].shape, generator=g) * 2)
        s["k"].copy_(torch.randn(s["k"].shape, generator=g).to(dtype))

    def step() -> list[torch.Tensor]:
        ops.update_block_key_summaries(s["k"], s["slots"], bs, s["kmin"], s["kmax"])
        pooled = s["query"].float().view(total, -1, hd)  # a stand-in for the pooled queries: shape only
        pooled = torch.stack([pooled[:4].mean(0), pooled[4:].mean(0)])
        sel, nsel = ops.select_kv_blocks(pooled, s["kmin"], s["kmax"], s["table"], s["seq_lens"], s["query_lens"],
                                         bs, 8, 1, 2)
        attn = ops.block_sparse_tree_attention(s["query"], s["k"], s["v"], s["table"], s["seq_lens"], s["qsl"],
                                               hd**-0.5, sel, nsel, s["tree"])
        dense = ops.block_sparse_tree_attention(s["query"], s["k"], s["v"], s["table"], s["seq_lens"], s["qsl"],
                                                hd**-0.5, None, None, s["tree"])
        ffn, fsel = ops.topk_swiglu_ffn(s["x"], s["w_gate_up"], s["w_down_t"], s["gsl"], 256)
        w, ids = ops.moe_route_and_prune(s["logits"], k, 0.1, s["gsl"], 6, True)
        moe, used = ops.moe_grouped_dispatch(s["x"], w, ids, s["w13"], s["w2"])
        return [s["kmin"].clone(), sel, nsel, attn, dense, ffn, fsel, w, ids, moe, used]

    return refill, step, s


def check_graph_replay(device: str) -> dict:
    refill, step, _ = graph_problem(device, 11)
    refill(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (first launches set kernel attributes)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    mismatches = []
    for seed in (2, 3):
        refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (a, b) in enumerate(zip(captured, eager, strict=True)):
            if not torch.equal(a, b):
                mismatches.append(f"input set {seed}, output {i}: max |diff| "
                                  f"{float((a.double() - b.double()).abs().max()):.3g}")
    if mismatches:
        raise AssertionError("graph replay differs from eager: " + "; ".join(mismatches[:6]))
    return {"outputs_compared": len(captured), "input_sets": 2, "bitwise_equal": True}


def check_side_stream(device: str) -> dict:
    """The ops launch on the caller's current stream: inputs written on a side stream after a long sleep
    are what the ops read there; an op launched on another stream would read the NaN poison."""
    refill, step, buffers = graph_problem(device, 12)
    refill(5)
    torch.cuda.synchronize()
    expected = step()
    saved = {k: buffers[k].clone() for k in ("query", "x", "logits", "k")}
    for k in saved:
        buffers[k].fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the inputs stay poisoned that long on other streams
        for k, v in saved.items():
            buffers[k].copy_(v)
        got = step()
    side.synchronize()
    bad = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if not torch.equal(a, b)]
    if bad:
        raise AssertionError(f"outputs {bad} computed on a side stream differ from the default stream's")
    return {"outputs_compared": len(expected)}


# ---- phase: correctness --------------------------------------------------------------------------------

def correctness(args, out: Path) -> dict:
    device = args.device
    result: dict = {}
    # 1. The SIMT suite's cases on the product's ops (tests/simt/device_ops.py).
    env = dict(os.environ, SPARSEVER_SIMT_DEVICE=device, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    simt_files = [f"tests/simt/test_{n}_simt.py" for n in ("attention", "ffn_moe", "kv_selection")]
    rc, text = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        *simt_files], out / "simt.log", timeout=args.simt_timeout, env=env)
    tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
    result["simt_suite"] = {"status": "ok" if rc == 0 else "failed", "rc": rc, "summary": tail[0]}
    log(f"  SIMT suite on {device}: {tail[0]}")

    # 2. The kit's own grid.
    dnames = ["fp32", "bf16"] if args.quick else ["fp32", "fp16", "bf16"]
    grid = attention_grid(args.quick)
    # per dtype: 8 FFN cases, the gated pair, 4 MoE cases; on CUDA the graph and stream checks
    cases = Cases(len(grid) + 13 * len(dnames) + (2 if device == "cuda" else 0))
    for c in grid:
        name = (f"attention {str(c['dtype'])[6:]} {c['layout']} D{c['head_dim']} Hkv{c['hkv']}x{c['group']} "
                f"seqs{c['seqs']} {'tree' if c['use_tree'] else 'chain'} "
                f"{'top' + str(c['top_k']) if c['top_k'] is not None else 'dense'} bs{c['block_size']}")
        ops_run = "block_sparse_tree_attention" + (",update_block_key_summaries,select_kv_blocks"
                                                   if c["top_k"] is not None else "")
        cases.run(name, lambda c=c: attention_case(device, **c), op=ops_run)
    h, inter = (256, 512) if args.quick else (4096, 14336)
    for dname in dnames:
        dtype = DTYPES[dname]
        gen = torch.Generator().manual_seed(21)
        w_gate_up = (torch.randn(2 * inter, h, generator=gen) / h**0.5).to(dtype)
        w_down_t = (torch.randn(inter, h, generator=gen) / inter**0.5).to(dtype)
        weights = (w_gate_up, w_down_t, to_dev(w_gate_up, device), to_dev(w_down_t, device))
        for groups in ([1], [4], [16], [3, 0, 5, 8]):
            for keep in (0.25, 0.5):
                cases.run(f"ffn {dname} H{h} I{inter} groups{groups} keep{keep}",
                          lambda: ffn_case(device, dtype, h, inter, groups, keep, 31, weights), op="topk_swiglu_ffn")
        weights = w_gate_up = w_down_t = None  # free before the next dtype
        cases.run(f"ffn_gated + input_sparse_gate {dname} H{h} I{inter // 4}",
                  lambda: ffn_gated_case(device, dtype, h, inter // 4, [5, 11], 41),
                  op="topk_swiglu_ffn_gated,input_sparse_gate")
        for t, k, n_out, transposed in ((1, 1536, 2048, False), (5, 8960, 1536, True), (300, 1536, 8960, False)):
            cases.run(f"dense_linear {dname} T{t} K{k} N{n_out}{' transposed' if transposed else ''}",
                      lambda: linear_case(device, dtype, t, k, n_out, transposed, 61), op="dense_linear")
        for t, k, n_out in ((1, 896, 1152), (7, 4864, 896), (16, 898, 33)):
            cases.run(f"int8_linear {dname} T{t} K{k} N{n_out}",
                      lambda: int8_linear_case(device, dtype, t, k, n_out, 62), op="int8_linear")
        for t, k, n_out, group in ((1, 896, 1152, 128), (7, 4864, 896, 128), (16, 768, 33, 384)):
            cases.run(f"int4_linear {dname} T{t} K{k} N{n_out} G{group}",
                      lambda: int4_linear_case(device, dtype, t, k, n_out, group, 63), op="int4_linear")
        moe_shape = (64, 32, 8, 2) if args.quick else (2048, 1024, 64, 8)  # OLMoE: H2048 I1024, 64 experts top-8
        mw = moe_weights(device, dtype, *moe_shape[:3], 52)
        for groups, ratio, budget in (([1], 0.0, 0), ([4], 0.1, 0), ([16], 0.0, 0), ([3, 13], 0.1, 12)):
            cases.run(f"moe {dname} H{moe_shape[0]} I{moe_shape[1]} E{moe_shape[2]} top{moe_shape[3]} "
                      f"groups{groups} ratio{ratio} budget{budget}",
                      lambda: moe_case(device, dtype, *moe_shape, groups, ratio, budget, 51, mw),
                      op="moe_route_and_prune,moe_grouped_dispatch")
        mw = None
    if device == "cuda":
        cases.run("CUDA graph capture + replay == eager (summaries, selection, sparse and dense attention, FFN, "
                  "MoE)", lambda: check_graph_replay(device), op="all")
        cases.run("non-default stream", lambda: check_side_stream(device), op="all")
    result.update(cases.summary())
    covered = set()
    for r in cases.results:
        if r["status"] == "ok":
            covered.update(r.get("op", "").split(","))
    from vllm_sparsever._custom_ops import OP_NAMES

    result["ops_checked"] = sorted(op for op in OP_NAMES if op in covered or "all" in covered and device == "cuda")
    if result["failed"] or result["simt_suite"]["status"] != "ok":
        raise CaseFailures(f"{result['failed']} of {result['cases']} cases failed; SIMT suite "
                           f"{result['simt_suite']['status']}", result)
    return result


# ---- phase: sanitizer ------------------------------------------------------------------------------------

def sanitizer_workload() -> None:
    """One small call of each op (a split attention case, head_dim 256 too), synchronised; run under
    compute-sanitizer by the sanitizer phase."""
    from vllm_sparsever import _custom_ops  # noqa: F401

    for c in [dict(dtype=torch.bfloat16, layout="gpu", head_dim=128, hkv=2, group=4, seqs=[(1500, 4), (30, 2)],
                   use_tree=True, top_k=4, block_size=16, seed=1),
              dict(dtype=torch.float16, layout="cpu", head_dim=256, hkv=1, group=2, seqs=[(900, 3)],
                   use_tree=False, top_k=None, block_size=16, seed=2)]:
        attention_case("cuda", **c)
    gen = torch.Generator().manual_seed(3)
    w_gate_up = (torch.randn(256, 128, generator=gen) / 11).to(torch.bfloat16)
    w_down_t = (torch.randn(128, 128, generator=gen) / 11).to(torch.bfloat16)
    ffn_case("cuda", torch.bfloat16, 128, 128, [2, 5], 0.25, 4,
             (w_gate_up, w_down_t, w_gate_up.cuda(), w_down_t.cuda()))
    ffn_gated_case("cuda", torch.bfloat16, 128, 96, [3, 4], 5)
    moe_case("cuda", torch.bfloat16, 128, 64, 8, 2, [3, 4], 0.1, 3, 6)
    torch.cuda.synchronize()
    print("sanitizer workload done", flush=True)


def sanitizer(args, out: Path) -> dict:
    if args.device != "cuda":
        raise Skip("compute-sanitizer needs a GPU")
    tool_path = find_tool("compute-sanitizer")
    if tool_path is None:
        raise Skip("compute-sanitizer not found")
    result: dict = {}
    for tool in ("memcheck", "racecheck"):
        timeout = min(args.sanitizer_timeout, T0 + args.hard_limit - time.monotonic())
        if timeout < 30:
            result[tool] = {"status": "skipped", "why": f"out of time (--hard-limit {args.hard_limit} s)"}
            continue
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20"]
        if tool == "racecheck":  # instrument only our kernels (torch's own are not under test here)
            cmd += ["--kernel-name", "kns=sparsever"]
        cmd += [sys.executable, str(Path(__file__).resolve()), str(out), "--sanitizer-workload"]
        rc, text = run_cmd(cmd, out / f"sanitizer_{tool}.log", timeout=timeout)
        summary = [ln.strip() for ln in text.splitlines() if "SUMMARY" in ln]
        result[tool] = {"rc": rc, "summary": summary[-1] if summary else None,
                        "workload_finished": "sanitizer workload done" in text,
                        "status": "ok" if rc == 0 and "sanitizer workload done" in text else "failed"}
        log(f"  {tool}: rc {rc}, {result[tool]['summary']}")
    if any(r["status"] == "failed" for r in result.values()):
        raise CaseFailures("compute-sanitizer reported errors or did not finish (see sanitizer_*.log)", result)
    return result


# ---- phase: speed -----------------------------------------------------------------------------------------

class Timer:
    """Median time of fn(): CUDA events around each call with the L2 flushed before it, or perf_counter."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
            self.flush_buf = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device="cuda")

    def __call__(self, fn, reps: int = 20, warmup: int = 3) -> dict:
        for _ in range(warmup):
            fn()
        times = []
        if self.device == "cuda":
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(reps)]
            for start, end in events:
                self.flush_buf.zero_()  # evict the previous call's data from L2
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e-3 for s, e in events]
        else:
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


def copy_bandwidth(device: str, timer: Timer, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), reps=10)
    return {"bytes": 2 * nbytes, "median_s": t["median_s"], "gbps": 2 * nbytes / t["median_s"] / 1e9}


def sdpa_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """torch SDPA on contiguous K/V (flash where the build has it): q [1, Hq, T, D], k/v [1, Hkv, S, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for backend in backends if q.is_cuda else [None]:
        try:
            if backend is None:
                fn = lambda: f(q, k, v, enable_gqa=True)  # noqa: E731
            else:
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return f(q, k, v, enable_gqa=True)
            fn()
            return fn, (backend.name if backend is not None else "default")
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


_FLEX = {}


def flex_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int):
    """FlexAttention with the exact verify mask (each draft token sees the context and the drafts up to itself):
    q [B, Hq, T, D], k/v [B, Hkv, ctx + T, D]. Compiled on CUDA (its short-query path splits the KV across the
    GPU); eager on CPU. The block mask is built once per shape, outside the timed call."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # torch.compile's defaults, as a user calls it: the first shape compiles static, the next ones share
        # one dynamic-shape compile (a compile per shape would take minutes of the GPU machine's time).
        _FLEX["fn"] = torch.compile(flex_attention) if q.is_cuda else flex_attention

    def verify_mask(b, h, q_idx, kv_idx):
        return kv_idx <= ctx + q_idx

    mask = create_block_mask(verify_mask, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device)
    fn = _FLEX["fn"]
    return lambda: fn(q, k, v, block_mask=mask, enable_gqa=True)


def cuda_core_attention(fn):
    """fn with the CUDA-core attention kernel (SPARSEVER_CUDA_ATTENTION=cuda_cores): the path before tensor cores."""
    def run():
        os.environ["SPARSEVER_CUDA_ATTENTION"] = "cuda_cores"
        try:
            return fn()
        finally:
            os.environ.pop("SPARSEVER_CUDA_ATTENTION", None)
    return run


def speed_attention(device: str, timer: Timer, ctx: int, q_len: int, reps: int, bw: float, requests: int = 1) -> dict:
    from vllm_sparsever import _custom_ops as ops

    hq, hkv, hd, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    per_req = -(-(ctx + q_len) // bs)
    n_blocks = per_req * requests
    # vLLM 0.32's FlashAttention cache (docs/compat.md): [num_blocks, block_size, Hkv, 2 * D], K then V in each
    # token's row; the op takes [nb, Hkv, bs, D] strided views of it.
    kv = torch.randn(n_blocks, bs, hkv, 2 * hd, device=device).to(dtype)
    k_cache, v_cache = kv[..., :hd].transpose(1, 2), kv[..., hd:].transpose(1, 2)
    perm = torch.randperm(n_blocks, device=device).int()
    table = perm.view(requests, per_req)
    seq_lens = torch.full((requests,), ctx + q_len, dtype=torch.int32, device=device)
    qlens = torch.full((requests,), q_len, dtype=torch.int32, device=device)
    qsl = torch.arange(requests + 1, dtype=torch.int32, device=device) * q_len
    query = torch.randn(requests * q_len, hq, hd, device=device).to(dtype)
    scale = hd**-0.5
    out = torch.empty_like(query)
    kv_bytes = requests * 2 * (ctx + q_len) * hkv * hd * 2
    res: dict = {"ctx": ctx, "q_len": q_len, "requests": requests, "kv_bytes": kv_bytes,
                 "floor_s": kv_bytes / (bw * 1e9)}

    def dense_fn():
        return ops.block_sparse_tree_attention(query, k_cache, v_cache, table, seq_lens, qsl, scale, out=out)

    dense = timer(dense_fn, reps)
    cuda_cores = timer(cuda_core_attention(dense_fn), reps)
    res.update(ours_dense_s=dense["median_s"], ours_dense_cuda_cores_s=cuda_cores["median_s"],
               ours_dense_gbps=kv_bytes / dense["median_s"] / 1e9,
               tensor_cores_vs_cuda_cores=cuda_cores["median_s"] / dense["median_s"])
    # Contiguous K/V for SDPA and FlexAttention, in the logical order (a gather the paged kernel does not need).
    k_lin = k_cache[table.long()].permute(0, 2, 1, 3, 4).reshape(requests, hkv, -1, hd)[:, :, : ctx + q_len]
    v_lin = v_cache[table.long()].permute(0, 2, 1, 3, 4).reshape(requests, hkv, -1, hd)[:, :, : ctx + q_len]
    k_lin, v_lin = k_lin.contiguous(), v_lin.contiguous()
    q4 = query.view(requests, q_len, hq, hd).transpose(1, 2)
    try:
        flex = timer(flex_baseline(q4, k_lin, v_lin, ctx), reps)
        res["flex_s"] = flex["median_s"]
    except Exception as e:  # reported, and the aims that need it are "not met"
        res["flex_s"], res["flex_error"] = None, f"{type(e).__name__}: {str(e)[:300]}"
    best = [res["flex_s"]] if res["flex_s"] else []
    if requests == 1:
        # SDPA has no verify mask for q > 1 at an offset: unmasked over the whole context (a lower bound).
        fn, backend = sdpa_baseline(q4, k_lin, v_lin)
        base = timer(fn, reps)
        res.update(sdpa_backend=backend, sdpa_s=base["median_s"], sdpa_gbps=kv_bytes / base["median_s"] / 1e9,
                   dense_vs_sdpa=base["median_s"] / dense["median_s"])
        best.append(base["median_s"])
    res["best_exact_s"] = min(best) if best else None
    res["dense_vs_best"] = res["best_exact_s"] / dense["median_s"] if best else None
    res["ours_dense_of_copy_bw"] = res["ours_dense_gbps"] / bw
    if requests > 1:
        return res
    kmin = torch.empty(n_blocks, hkv, hd, device=device)
    kmax = torch.empty(n_blocks, hkv, hd, device=device)
    ops.update_block_key_summaries(k_cache, torch.arange(n_blocks * bs, device=device), bs, kmin, kmax)
    pooled = query.float().mean(0, keepdim=True)
    ctx_blocks = ctx // bs
    for frac in (8, 4):
        top_k = max(1, ctx_blocks // frac - 3)  # + 1 sink + 2 local = 1/frac of the context blocks
        sel = torch.empty(1, hkv, top_k + 3, dtype=torch.int32, device=device)
        nsel = torch.empty(1, hkv, dtype=torch.int32, device=device)

        def sparse(top_k=top_k, sel=sel, nsel=nsel):
            ops.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, qlens, bs, top_k, 1, 2, sel, nsel)
            ops.block_sparse_tree_attention(query, k_cache, v_cache, table, seq_lens, qsl, scale, sel, nsel, out=out)

        t = timer(sparse, reps)
        select_only = timer(lambda top_k=top_k, sel=sel, nsel=nsel: ops.select_kv_blocks(
            pooled, kmin, kmax, table, seq_lens, qlens, bs, top_k, 1, 2, sel, nsel), reps)
        read = kv_bytes * (top_k + 3) / max(ctx_blocks, 1) + 2 * n_blocks * hkv * hd * 4  # + the summaries
        res[f"ours_sparse_1_{frac}_s"] = t["median_s"]
        res[f"select_1_{frac}_s"] = select_only["median_s"]
        res[f"ours_sparse_1_{frac}_gbps"] = read / t["median_s"] / 1e9
        res[f"sparse_1_{frac}_vs_sdpa"] = res["sdpa_s"] / t["median_s"]
        res[f"sparse_1_{frac}_vs_best"] = res["best_exact_s"] / t["median_s"]
    return res


def speed_ffn(device: str, timer: Timer, h: int, inter: int, tokens: int, reps: int, bw: float) -> dict:
    from vllm_sparsever import _custom_ops as ops

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    esize = torch.finfo(dtype).bits // 8
    w_gate_up = (torch.randn(2 * inter, h, device=device) / h**0.5).to(dtype)
    w_down = (torch.randn(h, inter, device=device) / inter**0.5).to(dtype)
    w_down_t = w_down.t().contiguous()
    x = torch.randn(tokens, h, device=device).to(dtype)
    gsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    F = torch.nn.functional

    def dense():
        gu = F.linear(x, w_gate_up)
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w_down)

    base = timer(dense, reps)
    dense_bytes = 3 * h * inter * esize
    res = {"tokens": tokens, "hidden": h, "intermediate": inter, "dtype": str(dtype)[6:], "dense_s": base["median_s"],
           "dense_gbps": dense_bytes / base["median_s"] / 1e9}
    for keep in (0.25, 0.5):
        k = int(keep * inter)
        out = torch.empty_like(x)
        sel = torch.empty(1, k, dtype=torch.int32, device=device)
        t = timer(lambda k=k, out=out, sel=sel: ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, k, out, sel), reps)
        read = h * inter * esize * (1 + 2 * keep)  # the whole gate, the kept up and down rows
        res[f"topk_{keep}_s"] = t["median_s"]
        res[f"topk_{keep}_gbps"] = read / t["median_s"] / 1e9
        res[f"topk_{keep}_vs_dense"] = base["median_s"] / t["median_s"]
    # A cheaper predictor (TEAL-style input sparsity): the gate from the group's top half of the input
    # channels by |x| (reads half of w_gate), then the same top-k over it: 1/6 + 2 keep / 3 of the bytes.
    # Its quality: bench/ffn_quality.py.
    w_gate_t = w_gate_up[:inter].t().contiguous()
    w_up = w_gate_up[inter:]
    k, in_keep = int(0.25 * inter), h // 2
    out, sel = torch.empty_like(x), torch.empty(1, k, dtype=torch.int32, device=device)

    def teal():
        gate, _ = ops.input_sparse_gate(x, w_gate_t, gsl, in_keep)
        ops.topk_swiglu_ffn_gated(x, gate, w_up, w_down_t, gsl, k, out, sel)

    t = timer(teal, reps)
    res.update(input_sparse_0_5_topk_0_25_s=t["median_s"], input_sparse_0_5_topk_0_25_vs_dense=base["median_s"] / t["median_s"])
    res["dense_of_copy_bw"] = res["dense_gbps"] / bw
    return res


def speed_moe(device: str, timer: Timer, h: int, inter: int, num_experts: int, top_k: int, tokens: int, reps: int,
              bw: float) -> dict:
    from vllm_sparsever import _custom_ops as ops

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    esize = torch.finfo(dtype).bits // 8
    w13 = (torch.randn(num_experts, 2 * inter, h, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, device=device) / inter**0.5).to(dtype)
    x = torch.randn(tokens, h, device=device).to(dtype)
    logits = torch.randn(tokens, num_experts, device=device) * 2
    F = torch.nn.functional

    def loop():  # the per-expert loop of HF-style MoE blocks (its host sync included)
        probs = logits.softmax(-1)
        w, ids = probs.topk(top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[tok], w13[e])
            y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w2[e])
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out.to(dtype)

    def ours():
        w, ids = ops.moe_route_and_prune(logits, top_k, 0.0, None, 0, True)
        return ops.moe_grouped_dispatch(x, w, ids, w13, w2)

    def grouped_gemm():  # route, sort by expert, torch's grouped matrix multiply, weighted scatter back
        w, ids = logits.softmax(-1).topk(top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = flat.argsort()
        tok = order // top_k
        offs = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(gu[:, :inter]) * gu[:, inter:], w2.transpose(1, 2), offs=offs)
        out = torch.zeros_like(x, dtype=torch.float32)
        return out.index_add_(0, tok, y.float() * w.flatten()[order, None]).to(dtype)

    _, used = ours()
    n_used = int(used.cpu())
    read = n_used * 3 * h * inter * esize
    base, t = timer(loop, reps), timer(ours, reps)
    res = {"tokens": tokens, "experts": num_experts, "top_k": top_k, "hidden": h, "intermediate": inter,
           "experts_used": n_used, "loop_s": base["median_s"], "ours_s": t["median_s"],
           "ours_gbps": read / t["median_s"] / 1e9, "ours_vs_loop": base["median_s"] / t["median_s"],
           "ours_of_copy_bw": read / t["median_s"] / 1e9 / bw, "grouped_gemm_s": None}
    try:
        torch.testing.assert_close(grouped_gemm().float(), loop().float(), rtol=5e-2, atol=5e-2)
        g = timer(grouped_gemm, reps)
        res.update(grouped_gemm_s=g["median_s"], ours_vs_grouped_gemm=g["median_s"] / t["median_s"])
    except Exception as e:  # torch._grouped_mm needs a recent GPU (sm_90+) and 16-byte-aligned shapes
        res["grouped_gemm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def speed(args, out: Path, deadline: float) -> dict:
    from vllm_sparsever import _custom_ops  # noqa: F401

    device = args.device
    timer = Timer(device)
    torch.manual_seed(0)
    quick = args.quick
    bw = copy_bandwidth(device, timer, (64 << 20) if quick else (1 << 30))
    log(f"  copy bandwidth {bw['gbps']:.0f} GB/s (read + write)")
    result: dict = {"copy_bandwidth": bw, "attention": [], "batched": [], "ffn": [], "moe": [], "skipped": []}
    reps = 5 if quick else 20
    if device == "cuda":
        attn = [(ctx, q) for ctx in (8192, 32768, 131072) for q in (1, 4, 8, 16)]
        batched = [(32768, 4, r) for r in (8, 32)]
        ffn = [(4096, 14336, t) for t in (1, 4, 8, 16)]
        moe = [(2048, 1024, 64, 8, t) for t in (1, 4, 16)]
    else:
        attn = [(2048, 4)] if quick else [(ctx, q) for ctx in (8192, 32768) for q in (4, 16)]
        batched = [(1024, 4, 2)] if quick else [(8192, 4, 8)]
        ffn = [(512, 1536, 4)] if quick else [(1536, 8960, t) for t in (1, 4, 16)]
        moe = [(256, 128, 8, 2, 4)] if quick else [(1024, 512, 64, 8, t) for t in (1, 4, 16)]
    jobs = ([("attention", speed_attention, a) for a in attn]
            + [("batched", batched_attention, a) for a in batched] + [("ffn", speed_ffn, a) for a in ffn]
            + [("moe", speed_moe, a) for a in moe])
    failures = []
    for kind, fn, a in jobs:
        if time.monotonic() > deadline:
            result["skipped"].append(f"{kind} {a}: out of time")
            continue
        try:
            r = fn(device, timer, *a, reps, bw["gbps"])
            result[kind].append(r)
            log(f"  {kind} {a}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()
                                              if isinstance(v, float) and ("vs" in k or "of_copy" in k)))
        except Exception as e:
            failures.append(f"{kind} {a}: {type(e).__name__}: {e}")
            log(f"  FAILED {kind} {a}: {e}")
        if device == "cuda":
            torch.cuda.empty_cache()
    result["failures"] = failures
    if device == "cuda" and not quick:
        summary = gpu_summary(result, args.commit)
        (out / "gpu.json").write_text(json.dumps(summary, indent=1) + "\n")
        log(f"  wrote {out / 'gpu.json'} (copy it to bench/results/summary/gpu.json); aims: {summary['aims']}")
    if failures:
        raise CaseFailures(f"{len(failures)} speed cases failed", result)
    return result


def batched_attention(device: str, timer: Timer, ctx: int, q_len: int, requests: int, reps: int, bw: float) -> dict:
    return speed_attention(device, timer, ctx, q_len, reps, bw, requests=requests)


def _us(x):
    return None if x is None else round(1e6 * x, 2)


def gpu_summary(speed_result: dict, commit: str | None) -> dict:
    """bench/results/summary/gpu.json (the keys issue 60 names) from the speed phase, with each aim met or not."""
    import torch as _t

    bw = speed_result["copy_bandwidth"]["gbps"]
    attention: dict = {}
    for r in speed_result["attention"]:
        attention.setdefault(str(r["ctx"]), {})[str(r["q_len"])] = {
            "floor_us": _us(r["floor_s"]), "ours_dense_us": _us(r["ours_dense_s"]),
            "ours_dense_cuda_cores_us": _us(r["ours_dense_cuda_cores_s"]),
            "ours_sparse_1_8_us": _us(r.get("ours_sparse_1_8_s")), "select_us": _us(r.get("select_1_8_s")),
            "flex_us": _us(r.get("flex_s")), "sdpa_us": _us(r.get("sdpa_s")),
            "flashinfer_us": None,  # its wheel does not travel to the GPU machine (issue 60)
        }
    batched = {str(r["requests"]): {"ours_dense_us": _us(r["ours_dense_s"]), "flex_us": _us(r.get("flex_s")),
                                    "floor_us": _us(r["floor_s"])} for r in speed_result["batched"]}
    ffn = {str(r["tokens"]): {"dense_us": _us(r["dense_s"]), "keep_0_25_us": _us(r["topk_0.25_s"]),
                              "keep_0_5_us": _us(r["topk_0.5_s"]),
                              "input_sparse_0_5_keep_0_25_us": _us(r.get("input_sparse_0_5_topk_0_25_s"))}
           for r in speed_result["ffn"]}
    moe = {str(r["tokens"]): {"ours_us": _us(r["ours_s"]), "grouped_gemm_us": _us(r.get("grouped_gemm_s")),
                              "GBps": round(r["ours_gbps"], 1)} for r in speed_result["moe"]}

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    def all_of(cells) -> bool:
        cells = list(cells)
        return bool(cells) and all(cells)

    rows = [(c, q, v) for c, qs in attention.items() for q, v in qs.items()]
    best = lambda v: min([x for x in (v["flex_us"], v["sdpa_us"]) if x is not None], default=None)  # noqa: E731
    long_short = [(c, q, v) for c, q, v in rows if c in ("32768", "131072") and int(q) <= 8]
    aims = {
        "dense_vs_best": met(all_of(best(v) is not None and v["ours_dense_us"] <= best(v) for _, _, v in rows)),
        "dense_roof": met(all_of(v["floor_us"] / v["ours_dense_us"] >= 0.7 for _, _, v in long_short)),
        "sparse_vs_best": met(all_of(
            best(v) is not None and v["ours_sparse_1_8_us"] is not None
            and best(v) / v["ours_sparse_1_8_us"] >= (3.0 if c != "8192" else 1.5)
            for c, q, v in rows if int(q) <= 8)),
        # predictor included: the gate's top-k, or the cheaper input-sparse predictor where it is faster
        "ffn": met(all_of(v["dense_us"] / min(x for x in (v["keep_0_25_us"], v["input_sparse_0_5_keep_0_25_us"]) if x)
                          >= (1.6 if int(t) <= 4 else 1.2) for t, v in ffn.items())),
        "moe": met(all_of(v["grouped_gemm_us"] is not None and v["ours_us"] <= v["grouped_gemm_us"]
                          and v["GBps"] >= 0.6 * bw for v in moe.values())),
    }
    return {"device": _t.cuda.get_device_name(0) if _t.cuda.is_available() else "cpu", "commit": commit or "unknown",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "copy_GBps": round(bw, 1), "shapes": "batch 1 unless said; Hq 32 / Hkv 8, D128, bf16, L2 flushed",
            "attention": attention, "batched": batched, "ffn": ffn, "moe": moe, "aims": aims,
            "notes": {"flashinfer_us": "null: FlashInfer's wheel (62 MB with its dependencies) cannot reach the GPU "
                                      "machine, which takes the tree plus 64 MiB",
                      "sdpa_us": "SDPA runs without the verify mask (every query sees every key): a lower bound"}}


# ---- markdown -----------------------------------------------------------------------------------------------

def markdown(data: dict) -> str:
    lines = [f"# sparsever GPU check kit: {data['device']}{' (--quick)' if data['quick'] else ''}", "",
             f"`{data['command']}`, {data['date']}, commit {data.get('commit') or 'unknown'}, "
             f"{data.get('total_seconds', 0)} s", "", "| phase | status | seconds | note |", "|---|---|---|---|"]
    for name, p in data["phases"].items():
        note = p.get("error") or p.get("why") or ""
        if name == "correctness" and "cases" in p:
            note = f"{p['cases'] - p['failed']}/{p['cases']} cases ok; SIMT suite: {p['simt_suite']['summary']}"
        if name == "build" and "loaded" in p:
            note = f"{p.get('cuda_archs', '')} loaded {p['loaded']}"
        lines.append(f"| {name} | {p['status']} | {p['seconds']} | {str(note).splitlines()[0][:160] if note else ''} |")
    probe_ = data["phases"].get("probe", {})
    if probe_.get("status") == "ok":
        keys = ["gpu", "capability", "sms", "l2_mib", "driver", "torch", "torch_cuda", "nvcc", "compute_sanitizer",
                "cpu", "cmake", "ninja"]
        lines += ["", "## Probe", ""] + [f"- {k}: {probe_[k]}" for k in keys if probe_.get(k) is not None]
    corr = data["phases"].get("correctness", {})
    failed = [r for r in corr.get("results", []) if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed cases", ""] + [f"- {r['case']}: {r['error'][:300]}" for r in failed[:40]]
    sp = data["phases"].get("speed", {})
    fmt = lambda x, scale=1e6, d=0: "-" if x is None else f"{scale * x:.{d}f}"  # noqa: E731
    if sp.get("attention"):
        bw = sp["copy_bandwidth"]["gbps"]
        lines += ["", f"## Speed (median; copy bandwidth {bw:.0f} GB/s read + write)", "",
                  "Attention, Hq 32 / Hkv 8, D128, bf16, batch 1 (times in us; floor = K/V bytes / copy bandwidth; "
                  "x = best exact baseline / ours; SDPA runs without the verify mask):", "",
                  "| ctx | q | floor | FlexAttention | SDPA (backend) | ours dense | x | % floor | ours CUDA cores "
                  "| sparse 1/8 (select) | x | sparse 1/4 | x |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sp["attention"]:
            lines.append(f"| {r['ctx']} | {r['q_len']} | {fmt(r['floor_s'], d=1)} | {fmt(r.get('flex_s'))} | "
                         f"{fmt(r.get('sdpa_s'))} ({r.get('sdpa_backend')}) | {fmt(r['ours_dense_s'])} | "
                         f"{fmt(r.get('dense_vs_best'), 1, 2)} | {fmt(r['floor_s'] / r['ours_dense_s'], 100)} | "
                         f"{fmt(r['ours_dense_cuda_cores_s'])} | {fmt(r.get('ours_sparse_1_8_s'))} "
                         f"({fmt(r.get('select_1_8_s'))}) | {fmt(r.get('sparse_1_8_vs_best'), 1, 2)} | "
                         f"{fmt(r.get('ours_sparse_1_4_s'))} | {fmt(r.get('sparse_1_4_vs_best'), 1, 2)} |")
    if sp.get("batched"):
        lines += ["", "Attention with several requests (times in us):", "",
                  "| requests | ctx | q | floor | FlexAttention | ours dense | x | ours CUDA cores |", "|---|---|---|---|---|---|---|---|"]
        for r in sp["batched"]:
            lines.append(f"| {r['requests']} | {r['ctx']} | {r['q_len']} | {fmt(r['floor_s'], d=1)} | "
                         f"{fmt(r.get('flex_s'))} | {fmt(r['ours_dense_s'])} | {fmt(r.get('dense_vs_best'), 1, 2)} | "
                         f"{fmt(r['ours_dense_cuda_cores_s'])} |")
    if sp.get("ffn"):
        lines += ["", "Top-k SwiGLU FFN vs linear -> silu*mul -> linear (times in us; predictor included; "
                  "input-sparse: the gate from half the input channels, keep 0.25):", "",
                  "| H x I | tokens | dense | dense GB/s | keep 0.25 | x | keep 0.5 | x | input-sparse | x |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sp["ffn"]:
            lines.append(f"| {r['hidden']}x{r['intermediate']} | {r['tokens']} | {1e6 * r['dense_s']:.0f} | "
                         f"{r['dense_gbps']:.0f} | {1e6 * r['topk_0.25_s']:.0f} | {r['topk_0.25_vs_dense']:.2f} | "
                         f"{1e6 * r['topk_0.5_s']:.0f} | {r['topk_0.5_vs_dense']:.2f} | "
                         f"{fmt(r.get('input_sparse_0_5_topk_0_25_s'))} | "
                         f"{fmt(r.get('input_sparse_0_5_topk_0_25_vs_dense'), 1, 2)} |")
    if sp.get("moe"):
        lines += ["", "MoE route + grouped dispatch vs torch's grouped GEMM and a per-expert loop (times in us):", "",
                  "| experts / top-k | H x I | tokens | used | loop | grouped GEMM | ours | x grouped | ours GB/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sp["moe"]:
            lines.append(f"| {r['experts']}/{r['top_k']} | {r['hidden']}x{r['intermediate']} | {r['tokens']} | "
                         f"{r['experts_used']} | {1e6 * r['loop_s']:.0f} | {fmt(r.get('grouped_gemm_s'))} | "
                         f"{1e6 * r['ours_s']:.0f} | {fmt(r.get('ours_vs_grouped_gemm'), 1, 2)} | {r['ours_gbps']:.0f} |")
    return "\n".join(lines) + "\n"


# ---- main -----------------------------------------------------------------------------------------------------

PHASES = ["probe", "build", "correctness", "sanitizer", "speed"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory for check.json, check.md and the logs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, fewer cases (the test suite's form)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--skip-build", action="store_true", help="use the extension already built in the package")
    p.add_argument("--build-dir", default=None)
    p.add_argument("--commit", default=None, help="recorded in the report (the device machine has no .git)")
    p.add_argument("--time-limit", type=float, default=480, help="seconds; speed cases past it are skipped")
    p.add_argument("--hard-limit", type=float, default=600,
                   help="seconds; the sanitizer's runs are cut to end before it")
    p.add_argument("--simt-timeout", type=float, default=240)
    p.add_argument("--sanitizer-timeout", type=float, default=120)
    p.add_argument("--sanitizer-workload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sanitizer_workload:
        sanitizer_workload()
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    phases = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        p.error(f"--phases: unknown {unknown}; allowed: {PHASES}")
    if args.commit is None:
        rc, text = run_cmd(["git", "rev-parse", "--short", "HEAD"], timeout=10)
        args.commit = text.strip() if rc == 0 else None
    report = Report(args.out, args)
    deadline = T0 + args.time_limit
    for name in phases:  # in the order given
        if name == "probe":
            report.phase("probe", probe, args)
        elif name == "build" and not args.skip_build:
            if report.phase("build", build, args, args.out)["status"] == "failed":
                log("the build failed: the later phases need the extension, stopping")
                break
        elif name == "correctness":
            report.phase("correctness", correctness, args, args.out)
        elif name == "sanitizer":
            report.phase("sanitizer", sanitizer, args, args.out)
        elif name == "speed":
            report.phase("speed", speed, args, args.out, deadline)
    report.write()
    print(markdown(report.data))
    failed = [n for n, ph in report.data["phases"].items() if ph["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
