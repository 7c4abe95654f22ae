"""dspark.export: a target and its DSpark drafter -> ONNX graphs + export.json (see README.md).

Two layers live here. The artifact contract, which the runtime reads and the builders write, is
import-light: `contract` (graph names, I/O specs), `manifest` (export.json), `engine_dir`
(engine.json, cost tables, buckets), `artifacts` (the one error type for bad files). The lowering
itself (`pipeline.export_pair`, with onnx, tqdm and the parity sweep) is imported only by the
commands that export, so `import dspark.runtime` never pulls it in.
"""
