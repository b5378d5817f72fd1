#!/usr/bin/env bash
# The GPU proof, run on the lent H200 machine from the repository root (no network there):
#   .whl/  fleetcuda's own dependencies the machine lacks, as cp312 wheels (pip download ... -d .whl fabric ...)
#   .wh/   the recipe's wheelhouse (fla-core, build deps, causal-conv1d's sdist) and, built on a CPU machine with
#          PyPI's nvcc 13.0 for sm_90, causal_conv1d-1.7.0-cp312-*.whl (benchmarks/h200/README: how)
# Writes its transcripts to $OUT (default ./h200-out): transcript.txt, rounds.jsonl, machine.txt.
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}
ROUNDS=${ROUNDS:-5}
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

timed() {  # NAME ROUND COMMAND...: one timed run, quietly, as a JSON line
    local name=$1 round=$2 start end rc
    shift 2
    start=$(date +%s.%N)
    "$@" > "$OUT/last-$name.txt" 2>&1
    rc=$?
    end=$(date +%s.%N)
    awk -v n="$name" -v r="$round" -v s="$start" -v e="$end" -v rc="$rc" \
        'BEGIN { printf "{\"tool\": \"%s\", \"round\": %d, \"rc\": %d, \"seconds\": %.3f}\n", n, r, rc, e - s }' \
        | tee -a "$OUT/rounds.jsonl"
}

{
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    cat /proc/driver/nvidia/version 2>&1 | head -n 1
    echo "cores: $(nproc)"
    "$PY" -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
    /usr/local/cuda/bin/nvcc --version | tail -2
    ls -l /usr/local/cuda /usr/local/cuda-13.0 2>&1 | head -n 3
} > "$OUT/machine.txt" 2>&1

# causal-conv1d: the cp312 wheel built on the CPU machine (sm_90, nvcc 13.0.88 from PyPI), installed as pip would;
# the recipe's step then finds it installed and importable (its check), and verify checks it like any other.
echo "\$ pip install --no-index --no-deps .wh/causal_conv1d-1.7.0-cp312-*.whl" | tee -a "$T"
"$PY" -m pip install --no-index --no-deps --disable-pip-version-check .wh/causal_conv1d-1.7.0-cp312-*.whl 2>&1 | tail -n 1 | tee -a "$T"

ARGS=(recipes/gdn-fastpath.yaml -i inventories/h200.yaml --var "wheelhouse=$PWD/.wh" --plain)
fc apply "${ARGS[@]}"
fc apply "${ARGS[@]}"
fc verify "${ARGS[@]}"
cp "$(ls -td .fc-state/runs/*-verify-* | head -n 1)/h200.log" "$OUT/verify.log"

# Side by side, interleaved, order rotated each round: verify, the one-interpreter probe, the no-op apply.
tools=(verify probe apply)
for ((r = 0; r < ROUNDS; r++)); do
    for ((i = 0; i < 3; i++)); do
        t=${tools[$(( (i + r) % 3 ))]}
        case $t in
            verify) timed verify "$r" "$PY" -m fleetcuda verify "${ARGS[@]}" ;;
            apply) timed apply "$r" "$PY" -m fleetcuda apply "${ARGS[@]}" ;;
            probe) timed probe "$r" "$PY" benchmarks/h200/probe.py 13.0 ;;
        esac
    done
done
cp "$OUT/last-probe.txt" "$OUT/probe-output.txt"

# How many layers of a Qwen3.5-27B-shaped model take the fast path (64 layers, every 4th full attention).
mkdir -p /tmp/qwen && "$PY" - <<'PY'
import json
layers = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
json.dump({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "layer_types": layers}},
          open("/tmp/qwen/config.json", "w"))
PY
fc doctor -i inventories/h200.yaml --model /tmp/qwen

echo "\$ pip uninstall -y causal-conv1d   # drift: what a torch upgrade or a stray pip command does" | tee -a "$T"
"$PY" -m pip uninstall -y causal-conv1d 2>&1 | tee -a "$T"
fc verify "${ARGS[@]}"
fc doctor -i inventories/h200.yaml --model /tmp/qwen
