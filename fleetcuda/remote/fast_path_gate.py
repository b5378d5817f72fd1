"""Whether transformers' GatedDeltaNet fast path is there, run on a target by the recipe's `fast-path` step
(`kind: program`) and by `fleetcuda doctor`.

    python - [--gate-only]   (this file on stdin)

Without --gate-only: causal_conv1d and fla import, and where a GPU is visible one tiny kernel of each runs.
Then transformers' gate, in both of its styles: a module flag `is_fast_path_available` (4.57 to 5.14), or
(5.15 on) each function wrapped, the wrapper's closure holding the implementation it picked. Each line says
`ok`, `FAIL` or `skip`; the exit status is 1 if anything failed. REQUIRE_TRANSFORMERS=false makes the gate
informative only. Given a frame nonce (FLEETCUDA_NONCE), it also reports what the gate found as one `gate`
frame, which is what doctor reads.
"""

import importlib
import json
import os
import sys

MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
           "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
           "transformers.models.qwen3_next.modeling_qwen3_next")


# >>> fleetcuda frame emitter
_NONCE = ""


def take_nonce():
    """Read (and remove from the environment) the nonce the shell gave this program."""
    global _NONCE
    _NONCE = os.environ.pop("FLEETCUDA_NONCE", "")
    return _NONCE


def emit(kind, *fields):
    """Print one frame line `@@fleetcuda:<nonce> <kind> <fields...>`. No field holds whitespace, so nothing a
    field carries (a version string, a path) can start a line of its own, let alone a frame."""
    if not _NONCE:
        sys.exit("fleetcuda: no frame nonce (FLEETCUDA_NONCE): this program reports to fleetcuda only")
    for field in (kind, *fields):
        if not field or any(c.isspace() for c in field):
            raise ValueError(f"a frame field must be a non-empty word: {field!r}")
    sys.stdout.write(f"\n@@fleetcuda:{_NONCE} {' '.join((kind, *fields))}\n")
    sys.stdout.flush()


def emit_json(kind, value):
    """One frame whose one field is `value` as JSON: ASCII only, no whitespace (a space is \\u0020)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    emit(kind, text.replace(" ", "\\u0020"))
# <<< fleetcuda frame emitter


class Checks:
    def __init__(self):
        self.failed = []

    def say(self, ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            self.failed.append(what)


def kernels(checks):
    """Both packages import; on a GPU, one tiny kernel of each runs. Returns whether a GPU is visible."""
    import causal_conv1d
    import fla
    import torch
    from causal_conv1d import causal_conv1d_fn
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    checks.say(True, f"import causal_conv1d {getattr(causal_conv1d, '__version__', '?')}, "
                     f"fla {getattr(fla, '__version__', '?')}")
    gpu = torch.cuda.is_available()
    if gpu:
        cap = torch.cuda.get_device_capability()
        x = torch.randn(1, 64, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
        y = causal_conv1d_fn(x, w, None, activation="silu")
        torch.cuda.synchronize()
        checks.say(y.shape == x.shape, f"causal_conv1d kernel ran on sm_{cap[0]}{cap[1]}")
        q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(1, 64, 2, 64, device="cuda"), dim=-1).bfloat16()
        v = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 2, device="cuda"))
        beta = torch.rand(1, 64, 2, device="cuda").sigmoid()
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
        torch.cuda.synchronize()
        checks.say(o.shape == v.shape, "fla chunk_gated_delta_rule kernel ran")
    else:
        print("skip no GPU visible: kernels not run")
    return gpu


def wrapped_functions(mod):
    """function name -> (where its implementation lives, whether that is the fast path)."""
    found = {}
    for attr, fn in sorted(vars(mod).items()):
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not cells or "implementation" not in code.co_freevars:
            continue
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))  # noqa: B905 (Python < 3.10 there)
        impl = free["implementation"]
        where = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
        fast = impl is not free.get("torch_function") and where.startswith(("causal_conv1d", "fla"))
        found[str(free.get("func_name", attr))] = (where, fast)
    return found


def gate(checks, gpu, required):
    """transformers' gate, said line by line; returns what was found (the `gate` frame's record)."""
    try:
        import transformers
    except ImportError as exc:
        print("skip transformers not installed: gate not checked")
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    v = transformers.__version__
    report = {"version": v, "modules": {}}
    checked = 0
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:
            report["modules"][modname] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        short = modname.rsplit(".", 1)[-1]
        if hasattr(mod, "is_fast_path_available"):  # transformers 4.57 to 5.14: one flag
            checked += 1
            flag = bool(mod.is_fast_path_available)
            report["modules"][modname] = {"style": "flag", "is_fast_path_available": flag}
            if gpu:
                checks.say(flag or not required, f"transformers {v} {short}: is_fast_path_available")
            else:
                print(f"skip transformers {v} {short}: is_fast_path_available needs a GPU")
            continue
        # 5.15 on: each function wrapped; the wrapper's closure holds the implementation it picked
        functions = wrapped_functions(mod)
        report["modules"][modname] = {"style": "wrapped", "functions": {f: w for f, (w, _) in functions.items()},
                                      "fast": {f: fast for f, (_, fast) in functions.items()}}
        for name, (where, fast) in functions.items():
            checked += 1
            checks.say(fast or not required, f"transformers {v} {short}: {name} -> {where}")
    if not checked:
        checks.say(not required, f"transformers {v}: no GatedDeltaNet gate found (its layout changed?)")
    return report


def gpu_visible():
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def summary(checks, gpu, kernels_run, report):
    """The whole result in one line, printed last: it is what reports and history show as found."""
    parts = []
    if checks.failed:
        more = f" (and {len(checks.failed) - 1} more)" if len(checks.failed) > 1 else ""
        parts.append(f"FAIL {checks.failed[0]}{more}")
    if kernels_run:
        broken = [f for f in checks.failed if "kernel" in f]
        parts.append("no GPU visible: kernels not run" if not gpu else
                     "both kernels ran" if not broken else f"{2 - len(broken)} of 2 kernels ran")
    if "error" in report:
        parts.append("transformers not installed: gate not checked")
    else:
        modules = list(report["modules"].values())
        fast = [f for m in modules for f in m.get("fast", {}).values()]
        flags = [m["is_fast_path_available"] for m in modules if m.get("style") == "flag"]
        if fast:
            parts.append(f"{sum(fast)} of {len(fast)} gate functions resolve to causal_conv1d / fla")
        if flags:
            parts.append(f"is_fast_path_available in {sum(flags)} of {len(flags)} modules")
        if not fast and not flags:
            parts.append(f"transformers {report['version']}: no gate found")
    return "; ".join(parts)


def main(argv):
    reports = bool(take_nonce())
    checks = Checks()
    gate_only = "--gate-only" in argv
    gpu = gpu_visible() if gate_only else kernels(checks)
    report = gate(checks, gpu, required=os.environ.get("REQUIRE_TRANSFORMERS") != "false")
    if reports:
        emit_json("gate", report)
    print(summary(checks, gpu, not gate_only, report))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
