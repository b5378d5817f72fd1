"""What `fleetcuda doctor` finds out on a target in one round trip, read-only.

    python - <<'FLEETCUDA_PY'   (this file on stdin; the run's nonce in FLEETCUDA_NONCE)

nvcc (where, which release) for CUDA_HOME, /usr/local/cuda and /usr/local/cuda-X.Y, and PATH; the GPUs'
compute capability; torch's version, CUDA and arch list; causal_conv1d and fla importable (one tiny kernel
each where a GPU is visible); causal-conv1d wheels in pip's or uv's cache built before the installed torch
(stale). Reported as one `doctor` frame holding a JSON document. transformers' gate is fast_path_gate's.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

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


def nvcc_release(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"release ([0-9.]+),", out)
    return m.group(1) if m else ""


def nvccs():
    found = []
    home = os.environ.get("CUDA_HOME")
    if home:
        found.append(("CUDA_HOME", os.path.join(home, "bin", "nvcc")))
    for d in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]:
        if os.path.exists(os.path.join(d, "bin", "nvcc")):
            found.append((d, os.path.join(d, "bin", "nvcc")))
    on_path = shutil.which("nvcc")
    if on_path:
        found.append(("PATH", on_path))
    return [{"where": where, "path": path, "release": nvcc_release(path) if os.access(path, os.X_OK) else ""}
            for where, path in found]


def gpu_caps():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return ";".join(line.strip() for line in out.splitlines() if line.strip())


def attempt(report, name, fn):
    try:
        report[name] = fn()
    except BaseException as exc:
        report[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def torch_info():
    import torch

    info = {"version": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.is_available()}
    info["arch_list"] = torch.cuda.get_arch_list() if info["gpu"] else []
    if info["gpu"]:
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    info["installed_at"] = os.path.getmtime(os.path.dirname(torch.__file__))
    return info


def causal_conv1d_info(gpu):
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


def fla_info(gpu):
    import fla as f
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out = {"version": getattr(f, "__version__", "?")}
    if gpu:
        import torch

        q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(1, 64, 2, 64, device="cuda"), dim=-1).bfloat16()
        g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 2, device="cuda"))
        chunk_gated_delta_rule(q, k, q.clone(), g, torch.rand(1, 64, 2, device="cuda").sigmoid())
        torch.cuda.synchronize()
        out["kernel"] = "ran"
    return out


def cached_wheels(torch_at):
    caches = []
    home = os.path.expanduser("~")
    for pattern in (home + "/.cache/pip/wheels/**/causal_conv1d-*.whl", home + "/.cache/uv/**/causal_conv1d-*.whl",
                    home + "/.cache/uv/**/causal_conv1d-*.dist-info"):
        for path in glob.glob(pattern, recursive=True):
            built = os.path.getmtime(path)
            caches.append({"path": path, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
                           "stale": bool(torch_at and built < torch_at)})
    return caches


def main(argv):
    take_nonce()
    report = {"python": sys.version.split()[0], "cuda_home": os.environ.get("CUDA_HOME", "")}
    attempt(report, "nvcc", nvccs)
    attempt(report, "gpus", gpu_caps)
    attempt(report, "torch", torch_info)
    gpu = isinstance(report["torch"], dict) and bool(report["torch"].get("gpu"))
    attempt(report, "causal_conv1d", lambda: causal_conv1d_info(gpu))
    attempt(report, "fla", lambda: fla_info(gpu))
    torch_at = report["torch"].get("installed_at") if isinstance(report["torch"], dict) else None
    attempt(report, "cached_causal_conv1d", lambda: cached_wheels(torch_at))
    emit_json("doctor", report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
