"""What importing the plugin adds to the start of every vLLM process (front end, engine core, worker).

vLLM runs `vllm_sparsever.register()` in each of its processes, so the plugin's import time is
paid once per process at every `vllm serve`. Each run is a fresh interpreter:

- front end: `import vllm.engine.arg_utils` (what vLLM's front end imports anyway), then
  `import vllm_sparsever; vllm_sparsever.register()`;
- worker: vLLM's own worker and runner modules (`vllm.v1.worker.cpu_worker`/`cpu_model_runner`,
  or the GPU ones), then the plugin plus what its worker imports at start (worker class, runner,
  sparse verification modules, metrics; this loads the C++ extension).

Times are taken inside the process around each step (the plugin's step is small next to vLLM's,
so a difference of two whole-process times would drown it in noise); the whole-process wall
time with and without the plugin is recorded too. A and B runs alternate. One extra run per
scenario under `python -X importtime` names the biggest modules the plugin's step imports.

    python bench/import_time.py [--runs 7] [--tag NAME]

Writes bench/results/import_time_<date>[_tag].json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, ROOT, binding_env, hardware, versions  # noqa: E402

from vllm_sparsever.integration import WORKER_MODULES  # noqa: E402

WORKER_PLUGIN_MODULES = list(WORKER_MODULES)

# Printed to stderr between vLLM's step and the plugin's, so `-X importtime` lines can be split.
MARK = "=== sparsever import_time: plugin step ==="

_SCRIPT = """
import json, sys, time
scenario, with_plugin, modules = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
t0 = time.perf_counter()
if scenario == "front_end":
    import vllm.engine.arg_utils
else:
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        import vllm.v1.worker.cpu_model_runner, vllm.v1.worker.cpu_worker
    else:
        import vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu_worker
t1 = time.perf_counter()
assert "vllm_sparsever" not in sys.modules, "vLLM loaded the plugin by itself: VLLM_PLUGINS not honoured"
plugin_s = None
if with_plugin:
    sys.stderr.write(MARK + "\\n"); sys.stderr.flush()
    import importlib
    import vllm_sparsever
    vllm_sparsever.register()
    if scenario == "worker":
        for name in modules:
            importlib.import_module(name)
    plugin_s = time.perf_counter() - t1
print("RESULT " + json.dumps({"vllm_s": t1 - t0, "plugin_s": plugin_s}))
""".replace("MARK", repr(MARK))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package, as the tests use it
    # vLLM must not load the installed entry point by itself: the script imports the plugin when asked.
    env["VLLM_PLUGINS"] = "none-for-import-time-baseline"
    return env


def run_once(scenario: str, with_plugin: bool, importtime: bool = False) -> dict:
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + [
        "-c", _SCRIPT, scenario, "1" if with_plugin else "0", json.dumps(WORKER_PLUGIN_MODULES)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd="/tmp", env=_env(), capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{scenario} run failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["process_wall_s"] = wall
    if importtime:
        result["top_plugin_imports"] = _top_imports_after_mark(proc.stderr)
    return result


def _top_imports_after_mark(stderr: str, n: int = 15) -> list[dict]:
    """Biggest `-X importtime` entries (cumulative, outermost first) imported in the plugin's step."""
    lines = stderr.splitlines()
    if MARK not in lines:
        return []
    entries = []
    for line in lines[lines.index(MARK) + 1:]:
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cumulative_us, name = (part.strip() for part in line[len("import time:"):].split("|"))
        depth = (len(name) - len(name.lstrip())) // 2
        entries.append({"module": name.strip(), "self_ms": int(self_us) / 1e3,
                        "cumulative_ms": int(cumulative_us) / 1e3, "depth": depth})
    entries.sort(key=lambda e: e["cumulative_ms"], reverse=True)
    return entries[:n]


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="runs per scenario and variant")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    raw: dict[str, dict[str, list[dict]]] = {}
    for scenario in ("front_end", "worker"):
        raw[scenario] = {"vllm_only": [], "with_plugin": []}
        for i in range(args.runs):  # alternate so drift in machine load hits both variants alike
            raw[scenario]["vllm_only"].append(run_once(scenario, with_plugin=False))
            raw[scenario]["with_plugin"].append(run_once(scenario, with_plugin=True))
            print(f"{scenario} run {i + 1}/{args.runs}: "
                  f"plugin {raw[scenario]['with_plugin'][-1]['plugin_s'] * 1e3:.1f} ms", flush=True)

    summary = {}
    top = {}
    for scenario, variants in raw.items():
        base, plug = variants["vllm_only"], variants["with_plugin"]
        summary[scenario] = {
            "vllm_import_s_median": median([r["vllm_s"] for r in base]),
            "plugin_step_ms_median": median([r["plugin_s"] for r in plug]) * 1e3,
            "plugin_step_ms_min": min(r["plugin_s"] for r in plug) * 1e3,
            "plugin_step_ms_max": max(r["plugin_s"] for r in plug) * 1e3,
            "process_wall_s_median_vllm_only": median([r["process_wall_s"] for r in base]),
            "process_wall_s_median_with_plugin": median([r["process_wall_s"] for r in plug]),
        }
        summary[scenario]["plugin_share_of_vllm_import_pct"] = (
            100 * summary[scenario]["plugin_step_ms_median"] / 1e3 / summary[scenario]["vllm_import_s_median"])
        top[scenario] = run_once(scenario, with_plugin=True, importtime=True)["top_plugin_imports"]

    stamp = dt.datetime.now().strftime("%Y-%m-%d")
    name = f"import_time_{stamp}" + (f"_{args.tag}" if args.tag else "")
    record = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "hardware": hardware(),
        "versions": versions(),
        "env": binding_env(),
        "runs": args.runs,
        "worker_plugin_modules": WORKER_PLUGIN_MODULES,
        "summary": summary,
        "top_plugin_imports": top,
        "raw": raw,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(_markdown(record))
    print(_markdown(record))
    print(f"wrote {RESULTS / name}.json/.md")


def _markdown(record: dict) -> str:
    hw = record["hardware"]
    lines = [
        "# Plugin import time at vLLM process start",
        "",
        f"`{record['command']}` on {record['date']}; {hw.get('Model name', '?')}, {hw.get('nproc')} cores, "
        f"load average {tuple(round(x, 2) for x in hw.get('loadavg_1_5_15', ()))} at the end; "
        f"{record['runs']} runs per variant, fresh process each, medians. Versions: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        "",
        "| process | vLLM's own imports (s) | + plugin (ms), median [min-max] | plugin / vLLM | "
        "whole process without / with plugin (s) |",
        "|---|---|---|---|---|",
    ]
    labels = {"front_end": "front end (`vllm.engine.arg_utils`; `register()`)",
              "worker": "worker (vLLM worker + runner; plugin worker, verification, metrics, extension)"}
    for scenario, s in record["summary"].items():
        lines.append(
            f"| {labels[scenario]} | {s['vllm_import_s_median']:.2f} | {s['plugin_step_ms_median']:.1f} "
            f"[{s['plugin_step_ms_min']:.1f}-{s['plugin_step_ms_max']:.1f}] | "
            f"{s['plugin_share_of_vllm_import_pct']:.2f}% | "
            f"{s['process_wall_s_median_vllm_only']:.2f} / {s['process_wall_s_median_with_plugin']:.2f} |")
    lines += ["", "Whole-process times differ by run-to-run noise larger than the plugin's step; "
              "the in-process step time is the measurement.", ""]
    for scenario, entries in record["top_plugin_imports"].items():
        lines += [f"Biggest imports of the plugin step, {scenario} (`-X importtime`, cumulative ms, one run):", ""]
        lines += [f"- `{e['module']}` {e['cumulative_ms']:.1f} (self {e['self_ms']:.1f})" for e in entries[:10]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
