"""fleetcuda lab stand-in for fla.ops.gated_delta_rule (fla-core 0.6.0): the names transformers imports."""

from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
