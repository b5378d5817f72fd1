"""`fleetcuda doctor`: what the seeds had to find out by hand, gathered per target in one round trip.

nvcc (where, which release) for CUDA_HOME, /usr/local/cuda-X.Y and PATH; torch's version, CUDA and
arch list; the GPUs' compute capability; causal_conv1d and fla importable (and one tiny kernel each
where a GPU is visible); transformers' GatedDeltaNet fast path per function in both gate styles; and
causal-conv1d wheels in pip's or uv's cache that were built before the installed torch (stale).
Read-only. The script prints one JSON document between markers, not text to scrape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetcuda.plan.command import BuiltCommand, Invocation, build, quote
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import base_env

MARK = "@@fleetcuda-doctor"

_NVCC = r"""nvcc_json() {  # where -> path, release
  local where=$1 nvcc=$2 rel=""
  if [ -x "$nvcc" ]; then rel=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p'); fi
  printf '{"where": "%s", "path": "%s", "release": "%s"}' "$where" "$nvcc" "$rel"
}
items=()
[ -n "${CUDA_HOME:-}" ] && items+=("$(nvcc_json CUDA_HOME "$CUDA_HOME/bin/nvcc")")
for d in /usr/local/cuda /usr/local/cuda-*; do [ -e "$d/bin/nvcc" ] && items+=("$(nvcc_json "$d" "$d/bin/nvcc")"); done
p=$(command -v nvcc 2>/dev/null) && items+=("$(nvcc_json PATH "$p")")
NVCC_FOUND="[$(IFS=,; echo "${items[*]}")]"
GPU_CAPS=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | paste -sd';' - || true)
export NVCC_FOUND GPU_CAPS
"""

_PY = r'''import glob, importlib, json, os, sys, time
r = {"python": sys.version.split()[0], "nvcc": json.loads(os.environ.get("NVCC_FOUND") or "[]"),
     "gpus": os.environ.get("GPU_CAPS", ""), "cuda_home": os.environ.get("CUDA_HOME", "")}
def attempt(name, fn):
    try:
        r[name] = fn()
    except BaseException as exc:
        r[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
def torch_info():
    import torch
    info = {"version": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.is_available()}
    info["arch_list"] = torch.cuda.get_arch_list() if info["gpu"] else []
    if info["gpu"]:
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    info["installed_at"] = os.path.getmtime(os.path.dirname(torch.__file__))
    return info
attempt("torch", torch_info)
gpu = isinstance(r["torch"], dict) and r["torch"].get("gpu")
def cc1d():
    import causal_conv1d
    out = {"version": getattr(causal_conv1d, "__version__", "?"), "path": os.path.dirname(causal_conv1d.__file__)}
    if gpu:
        import torch
        from causal_conv1d import causal_conv1d_fn
        x = torch.randn(1, 64, 32, device="cuda", dtype=torch.bfloat16)
        causal_conv1d_fn(x, torch.randn(64, 4, device="cuda", dtype=torch.bfloat16), None, activation="silu")
        torch.cuda.synchronize()
        out["kernel"] = "ran"
    return out
def fla():
    import fla as f
    out = {"version": getattr(f, "__version__", "?")}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    if gpu:
        import torch
        q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(1, 64, 2, 64, device="cuda"), dim=-1).bfloat16()
        g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 2, device="cuda"))
        chunk_gated_delta_rule(q, k, q.clone(), g, torch.rand(1, 64, 2, device="cuda").sigmoid())
        torch.cuda.synchronize()
        out["kernel"] = "ran"
    return out
attempt("causal_conv1d", cc1d)
attempt("fla", fla)
def gate():
    import transformers
    out = {"version": transformers.__version__, "modules": {}}
    for modname in ("transformers.models.qwen3_5.modeling_qwen3_5",
                    "transformers.models.qwen3_next.modeling_qwen3_next"):
        try:
            mod = importlib.import_module(modname)
        except Exception as exc:
            out["modules"][modname] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        if hasattr(mod, "is_fast_path_available"):
            out["modules"][modname] = {"style": "flag", "is_fast_path_available": bool(mod.is_fast_path_available)}
            continue
        funcs = {}
        for attr, fn in sorted(vars(mod).items()):
            code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
            if code is None or not cells or "implementation" not in code.co_freevars:
                continue
            free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
            impl = free["implementation"]
            where = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
            funcs[free.get("func_name", attr)] = where
        out["modules"][modname] = {"style": "wrapped", "functions": funcs}
    return out
attempt("transformers", gate)
caches = []
torch_at = r["torch"].get("installed_at") if isinstance(r["torch"], dict) else None
home = os.path.expanduser("~")
for pattern in (home + "/.cache/pip/wheels/**/causal_conv1d-*.whl", home + "/.cache/uv/**/causal_conv1d-*.whl",
                home + "/.cache/uv/**/causal_conv1d-*.dist-info"):
    for path in glob.glob(pattern, recursive=True):
        built = os.path.getmtime(path)
        caches.append({"path": path, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
                       "stale": bool(torch_at and built < torch_at)})
r["cached_causal_conv1d"] = caches
print(json.dumps(r))
'''


@dataclass
class Finding:
    check: str
    value: str
    status: str  # ok | warn | fail | info


def command(target: Target, home: str | None = None) -> BuiltCommand:
    script = "\n".join([
        _NVCC,
        f"echo {MARK} begin",
        f"{quote(target.python)} -c {quote(_PY)} || echo '{{\"error\": \"python failed\"}}'",
        f"echo {MARK} end",
    ])
    env = base_env(target, home)
    return build(target.chain, Invocation(script, env, timeout=300))


def parse(output: str) -> dict:
    lines = output.splitlines()
    try:
        start = lines.index(f"{MARK} begin")
        end = lines.index(f"{MARK} end", start)
    except ValueError:
        return {"error": "no report from the target: " + " / ".join(lines[-3:])}
    for line in reversed(lines[start + 1:end]):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": "no report from the target"}


def findings(report: dict) -> list[Finding]:
    out: list[Finding] = []
    if "error" in report and len(report) == 1:
        return [Finding("doctor", report["error"], "fail")]
    torch = report.get("torch", {})
    torch_cuda = torch.get("cuda") if isinstance(torch, dict) and "error" not in torch else None
    nvccs = report.get("nvcc", [])
    if not nvccs:
        out.append(Finding("nvcc", "not found (CUDA_HOME, /usr/local/cuda*, PATH)", "fail"))
    for n in nvccs:
        rel = n.get("release") or "?"
        match = torch_cuda and rel.split(".")[0] == str(torch_cuda).split(".")[0]
        out.append(Finding(f"nvcc via {n['where']}", f"{n['path']} release {rel}",
                           "ok" if match else ("warn" if torch_cuda else "info")))
    if isinstance(torch, dict) and "error" not in torch:
        archs = ", ".join(torch.get("arch_list") or []) or "-"
        out.append(Finding("torch", f"{torch['version']} (CUDA {torch_cuda}; archs {archs})", "ok"))
    else:
        out.append(Finding("torch", str(torch.get("error", "missing")), "fail"))
    gpus = report.get("gpus") or (f"capability {torch.get('capability')}" if torch.get("capability") else "")
    out.append(Finding("GPU", gpus or "none visible", "ok" if gpus else "info"))
    for name in ("causal_conv1d", "fla"):
        item = report.get(name, {})
        if "error" in item:
            out.append(Finding(name, item["error"], "fail"))
        else:
            kernel = "kernel ran" if item.get("kernel") else "kernel not run (no GPU)"
            out.append(Finding(name, f"{item.get('version')} imports; {kernel}", "ok"))
    tf = report.get("transformers", {})
    if "error" in tf:
        out.append(Finding("transformers", tf["error"], "info"))
    else:
        for modname, mod in tf.get("modules", {}).items():
            short = modname.rsplit(".", 1)[-1]
            if "error" in mod:
                out.append(Finding(f"transformers {short}", mod["error"], "info"))
            elif mod["style"] == "flag":
                ok = mod["is_fast_path_available"]
                out.append(Finding(f"transformers {tf['version']} {short}", f"is_fast_path_available={ok}",
                                   "ok" if ok else "fail"))
            else:
                for fn, impl in mod["functions"].items():
                    fast = impl.startswith(("causal_conv1d", "fla"))
                    out.append(Finding(f"transformers {tf['version']} {short}.{fn}", impl, "ok" if fast else "fail"))
    for c in report.get("cached_causal_conv1d", []):
        out.append(Finding("cached causal-conv1d wheel", f"{c['path']} (built {c['built']})",
                           "warn" if c["stale"] else "info"))
    return out


STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "dim"}


def render(results: dict[str, list[Finding]], console: Console) -> None:
    for target, items in results.items():
        table = Table(title=Text(f"doctor: {target}"), show_header=True, header_style="bold")
        for col in ("check", "found", "status"):
            table.add_column(col, overflow="fold")
        for f in items:
            table.add_row(Text(f.check), Text(f.value), Text(f.status, style=STYLE[f.status]))
        console.print(table)
