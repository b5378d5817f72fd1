#!/usr/bin/env bash
# The GPU proof, run on the lent H200 machine from the repository root (no network there):
#   .whl/  fleetcuda's own dependencies as cp312 wheels   (pip download ... -d .whl fabric paramiko ...)
#   .wh/   the recipe's wheelhouse                          (fleetcuda wheelhouse build recipes/gdn-fastpath.yaml .wh ...)
# Writes its transcripts to $OUT (default ./h200-out).
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}
mkdir -p "$OUT"
PY=/opt/torch/.venv/bin/python3
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fc-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/fc-site:$PWD PYTHONUNBUFFERED=1 FLEETCUDA_STATE_DIR=$PWD/.fc-state
T="$OUT/transcript.txt"
: > "$T"

fc() {  # run fleetcuda as a user would, recording the command, its output, exit status and wall time
    local start end rc
    echo "\$ fleetcuda $*" | tee -a "$T"
    start=$(date +%s.%N)
    "$PY" -m fleetcuda "$@" 2>&1 | tee -a "$T"
    rc=${PIPESTATUS[0]}
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" -v rc="$rc" 'BEGIN { printf "[exit %d after %.1f s]\n\n", rc, e - s }' | tee -a "$T"
}

{
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    echo "cores: $(nproc)"
    "$PY" -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
    /usr/local/cuda/bin/nvcc --version | tail -2
} > "$OUT/machine.txt" 2>&1

ARGS=(recipes/gdn-fastpath.yaml -i inventories/h200.yaml --var "wheelhouse=$PWD/.wh" --plain)
fc apply "${ARGS[@]}" --check
fc apply "${ARGS[@]}"
cp "$(ls -td .fc-state/runs/*-apply-* | head -n 1)/h200.log" "$OUT/first-apply.log"
fc apply "${ARGS[@]}"
fc verify "${ARGS[@]}"

for mode in fast fla-only reference; do
    "$PY" benchmarks/h200/gdn_layer.py "$mode" 2>>"$OUT/gdn-layer.err" | tee -a "$OUT/gdn-layer.jsonl"
done

echo "\$ pip uninstall -y causal-conv1d   # drift: what a torch upgrade or a stray pip command does" | tee -a "$T"
"$PY" -m pip uninstall -y causal-conv1d 2>&1 | tee -a "$T"
fc verify "${ARGS[@]}"
echo "\$ python benchmarks/h200/gdn_layer.py fast --shapes 2x4096   # the model still loads and runs, slowly" \
    | tee -a "$T"
"$PY" benchmarks/h200/gdn_layer.py fast --shapes 2x4096 2>&1 | tee -a "$T"
