"""fleetcuda lab stand-in for fla.ops (fla-core 0.6.0): only the gated delta rule ops exist."""

from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
