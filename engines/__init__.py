"""dspark.engines: export dir -> engine dir (ORT-optimized graphs or TensorRT plans, token buckets,
SPS cost table, STS temperatures). See engines/README.md. The engine directory's format (engine.json,
cost tables, bucket lookup) lives one layer down, in `dspark.export.engine_dir`, which the runtime reads."""

from .buckets import ShapeLimits, parse_buckets, plan_buckets, profile_shapes
from .export_source import BuildError

__all__ = ["BuildError", "ShapeLimits", "parse_buckets", "plan_buckets", "profile_shapes"]
