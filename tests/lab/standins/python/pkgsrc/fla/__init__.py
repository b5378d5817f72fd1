"""fleetcuda lab stand-in for fla-core 0.6.0 (flash-linear-attention's core): NOT the real package.

Like the real one it imports torch at import time (so it fails the same way when torch is missing) and its ops import
einops.  The two gated-delta-rule ops that transformers' Qwen3-Next / Qwen3.5 fast path imports exist; calling them
raises RuntimeError, since the lab has no GPU.
"""

import torch  # noqa: F401  (real fla imports torch first; a missing torch must fail here)

from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
__version__ = "0.6.0"
STANDIN = "fleetcuda lab stand-in"
