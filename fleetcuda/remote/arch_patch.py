"""Restrict an unpacked sdist's setup.py to some GPU architectures, run on a target by `sdist_build`.

    python - SETUP_PY ARCHS   (this file on stdin; ARCHS like 90,120)

causal-conv1d's setup.py hard-codes its nvcc `-gencode` pairs per nvcc release and ignores
TORCH_CUDA_ARCH_LIST; this inserts, just before its one top-level `setup(` call, a filter of the
extensions' nvcc flags, and refuses loudly when the file no longer looks as expected.
"""

import re
import sys

# What goes into setup.py; __KEEP__ becomes the list of archs kept.
INSERTION = '''
# --- inserted by fleetcuda: build only for this target's GPU architectures ---
def _fleetcuda_keep_archs(args, keep=__KEEP__):
    out, i, kept = [], 0, 0
    while i < len(args):
        if args[i] == "-gencode" and i + 1 < len(args):
            if args[i + 1].rsplit("code=sm_", 1)[-1] in keep:
                out += args[i:i + 2]
                kept += 1
            i += 2
        else:
            out.append(args[i])
            i += 1
    if not kept:
        raise SystemExit("fleetcuda: no -gencode flags left for " + ", ".join(keep))
    return out
_fleetcuda_edited = 0
for _fleetcuda_ext in ext_modules:
    _fleetcuda_args = getattr(_fleetcuda_ext, "extra_compile_args", None)
    if isinstance(_fleetcuda_args, dict) and "nvcc" in _fleetcuda_args:
        _fleetcuda_args["nvcc"] = _fleetcuda_keep_archs(list(_fleetcuda_args["nvcc"]))
        _fleetcuda_edited += 1
if ext_modules and not _fleetcuda_edited:
    raise SystemExit("fleetcuda: no extension with nvcc flags to restrict: setup.py's layout changed")
# --- end of fleetcuda's insertion ---

'''


def main(argv):
    if len(argv) != 2:
        sys.exit("fleetcuda: usage: arch_patch SETUP_PY ARCHS")
    path, keep = argv[0], sorted(set(argv[1].split(",")))
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    offered = sorted(set(re.findall(r"arch=compute_(\d+a?),code=sm_\1", text)))
    if not offered:
        sys.exit("fleetcuda: setup.py names no 'arch=compute_XX,code=sm_XX' flags: its layout changed; not editing it")
    missing = [a for a in keep if a not in offered]
    if missing:
        sys.exit(f"fleetcuda: setup.py does not build for sm_{', sm_'.join(missing)}; "
                 f"it offers sm_{', sm_'.join(offered)}")
    anchors = [m.start() for m in re.finditer(r"^setup\(", text, re.M)]
    if len(anchors) != 1 or "ext_modules" not in text[:anchors[0]]:
        sys.exit("fleetcuda: setup.py's layout changed (expected ext_modules, then one top-level setup( call)")
    block = INSERTION.replace("__KEEP__", repr(keep))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text[:anchors[0]] + block + text[anchors[0]:])
    print(f"fleetcuda: restricted the build to sm_{', sm_'.join(keep)} (setup.py offers sm_{', sm_'.join(offered)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
