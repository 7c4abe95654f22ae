"""dspark.engines: export dir -> engine dir (ORT-optimized graphs or TensorRT plans, token buckets,
SPS cost table, STS temperatures). See engines/README.md."""

from .buckets import BucketError, ShapeLimits, bucket_for, parse_buckets, plan_buckets, profile_shapes
from .cost_table import CostTable
from .engine import Engine, load_engine
from .export_source import BuildError
from .manifest import ENGINE_JSON, EngineManifestError, read_engine_manifest, validate

__all__ = [
    "ENGINE_JSON",
    "BucketError",
    "BuildError",
    "CostTable",
    "Engine",
    "EngineManifestError",
    "ShapeLimits",
    "bucket_for",
    "load_engine",
    "parse_buckets",
    "plan_buckets",
    "profile_shapes",
    "read_engine_manifest",
    "validate",
]
