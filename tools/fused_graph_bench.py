"""Plain `target.onnx` vs fused `target_fused.onnx` on ORT CPU, 1 thread: `python -m dspark.tools.fused_graph_bench`.

The bundled demo target (or `--target`), a 1-token decode and a k-token verification (default 8)
on a `--past`-token past (default 64), batch `--batch` (default 1). Each graph runs the same
tokens on the same cached keys/values, fed at its best:

    plain          IO binding, every input and output (present = past ++ new) preallocated once
    plain-runtime  what `runtime/ort_backend.py` does today: bind_cpu_input + bind_output per call
    fused          one K/V buffer per layer bound as past and present (`SharedKVRunner`'s binding),
                   every other input and output prebound: the call writes its new keys/values in
                   place at slots past .. past+k-1 (running it again = rollback and redo)
    fused-step     the same through `SharedKVRunner.step` (its Python work per call included)
    fused-tree     as fused, through `target_fused_tree.onnx` fed a causal mask and positions
                   (`causal_slots`): what the tree graph's mask costs

Repeats are interleaved (every graph and case once per round) so that machine noise hits all of
them alike; each sample is the mean of `--calls` back-to-back calls, on the wall clock and on this
thread's CPU clock (ORT with one intra-op thread computes on the calling thread, so CPU time leaves
out the time other processes take the core). Prints min and median ms per call and the fused/plain
ratios; `--json` prints the numbers as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from dspark.export import contract as C
from dspark.export import feeds as F
from dspark.export.fused_parity import SharedKVRunner, causal_slots
from dspark.export.fused_target import export_fused_target
from dspark.export.lower import lower
from dspark.export.target_graph import TargetGraph
from dspark.models import DrafterConfig, TargetModel

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def plain_calls(sess: ort.InferenceSession, spec: C.GraphSpec, ids: np.ndarray, past: list[np.ndarray],
                vocab: int, features: int) -> tuple[Callable[[], None], Callable[[], None], np.ndarray]:
    """(prebound call, runtime-style call, logits array of the prebound call) for `ids` on `past`."""
    batch, tokens = ids.shape
    p = past[0].shape[2]
    feeds = {
        "input_ids": ids,
        "position_ids": np.broadcast_to(np.arange(p, p + tokens), (batch, tokens)).copy(),
        "attention_mask": np.ascontiguousarray(np.broadcast_to(
            np.tril(np.ones((tokens, p + tokens), bool), k=p), (batch, 1, tokens, p + tokens))),
        **dict(zip(spec.input_names[3:], past, strict=True)),
    }
    logits = np.zeros((batch, tokens, vocab), np.float32)
    outputs = {"logits": logits, "context_features": np.zeros((batch, tokens, features), np.float32)}
    for name in spec.output_names[2:]:
        outputs[name] = np.zeros((batch, past[0].shape[1], p + tokens, past[0].shape[3]), np.float32)
    keep = []
    bound = sess.io_binding()
    for name, array in feeds.items():
        keep.append(ort.OrtValue.ortvalue_from_numpy(array))
        bound.bind_ortvalue_input(name, keep[-1])
    for name, array in outputs.items():
        keep.append(ort.OrtValue.ortvalue_from_numpy(array))
        bound.bind_ortvalue_output(name, keep[-1])

    def prebound() -> None:
        sess.run_with_iobinding(bound)

    def runtime_style() -> None:  # runtime/ort_backend.py's OrtBackend._run
        binding = sess.io_binding()
        for name in spec.input_names:
            binding.bind_cpu_input(name, feeds[name])
        for name in spec.output_names:
            binding.bind_output(name, "cpu")
        sess.run_with_iobinding(binding)
        binding.copy_outputs_to_cpu()

    prebound.keep = keep  # the OrtValues must outlive the binding
    return prebound, runtime_style, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEMO / "target", help="target folder (default: the demo)")
    parser.add_argument("--drafter", type=Path, default=DEMO / "dspark", help="drafter folder (context layer ids)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--past", type=int, default=64)
    parser.add_argument("--verify", type=int, default=8, help="tokens of the verification case")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=200, help="calls per sample")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    layer_ids = DrafterConfig.from_folder(args.drafter).target_layer_ids
    model = TargetModel.from_pretrained(args.target, layer_ids)
    c, features = model.config, len(layer_ids) * model.config.hidden_size
    g = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        spec = C.target_spec(c, features, "float32")
        lower(TargetGraph(model), F.target_feeds(c, F.Case(2, 3, 5), torch.float32, torch.Generator().manual_seed(0)),
              spec, Path(tmp), opset=17)
        export_fused_target(model, tmp)
        export_fused_target(model, tmp, tree=True)
        plain = session(Path(tmp) / spec.file)
        fused = session(Path(tmp) / f"{C.TARGET_FUSED}.onnx")
        fused_tree = session(Path(tmp) / f"{C.TARGET_FUSED_TREE}.onnx")

    capacity = args.past + max(args.verify, 1)
    fused_spec = C.target_fused_spec(c, features, "float32")
    tree_spec = C.target_fused_spec(c, features, "float32", tree=True)
    first = SharedKVRunner(fused, fused_spec, args.batch, capacity)
    first.step(g.integers(0, c.vocab_size, (args.batch, args.past)), [0] * args.batch)  # the shared past
    past = [np.ascontiguousarray(kv[:, :, : args.past]) for kv in first.kv]
    pasts = [args.past] * args.batch

    def runner_with_past(sess: ort.InferenceSession, graph_spec: C.GraphSpec) -> SharedKVRunner:
        runner = SharedKVRunner(sess, graph_spec, args.batch, capacity)
        for mine, shared in zip(runner.kv, past, strict=True):
            mine[:, :, : args.past] = shared
        return runner

    calls: dict[str, Callable[[], None]] = {}
    for k in (1, args.verify):
        ids = g.integers(0, c.vocab_size, (args.batch, k))
        prebound, runtime_style, plain_logits = plain_calls(plain, spec, ids, past, c.vocab_size, features)
        prebound()
        runner, tree_runner = runner_with_past(fused, fused_spec), runner_with_past(fused_tree, tree_spec)
        fused_logits, _ = runner.step(ids, pasts)  # binds everything for width k
        tree_logits, _ = tree_runner.step(ids, pasts, *causal_slots(pasts, k))
        diff = max(float(np.abs(fused_logits - plain_logits).max()), float(np.abs(tree_logits - plain_logits).max()))
        if diff > 1e-3:
            raise SystemExit(f"k={k}: fused and plain logits differ by {diff}")
        calls[f"k={k} plain"] = prebound
        calls[f"k={k} plain-runtime"] = runtime_style
        calls[f"k={k} fused"] = lambda r=runner: fused.run_with_iobinding(r.io)
        calls[f"k={k} fused-step"] = lambda r=runner, ids=ids: r.step(ids, pasts)
        calls[f"k={k} fused-tree"] = lambda r=tree_runner: fused_tree.run_with_iobinding(r.io)

    clocks = {"wall": time.perf_counter, "cpu": time.thread_time}
    samples = {clock: {name: [] for name in calls} for clock in clocks}
    for call in calls.values():  # warm-up
        for _ in range(20):
            call()
    for _ in range(args.repeats):
        for name, call in calls.items():
            begin = {clock: now() for clock, now in clocks.items()}
            for _ in range(args.calls):
                call()
            for clock, now in clocks.items():
                samples[clock][name].append(1000 * (now() - begin[clock]) / args.calls)

    result = {
        "target": str(args.target), "batch": args.batch, "past": args.past, "ort": ort.__version__, "threads": 1,
        "load_average": list(os.getloadavg()),
        "ms": {clock: {n: {"min": min(s), "median": statistics.median(s)} for n, s in per.items()}
               for clock, per in samples.items()},
    }
    result["ratios"] = {clock: {
        f"k={k} {mine} / {base}": {stat: ms[f"k={k} {mine}"][stat] / ms[f"k={k} {base}"][stat]
                                   for stat in ("min", "median")}
        for k in (1, args.verify) for mine in ("fused", "fused-step", "fused-tree")
        for base in ("plain", "plain-runtime")
    } for clock, ms in result["ms"].items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.target.name}: batch {args.batch}, past {args.past}, ORT {ort.__version__} CPU, 1 thread, "
          f"{args.repeats} interleaved rounds x {args.calls} calls, load average {result['load_average'][0]:.2f}")
    for clock, label in (("wall", "wall clock"), ("cpu", "this thread's CPU time (robust to other processes)")):
        print(label)
        for name, s in result["ms"][clock].items():
            print(f"  {name:20s} min {s['min']:.4f} ms  median {s['median']:.4f} ms")
        for name, r in result["ratios"][clock].items():
            print(f"  {name:30s} min {r['min']:.3f}  median {r['median']:.3f}")


if __name__ == "__main__":
    main()
