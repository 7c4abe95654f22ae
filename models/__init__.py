"""DeepSpec-compatible models: the target decoder and the DSpark/DFlash drafter."""

from .config import (
    CheckpointError,
    DrafterConfig,
    IncompatibleDrafterError,
    TargetConfig,
    check_drafter_fits_target,
)
from .drafter import BackboneOutput, DSparkDrafter, load_pair
from .target import KVCache, TargetModel, TargetOutput, causal_mask, crop_kv_cache, empty_kv_cache

__all__ = [
    "BackboneOutput",
    "CheckpointError",
    "DSparkDrafter",
    "DrafterConfig",
    "IncompatibleDrafterError",
    "KVCache",
    "TargetConfig",
    "TargetModel",
    "TargetOutput",
    "causal_mask",
    "check_drafter_fits_target",
    "crop_kv_cache",
    "empty_kv_cache",
    "load_pair",
]
