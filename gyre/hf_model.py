"""Kept for its importers: the model-directory reader now lives in `gyre.model` (by family)."""

from gyre.model.families import ModelFormatError
from gyre.model.spec import (ModelSpec, apply_rope, checked_weights, load_weights, read_config, read_spec,
                             rms_norm, split_fused_experts)

__all__ = ["ModelFormatError", "ModelSpec", "apply_rope", "checked_weights", "load_weights", "read_config",
           "read_spec", "rms_norm", "split_fused_experts"]
