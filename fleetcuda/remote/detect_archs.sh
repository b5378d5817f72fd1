# The GPUs' compute capabilities, as nvcc spells them (9.0 -> 90), comma-separated; empty without a GPU.
# nvidia-smi where there is one, else torch (in $PYTHON).
detect_archs() {
  local caps=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u | paste -sd, -)
  fi
  if [ -z "$caps" ]; then
    caps=$("$PYTHON" -c 'import torch
caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
print(",".join(sorted(f"{a}{b}" for a, b in caps)))' 2>/dev/null || true)
  fi
  printf '%s' "$caps"
}
