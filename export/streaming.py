"""Export at real size in bounded memory: graphs traced over placeholder weights, weights streamed
from the safetensors shards into each graph's external data.

`export_pair` loads the whole pair into PyTorch and lets the exporter serialise every weight into
one protobuf: memory grows with the model (several times its bytes). `export_pair_streaming` never
holds the weights:

1. The modules are built with every parameter an uninitialised, never-written placeholder of its
   shape and dtype (initialisers skipped): large blocks come from fresh anonymous pages, which stay
   out of the resident set when only read (they map the kernel's zero page), and they are
   contiguous, so tracing runs the fast matmul kernels. (Zero-stride `expand` placeholders cost no
   memory either but send bf16 matmuls down a slow path: minutes per layer.)
2. The TorchScript tracer records the weights as graph inputs (`export_params=False`,
   `keep_initializers_as_inputs`: nothing is serialised or deduplicated by value), and ONNX shape
   inference runs without them (it would otherwise serialise every placeholder at full size).
   Weight transposes stay in the graph as Transpose nodes (no constant folding over data we do
   not hold); ONNX Runtime folds them when it loads or optimizes the graph.
3. Each weight input becomes an initializer whose bytes live in `<graph>.onnx.data`, copied from
   its shard with plain reads, converted to the graph dtype row chunk by row chunk (no mmap: its
   pages would count as resident).

Peak memory is the process, small placeholders from the heap and one chunk: it does not grow
with the model. The fused flavour (hand-built from loaded weights) is not made here.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel
from dspark.models.checkpoint import checkpoint_files
from dspark.models.config import CheckpointError
from dspark.models.target import HF_PREFIXES

from .lower import EXTERNAL_SUFFIX, ExportError, _fix_bfloat16_casts, check_matches_spec
from .manifest import FORMAT_VERSION, file_entries, model_section, write_manifest
from .pipeline import (
    DEFAULT_OPSET,
    DEFAULT_PLACEMENT,
    TOKENIZER_FILES,
    TORCH_DTYPES,
    check_options,
    check_pair_and_out,
    graph_jobs,
)

Progress = Callable[[str], None] | None
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_ONNX_DTYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
                torch.bfloat16: onnx.TensorProto.BFLOAT16}
CHUNK_BYTES = 64 * 2**20


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    offset: int  # from the start of the file
    dtype: torch.dtype
    shape: tuple[int, ...]


def index_checkpoint(folder: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint folder, located from the shards' headers only."""
    located: dict[str, StoredTensor] = {}
    for path in checkpoint_files(folder):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(size))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {name} is {entry['dtype']}; float weights expected")
            located[name] = StoredTensor(path, 8 + size + entry["data_offsets"][0], _ST_DTYPES[entry["dtype"]],
                                         tuple(entry["shape"]))
    return located


def stream_tensor(stored: StoredTensor, dtype: torch.dtype, out) -> int:
    """Append `stored` converted to `dtype` to the open file `out`, chunk by chunk; returns bytes written."""
    row = max(1, int(torch.Size(stored.shape[1:]).numel()))
    rows = stored.shape[0] if stored.shape else 1
    item = torch.tensor([], dtype=stored.dtype).element_size()
    step = max(1, CHUNK_BYTES // (row * item))
    written = 0
    with stored.path.open("rb") as f:
        f.seek(stored.offset)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            raw = bytearray(count * row * item)
            f.readinto(raw)
            chunk = torch.frombuffer(raw, dtype=stored.dtype).to(dtype)
            data = (chunk.view(torch.int16) if dtype == torch.bfloat16 else chunk).numpy().tobytes()
            out.write(data)
            written += len(data)
    return written


@contextmanager
def placeholder_parameters(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get uninitialised placeholders for parameters (never written: not resident)."""
    register = nn.Module.register_parameter
    inits = ("kaiming_uniform_", "normal_", "uniform_", "ones_", "zeros_", "trunc_normal_", "xavier_uniform_")
    saved = {name: getattr(nn.init, name) for name in inits}

    def placeholder(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param not in made:  # a tied weight is the placeholder already made
            param = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
            made.add(param)
        register(module, name, param)

    made: set[nn.Parameter] = set()

    nn.Module.register_parameter = placeholder
    for name in inits:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def target_prefix(located: dict[str, StoredTensor]) -> str:
    """The prefix of a target checkpoint's decoder weights (`target.HF_PREFIXES`: Gemma-4's nested first)."""
    return next((p for p in HF_PREFIXES if any(k.startswith(p) for k in located)), HF_PREFIXES[-1])


def placeholder_pair(target_config: TargetConfig, drafter_config: DrafterConfig, dtype: torch.dtype,
                     target_dir: Path, drafter_dir: Path, located: dict[Path, dict[str, StoredTensor]]
                     ) -> tuple[TargetModel, DSparkDrafter, dict[int, tuple]]:
    """The pair over placeholders, and where each parameter's bytes are: id(param) -> (folder, key)."""
    with placeholder_parameters(dtype):
        target = TargetModel(target_config, drafter_config.target_layer_ids).eval()
        drafter = DSparkDrafter(drafter_config).eval()
    target.to(dtype)
    drafter.to(dtype)
    prefix = target_prefix(located[target_dir])
    sources: dict[int, tuple] = {}
    for name, tensor in stored_tensors(target).items():  # tied lm_head: listed once, as embed_tokens
        sources.setdefault(id(tensor), (target_dir, name if name.startswith("lm_head") else prefix + name))
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name not in located[drafter_dir]:  # DeepSpec copies them from the target
            module = name.split(".")[0]
            drafter.get_submodule(module).weight = target.get_submodule(module).weight
    for name, tensor in stored_tensors(drafter).items():
        sources.setdefault(id(tensor), (drafter_dir, name))
    return target, drafter, sources


def stored_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores and a traced graph takes as weights: parameters and persistent buffers
    (Gemma-4's per-layer `layer_scalar`)."""
    return dict(module.state_dict(keep_vars=True))


@contextmanager
def _shape_inference_without_weights() -> Iterator[None]:
    """The exporter's whole-graph ONNX shape inference serialises every parameter it is given; the
    weights are graph inputs with static shapes, so it needs none of their values."""
    infer = torch._C._jit_pass_onnx_graph_shape_type_inference
    torch._C._jit_pass_onnx_graph_shape_type_inference = lambda graph, params, opset: infer(graph, {}, opset)
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = infer


def _trace(module: nn.Module, example: tuple[torch.Tensor, ...], spec, path: Path, opset: int) -> list[str]:
    """Trace `module` into `path` with its parameters as graph inputs; returns their names."""
    import warnings

    params = stored_tensors(module)
    with warnings.catch_warnings(), torch.no_grad(), _shape_inference_without_weights():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), input_names=spec.input_names,
                          output_names=spec.output_names, dynamic_axes=spec.dynamic_axes(), opset_version=opset,
                          do_constant_folding=False, export_params=False, keep_initializers_as_inputs=True,
                          dynamo=False)
    return list(params)


def _attach_weights(path: Path, spec, module: nn.Module, sources: dict[int, tuple], dtype: torch.dtype,
                    located: dict[Path, dict[str, StoredTensor]]) -> list[Path]:
    """Turn the weight inputs of `path` into initializers stored in `<file>.data`, streamed from the shards."""
    model = onnx.load(str(path))
    params = stored_tensors(module)
    contract = set(spec.input_names)
    weights = [v for v in model.graph.input if v.name not in contract]
    unknown = [v.name for v in weights if v.name not in params]
    if unknown:
        raise ExportError(f"{spec.file}: graph inputs {unknown[:5]} are neither contract inputs nor weights")
    data = path.with_name(path.name + EXTERNAL_SUFFIX)
    order = sorted(weights, key=lambda v: (str(sources[id(params[v.name])][0]), sources[id(params[v.name])][1]))
    with data.open("wb") as out:
        offset = 0
        for value in order:
            folder, key = sources[id(params[value.name])]
            stored = located[folder].get(key)
            shape = tuple(params[value.name].shape)
            if stored is None or stored.shape != shape:
                found = "missing" if stored is None else f"shaped {stored.shape}"
                raise CheckpointError(f"{folder}: tensor {key} is {found}; its config needs {shape}")
            length = stream_tensor(stored, dtype, out)
            tensor = onnx.TensorProto(name=value.name, data_type=_ONNX_DTYPES[dtype], dims=shape)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=k, value=v)
            model.graph.initializer.append(tensor)
            offset += length
    kept = [v for v in model.graph.input if v.name in contract]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    _fix_bfloat16_casts(model)
    check_matches_spec(model, spec)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    return [path, data]


def _check_disk(out_dir: Path, jobs: list, dtype: torch.dtype) -> None:
    item = torch.tensor([], dtype=dtype).element_size()
    need = sum(p.numel() * item for job in jobs for p in job.module.parameters())
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise ExportError(f"--out {out_dir}: the graphs' weights need {need / 1e9:.1f} GB, the disk has "
                          f"{free / 1e9:.1f} GB free: free space or export elsewhere")


def export_pair_streaming(
    target_dir: str | Path,
    drafter_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    opset: int = DEFAULT_OPSET,
    graphs_only: Sequence[str] | None = None,
    progress: Progress = None,
) -> dict[str, Any]:
    """The plain graphs of the pair, weights streamed from the checkpoints; writes and returns export.json
    (with `export_peak_rss_bytes`). Parity is not run here (it needs the loaded models). `graphs_only`
    names a subset to write (measurements, tests): such an export is not one an engine builds from.

    Refuses, before writing anything: a pair the loader refuses (architecture, drafter/target mismatch),
    bad options, and an output disk with less free space than the graphs' weights need."""
    check_options(dtype, opset)
    target_dir, drafter_dir, out_dir = Path(target_dir), Path(drafter_dir), Path(out_dir)
    target_config, drafter_config = check_pair_and_out(target_dir, drafter_dir, out_dir)
    started = time.perf_counter()
    torch_dtype = TORCH_DTYPES[dtype]
    located = {target_dir: index_checkpoint(target_dir), drafter_dir: index_checkpoint(drafter_dir)}
    target, drafter, sources = placeholder_pair(target_config, drafter_config, torch_dtype, target_dir, drafter_dir,
                                                located)
    jobs = [job for job in graph_jobs(target, drafter, dtype) if graphs_only is None or job.spec.name in graphs_only]
    _check_disk(out_dir, jobs, torch_dtype)
    graphs: dict[str, Any] = {}
    for job in jobs:
        t0 = time.perf_counter()
        path = out_dir / job.spec.file
        _trace(job.module, job.example, job.spec, path, opset)
        files = _attach_weights(path, job.spec, job.module, sources, torch_dtype, located)
        graphs[job.spec.name] = {**job.spec.to_json(), "files": file_entries(files, out_dir),
                                 "export_seconds": round(time.perf_counter() - t0, 3), "flavour": "plain"}
        if progress:
            size = sum(f.stat().st_size for f in files)
            progress(f"{job.spec.file}: {size / 1e9:.2f} GB in {graphs[job.spec.name]['export_seconds']:.1f} s, "
                     f"peak RSS {peak_rss_bytes() / 1e9:.2f} GB")
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "opset": opset,
        "exporter": f"torch.onnx TorchScript tracer over placeholder weights, streamed (torch {torch.__version__})",
        **model_section(target_config, drafter_config, target_dir),
        "lm_head_in_backbone": DEFAULT_PLACEMENT.lm_head_in_backbone,
        "flavours": ["plain"],
        "graphs": graphs,
        "dropped_graphs": {},
        "parity": None,
        "export_seconds": round(time.perf_counter() - started, 3),
        "export_peak_rss_bytes": peak_rss_bytes(),
    }
    write_manifest(out_dir, manifest)
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            (out_dir / name).write_bytes((target_dir / name).read_bytes())
    return manifest
