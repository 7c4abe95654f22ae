"""What TensorRT made of a graph, checked against the graph contract and the bucket table.

TensorRT-RTX builds ahead of time on a machine without a GPU, where a plan cannot be
deserialized (so the engine inspector cannot open it). What TensorRT itself holds at build time is
checked instead: the parsed network (input and output names, dtypes, ranks, fixed dims) and the
optimization profiles added to the builder config, read back from TensorRT (`get_shape`).

The profile check does not re-derive `buckets.profile_shapes`; it states what the runtime needs:
every call the runtime routes to profile k (R requests of T tokens, R·T ≤ B_k, R ≤ max_batch,
P cached positions with P + T ≤ max_seq_len) lies within that profile's [min, max] for every input,
the opt shape lies within [min, max] and is itself a call of bucket k, and there is one profile per
bucket (target graphs) or one for the largest bucket (drafter graphs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dspark.export import contract as C

from .buckets import ShapeLimits
from .export_source import BuildError

Shapes = Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)
TARGET_GRAPHS = (C.TARGET, C.TARGET_STATIC)
_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
           "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}


class ContractMismatch(BuildError):
    """A built network or optimization profile that does not match the graph contract or buckets."""


def network_io(network: Any) -> dict[str, list[Any]]:
    """The parsed network's inputs and outputs (name, dtype in contract names, shape with -1 for a
    dynamic dim) and the names of its plugin layers (none: the plan needs no plugin library)."""

    def describe(tensor: Any) -> dict[str, Any]:
        return {"name": tensor.name, "dtype": _DTYPES.get(tensor.dtype.name, tensor.dtype.name),
                "shape": list(tensor.shape)}

    layers = [network.get_layer(i) for i in range(network.num_layers)]
    return {"inputs": [describe(network.get_input(i)) for i in range(network.num_inputs)],
            "outputs": [describe(network.get_output(i)) for i in range(network.num_outputs)],
            "plugins": [layer.name for layer in layers if layer.type.name.startswith("PLUGIN")]}


def read_profiles(profiles: Sequence[Any], names: Sequence[str]) -> list[dict[str, list[list[int]]]]:
    """{input: [min, opt, max]} of each optimization profile, as TensorRT holds it."""
    return [{name: [list(shape) for shape in profile.get_shape(name)] for name in names} for profile in profiles]


def _io_problems(kind: str, specs: Sequence[C.TensorSpec], built: Sequence[dict[str, Any]]) -> list[str]:
    names = [t.name for t in specs]
    if [t["name"] for t in built] != names:
        return [f"{kind} are {[t['name'] for t in built]}, the contract says {names}"]
    problems = []
    for spec, tensor in zip(specs, built, strict=True):
        want = [d if isinstance(d, int) else -1 for d in spec.dims]
        if tensor["dtype"] != spec.dtype:
            problems.append(f"{kind[:-1]} {spec.name}: dtype {tensor['dtype']}, the contract says {spec.dtype}")
        if tensor["shape"] != want:
            problems.append(f"{kind[:-1]} {spec.name}: shape {tensor['shape']}, the contract says {list(spec.dims)}")
    return problems


def check_network(spec: C.GraphSpec, io: Mapping[str, Sequence[dict[str, Any]]]) -> None:
    """ContractMismatch naming every input/output whose name, dtype or dims differ from `spec`."""
    problems = _io_problems("inputs", spec.inputs, io["inputs"]) + _io_problems("outputs", spec.outputs, io["outputs"])
    if problems:
        raise ContractMismatch(f"graph '{spec.name}' as TensorRT parsed it: " + "; ".join(problems))


def routed_calls(graph: str, bucket: int, limits: ShapeLimits) -> list[dict[str, int]]:
    """Corner calls the runtime may route to `bucket`'s profile, as symbolic dim sizes."""
    cap, block = limits.max_seq_len, limits.verify_width - 1
    calls = []
    for rows in sorted({1, min(bucket, limits.max_batch)}):
        for tokens in sorted({1, min(bucket // rows, cap)}):
            for past in sorted({0, cap - tokens}):
                calls.append({"batch": rows, "tokens": tokens, "past": past, "total": past + tokens,
                              "capacity": cap, "capacity_plus_tokens": cap + tokens})
        if graph not in TARGET_GRAPHS:  # drafter: a context of 1 .. max_seq_len new rows (prefill)
            for context in sorted({1, cap}):
                for past in sorted({0, cap - context}):
                    calls.append({"batch": rows, "context_tokens": context, "context_past": past,
                                  "context_total": past + context, "block_total": past + context + block})
    return calls


def _shape(spec: C.TensorSpec, sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    if any(isinstance(d, str) and d not in sizes for d in spec.dims):
        return None
    return tuple(d if isinstance(d, int) else sizes[d] for d in spec.dims)


def _opt_call(spec: C.GraphSpec, shapes: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for t in spec.inputs:
        for axis, d in enumerate(t.dims):
            if isinstance(d, str):
                sizes.setdefault(d, shapes[t.name][1][axis])
    return sizes


def profile_problems(spec: C.GraphSpec, index: int, bucket: int, shapes: Mapping[str, Sequence[Sequence[int]]],
                     limits: ShapeLimits) -> list[str]:
    """What is wrong with one profile of `spec` for `bucket` (empty: nothing)."""
    where = f"graph '{spec.name}' profile {index} (bucket {bucket})"
    missing = [t.name for t in spec.inputs if t.name not in shapes]
    if missing:
        return [f"{where}: no shapes for inputs {missing}"]
    problems = []
    for t in spec.inputs:
        low, opt, high = (tuple(s) for s in shapes[t.name])
        if not all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
            problems.append(f"{where}: {t.name} opt {opt} lies outside [{low}, {high}]")
    for call in routed_calls(spec.name, bucket, limits):
        for t in spec.inputs:
            shape = _shape(t, call)
            low, high = tuple(shapes[t.name][0]), tuple(shapes[t.name][2])
            if shape is not None and not all(a <= s <= c for a, s, c in zip(low, shape, high, strict=True)):
                problems.append(f"{where}: a call {call} needs {t.name} {shape}, outside [{low}, {high}]")
    opt = _opt_call(spec, shapes)
    if spec.name in TARGET_GRAPHS and opt.get("batch", 1) * opt.get("tokens", 1) > bucket:
        problems.append(f"{where}: opt batch {opt.get('batch')} x tokens {opt.get('tokens')} exceeds the bucket")
    return problems


def check_profiles(spec: C.GraphSpec, profiles: Sequence[Mapping[str, Sequence[Sequence[int]]]],
                   buckets: Sequence[int], limits: ShapeLimits) -> None:
    """ContractMismatch unless `profiles` (as TensorRT holds them) serve every bucket's calls."""
    chosen = list(buckets) if spec.name in TARGET_GRAPHS else [buckets[-1]]
    if len(profiles) != len(chosen):
        raise ContractMismatch(f"graph '{spec.name}' has {len(profiles)} optimization profiles; buckets {chosen} "
                               f"need {len(chosen)}")
    problems = [p for k, (bucket, shapes) in enumerate(zip(chosen, profiles, strict=True))
                for p in profile_problems(spec, k, bucket, shapes, limits)]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ContractMismatch(shown)
