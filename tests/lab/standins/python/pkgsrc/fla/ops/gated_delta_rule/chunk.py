"""fleetcuda lab stand-in for fla.ops.gated_delta_rule.chunk (fla-core 0.6.0)."""

from typing import Any

from einops import rearrange  # noqa: F401  (the real ops import einops: fla-core's one requirement)

from fla.ops.gated_delta_rule._nogpu import no_gpu


def chunk_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, *args: Any, **kwargs: Any) -> Any:
    """Stand-in of the chunked gated delta rule Triton kernel: always raises RuntimeError (no GPU in the lab)."""
    no_gpu("chunk_gated_delta_rule")
