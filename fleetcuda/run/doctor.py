"""`fleetcuda doctor`: what the seeds had to find out by hand, gathered per target in one round trip.

nvcc (where, which release) for CUDA_HOME, /usr/local/cuda-X.Y and PATH; torch's version, CUDA and
arch list; the GPUs' compute capability; causal_conv1d and fla importable (and one tiny kernel each
where a GPU is visible); transformers' GatedDeltaNet fast path per function in both gate styles; and
causal-conv1d wheels in pip's or uv's cache that were built before the installed torch (stale).
Read-only. The programs (fleetcuda/remote/doctor_probe.py, fast_path_gate.py: the recipe's gate) report in
frames (fleetcuda.remote.framing), not text to scrape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetcuda.plan.command import BuiltCommand, Invocation, build, quote
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.model import FULL, GATED_DELTA_NET, LINEAR, Model
from fleetcuda.plan.planner import FALSY, base_env, host_chain, host_env, in_target_argv, pct_argv
from fleetcuda.redact import printable
from fleetcuda.remote import framing, python_heredoc, shell_text

# One nonce per process (a doctor run): its frames, never what a target prints, are believed.
_NONCE = framing.new_nonce()


@dataclass
class Finding:
    check: str
    value: str
    status: str  # ok | warn | fail | info | unknown (could not be looked at; its reason in the value)


def command(target: Target, home: str | None = None) -> BuiltCommand:
    """doctor_probe, then fast_path_gate's transformers part (informative: REQUIRE_TRANSFORMERS=false), each
    reporting in a frame (the nonce: on stdin, then in the one program's environment); their other lines
    are not read."""
    script = "\n".join([
        python_heredoc(quote(target.python), "doctor_probe", env=framing.PYTHON_NONCE),
        python_heredoc(quote(target.python), "fast_path_gate", "--gate-only",
                       env=f"{framing.PYTHON_NONCE} REQUIRE_TRANSFORMERS=false"),
        "exit 0",
    ])
    env = base_env(target, home)
    return build(target.chain, Invocation(script, env, timeout=300, secret_vars=framing.nonce_vars(_NONCE)))


# -- the target's answer, typed: every field findings() and model_verdict() read has the type they read it as ----
#
# A record is checked against its shape, section by section; a section that does not have it becomes
# {"error": ...} (that target's failure, said in its report), never an exception of the run.

Shape = Any  # a type, a tuple of alternatives, {key: shape} (a key is required when its shape is _Must), [shape], _Map


@dataclass(frozen=True)
class _Map:
    """A mapping of any string keys to values of one shape."""

    value: Shape


@dataclass(frozen=True)
class _Must:
    """A key of a record that must be there."""

    value: Shape


_TEXT = (str,)
_SCALAR = (str, int, float, type(None))  # torch.version.cuda is None on a CPU build; a capability may be a number
_ERROR = {"error": _Must(_TEXT)}
_PACKAGE = ({"version": _SCALAR, "kernel": (bool, str, type(None)), "path": _TEXT}, _ERROR)
PROBE: dict[str, Shape] = {
    "python": _TEXT, "cuda_home": _TEXT, "gpus": _TEXT,
    "nvcc": ([{"where": _Must(_TEXT), "path": _Must(_TEXT), "release": _Must(_TEXT)}], _ERROR),
    "torch": (_ERROR, {"version": _Must(_TEXT), "cuda": _SCALAR, "gpu": (bool,), "arch_list": [_TEXT],
                       "capability": _SCALAR, "installed_at": (int, float, type(None))}),
    "causal_conv1d": _PACKAGE, "fla": _PACKAGE,
    "cached_causal_conv1d": [{"path": _Must(_TEXT), "built": _Must(_TEXT), "stale": _Must((bool,))}],
}
_MODULE = (_ERROR, {"style": _Must(("flag",)), "is_fast_path_available": _Must((bool,))},
           {"style": _Must(("wrapped",)), "functions": _Must(_Map(_TEXT)), "fast": _Map((bool,))})
GATE: Shape = (_ERROR, {"version": _Must(_TEXT), "modules": _Map(_MODULE)})
GPU: Shape = (_ERROR, {"driver": _SCALAR, "libs": _Map(_SCALAR), "failures": [_TEXT]})


def fits(value: Any, shape: Shape) -> bool:
    """Whether `value` (decoded JSON) has `shape`."""
    if isinstance(shape, _Map):
        return isinstance(value, dict) and all(isinstance(k, str) and fits(v, shape.value) for k, v in value.items())
    if isinstance(shape, dict):  # a record that is not an error holds no `error`: one or the other
        return isinstance(value, dict) and ("error" in shape or "error" not in value) and all(
            fits(value[k], s.value if isinstance(s, _Must) else s) if k in value else not isinstance(s, _Must)
            for k, s in shape.items())
    if isinstance(shape, list):
        return isinstance(value, list) and all(fits(v, shape[0]) for v in value)
    if isinstance(shape, tuple):  # alternatives: types, literal strings, or shapes
        return any(fits(value, s) if isinstance(s, (dict, list, tuple, _Map))
                   else (type(value) is s if isinstance(s, type) else value == s) for s in shape)
    return False


def typed(record: Any, shapes: dict[str, Shape]) -> dict[str, Any]:
    """The record's sections that have their shape; the others as {"error": ...}, named."""
    if not isinstance(record, dict):
        return {"error": f"the target's report is {type(record).__name__}, not a record"}
    out: dict[str, Any] = {}
    malformed = []
    for key, shape in shapes.items():
        if key not in record:
            continue
        if fits(record[key], shape):
            out[key] = record[key]
        elif isinstance(shape, tuple) and _ERROR in shape:  # a section that can say its own error
            out[key] = {"error": f"the target's {key} is malformed"}
        else:
            malformed.append(key)
    if malformed:
        out["malformed"] = malformed
    return out


def typed_section(record: Any, shape: Shape, what: str) -> dict[str, Any]:
    return dict(record) if fits(record, shape) and isinstance(record, dict) else {"error": f"{what} is malformed"}


def parse(output: str, nonce: str | None = None) -> dict:
    """The probe's report, typed (a malformed section is that section's error), with the gate's findings as its
    `transformers` entry."""
    found = framing.read(output, nonce or _NONCE)
    reports = [r.report for r in found if isinstance(r, framing.DoctorRecord)]
    if not reports:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        return {"error": "no report from the target: " + " / ".join(lines[-3:])}
    report = typed(reports[-1], PROBE)
    if "error" in report:
        return report
    for key in ("nvcc", "torch", "causal_conv1d", "fla"):
        report.setdefault(key, {"error": "not reported"})
    gates = [r.report for r in found if isinstance(r, framing.GateRecord)]
    report["transformers"] = (typed_section(gates[-1], GATE, "the fast-path gate's report") if gates
                              else {"error": "the fast-path gate did not report"})
    return report


def gpu_command(target: Target, cuda_version: str = "", home: str | None = None) -> BuiltCommand | None:
    """The recipe's GPU passthrough check (remote/gpu_passthrough.py), on the target's host (the machine
    itself without containers), for the CUDA the probe found in torch; None where the inventory turns it off
    (`check_gpu: false`). `gpu_devices_required: false` (a GPU-less lab) makes the device nodes informative."""
    if target.vars.get("check_gpu", "true").strip().lower() in FALSY:
        return None
    probe = in_target_argv(target, "fleetcuda-doctor")(shell_text("gpu_container_probe"))
    args = ["--container-probe", json.dumps(probe)]
    if (pct := pct_argv(target)) is not None:
        args += ["--pct-config", json.dumps(pct("config"))]
    args += ["--cuda-version", cuda_version, "--require-devices", target.vars.get("gpu_devices_required", "true")]
    script = python_heredoc("python3", "gpu_passthrough", " ".join(quote(a) for a in args), env=framing.PYTHON_NONCE)
    on_host = target.chain.pct is not None
    env = host_env(target) if on_host else base_env(target, home)
    return build(host_chain(target) if on_host else target.chain,
                 Invocation(script, env, timeout=300, secret_vars=framing.nonce_vars(_NONCE)))


def gpu_report(output: str, nonce: str | None = None) -> dict:
    found = [r.report for r in framing.read(output, nonce or _NONCE) if isinstance(r, framing.GpuRecord)]
    if not found:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        return {"error": "the GPU passthrough check did not report: " + " / ".join(lines[-3:])}
    return typed_section(found[-1], GPU, "the GPU passthrough check's report")


def gpu_findings(report: dict) -> list[Finding]:
    """The host's driver, the container's NVIDIA libraries, and the check's verdict with what to do."""
    if "error" in report:
        return [Finding("GPU passthrough", str(report["error"]), "fail")]
    out = [Finding("host NVIDIA driver", str(report.get("driver") or "none"), "ok" if report.get("driver") else "fail")]
    unknown = report.get("unknown")  # the check could not look inside: neither there nor missing
    for name, version in (report.get("libs") or {}).items():
        if unknown and not version:
            out.append(Finding(name, f"unknown: {unknown}", "unknown"))
            continue
        out.append(Finding(name, str(version or "missing"),
                           "ok" if version and version == report.get("driver") else "fail"))
    failures = report.get("failures") or []
    out.append(Finding("GPU passthrough", str(failures[0]) if failures else "ok", "fail" if failures else "ok"))
    return out


def findings(report: dict) -> list[Finding]:
    out: list[Finding] = []
    if "error" in report:  # no probe report (a `gpu_passthrough` entry may stand beside it)
        return [Finding("doctor", str(report["error"]), "fail")]
    torch = report.get("torch", {})
    torch_cuda = torch.get("cuda") if isinstance(torch, dict) and "error" not in torch else None
    nvccs = report.get("nvcc", [])
    if isinstance(nvccs, dict):  # the probe could not look
        out.append(Finding("nvcc", str(nvccs.get("error", "?")), "fail"))
        nvccs = []
    elif not nvccs:
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
    gpus = report.get("gpus") if isinstance(report.get("gpus"), str) else ""
    gpus = gpus or (f"capability {torch.get('capability')}" if torch.get("capability") else "")
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
                    fast = mod.get("fast", {}).get(fn, False)  # as the gate judged it
                    out.append(Finding(f"transformers {tf['version']} {short}.{fn}", impl, "ok" if fast else "fail"))
    if report.get("malformed"):
        out.append(Finding("doctor", f"the target's answer is malformed: {', '.join(report['malformed'])}", "fail"))
    for c in report.get("cached_causal_conv1d", []):
        out.append(Finding("cached causal-conv1d wheel", f"{c['path']} (built {c['built']})",
                           "warn" if c["stale"] else "info"))
    return out


STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "dim", "unknown": "yellow"}


def render(results: dict[str, list[Finding]], console: Console,
           verdicts: dict[str, ModelVerdict] | None = None, model: Model | None = None) -> None:
    for target, items in results.items():
        table = Table(title=Text(f"doctor: {target}"), show_header=True, header_style="bold")
        for col in ("check", "found", "status"):
            table.add_column(col, overflow="fold")
        for f in items:
            # What the target said is data: Text (never markup), control and bidi characters escaped.
            table.add_row(Text(printable(str(f.check))), Text(printable(str(f.value))),
                          Text(f.status, style=STYLE[f.status]))
        console.print(table)
    if model is not None and verdicts:
        # The answer to "how many layers take the fast path", one line a target, after the detail.
        console.print(Text(f"model {model.summary()}", style="bold"), soft_wrap=True)
        for target, v in verdicts.items():
            console.print(Text.assemble(Text(f"{target}: "), Text(printable(v.message), style=STYLE[v.status])),
                          soft_wrap=True)


# -- doctor --model: how many of a model's layers take the fast path on a target ---------------------------------


@dataclass
class ModelVerdict:
    """One target's answer for one model: which of its layers take the fast path, and why the others do not."""

    path: str  # fast | reference | partly-reference | no-kernels | cannot-load | unknown
    status: str  # as a Finding's: ok | fail | warn
    fast_layers: int  # layers whose every fast-path function is the fast one (full_attention needs none)
    reference_layers: int  # linear_attention layers with at least one function on the reference path
    message: str
    reasons: list[str] = field(default_factory=list)

    def finding(self, model: Model) -> Finding:
        return Finding(f"model {model.kind.model_type}", self.message, self.status)

    def as_json(self, model: Model) -> dict[str, Any]:
        return {**model.as_json(), "path": self.path, "status": self.status, "fast_layers": self.fast_layers,
                "reference_layers": self.reference_layers, "message": self.message, "reasons": self.reasons}


def _package_problem(name: str, item: object) -> str | None:
    """Why a package the fast path needs is not usable, as the probe found it; None if it is."""
    if not isinstance(item, dict) or "error" not in item:
        return None if isinstance(item, dict) else f"{name} was not looked at"
    err = str(item["error"])
    if err.startswith(("ModuleNotFoundError", "ImportError")):
        return f"{name} does not import ({err})"
    return f"{name} fails ({err})"


def model_verdict(model: Model, report: dict) -> ModelVerdict:
    """From doctor's one round trip (the probe's imports, the gate of the model type's transformers module):
    how many of the model's layers take the fast path there. Decided as transformers decides: up to 5.14 one
    module flag for all four functions, from 5.15 each function on its own."""
    total, linear, full = model.layers, model.count(LINEAR), model.count(FULL)
    slow_msg = f"{linear} of {total} layers ({LINEAR}) on the reference path"
    if linear == 0:
        return ModelVerdict("no-kernels", "ok", total, 0, f"{total} of {total} layers need no fast-path kernels "
                                                          f"(all {FULL})")
    if "error" in report:
        return ModelVerdict("unknown", "warn", 0, 0, f"not known: {report['error']}", [str(report["error"])])
    problems = {p: why for p in GATED_DELTA_NET.packages
                if (why := _package_problem(p, report.get(p))) is not None}
    tf = report.get("transformers") or {}
    if "error" in tf:
        missing = f"transformers does not import ({tf['error']})"
        if problems:  # both gate styles need the packages: slow whatever transformers it would be
            reasons = [*problems.values(), missing]
            return ModelVerdict("reference", "fail", total - linear, linear, f"{slow_msg}: {'; '.join(reasons)}",
                                reasons)
        return ModelVerdict("unknown", "warn", 0, 0, f"{linear} of {total} layers ({LINEAR}): which path is not "
                                                     f"known: {missing}; causal_conv1d and fla import", [missing])
    version = tf.get("version", "?")
    short = model.kind.module.rsplit(".", 1)[-1]
    mod = (tf.get("modules") or {}).get(model.kind.module)
    if not isinstance(mod, dict):
        why = f"transformers {version}: the gate of {short} was not read"
        return ModelVerdict("unknown", "warn", 0, 0, f"not known: {why}", [why])
    if "error" in mod:
        why = f"{short} does not import in transformers {version} ({mod['error']})"
        if "No module named 'transformers.models." in str(mod["error"]):
            why += f"; {model.kind.name} came in transformers {model.kind.since}"
        reasons = [why, *problems.values()]
        return ModelVerdict("cannot-load", "fail", 0, 0, f"the model cannot load: {'; '.join(reasons)}", reasons)
    fast_msg = (f"{total} of {total} layers on the fast path ({linear} {LINEAR} via "
                f"{'+'.join(GATED_DELTA_NET.packages)}" + (f", {full} {FULL} unaffected)" if full else ")"))
    if mod.get("style") == "flag":  # 4.57 to 5.14: one flag, all four functions or none
        if mod.get("is_fast_path_available"):
            return ModelVerdict("fast", "ok", total, 0, fast_msg)
        gpu = isinstance(report.get("torch"), dict) and report["torch"].get("gpu")
        reasons = list(problems.values()) or [
            f"transformers {version}'s is_fast_path_available is False"
            + ("" if gpu else ": no GPU visible (the flag needs torch.cuda.is_available())")]
        return ModelVerdict("reference", "fail", total - linear, linear, f"{slow_msg}: {'; '.join(reasons)}", reasons)
    functions, fast = mod.get("functions") or {}, mod.get("fast") or {}
    if not functions:
        why = f"transformers {version}: no GatedDeltaNet gate found in {short} (its layout changed?)"
        return ModelVerdict("unknown", "warn", 0, 0, f"not known: {why}", [why])
    slow = [f for f in GATED_DELTA_NET.functions if not fast.get(f)]
    if not slow:
        return ModelVerdict("fast", "ok", total, 0, fast_msg)
    causes: dict[str, tuple[list[str], str]] = {}  # package -> (its functions that fell back, why)
    for package, fns in GATED_DELTA_NET.needs:
        if fell := [f for f in fns if f in slow]:
            picked = sorted({str(functions.get(f, "nothing (not wrapped)")) for f in fell})
            causes[package] = (fell, problems.get(package)
                               or f"{package} imports, but transformers {version} picked {', '.join(picked)}")
    if len(slow) == len(GATED_DELTA_NET.functions):
        reasons = [why for _, why in causes.values()]
        return ModelVerdict("reference", "fail", total - linear, linear, f"{slow_msg}: {'; '.join(reasons)}", reasons)
    reasons = [f"{', '.join(fell)} fall back: {why}" for fell, why in causes.values()]
    kept = [f for f in GATED_DELTA_NET.functions if f not in slow]
    via = "+".join(sorted({GATED_DELTA_NET.package_of(f) for f in kept}))
    return ModelVerdict("partly-reference", "fail", total - linear, linear,
                        f"{linear} of {total} layers ({LINEAR}) partly on the reference path: {'; '.join(reasons)}; "
                        f"{', '.join(kept)} via {via}", reasons)
