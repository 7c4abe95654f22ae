"""Trees inside the batched engine vs chains vs target-only decoding: τ and tokens/s per batch size.

    python -m dspark.tools.engine_tree_bench --requests 1,16 --repeats 3
    python -m dspark.tools.engine_tree_bench --device cuda --requests 1,16,64 --target DIR --drafter DIR

Methods, each a `BatchEngine` over the PyTorch backend (`--device`), or over ONNX Runtime
(`--backend ort`: the pair exported to a temporary folder first; fused KV, trees verify through the
static-cache graph):
  autoregressive  scheduler mode `off` (the target alone, one token per step)
  chain           mode `dspark`: Algorithm 1 over chain slots (padded pricing, the engine's default)
  tree            mode `dspark`, drafting="tree": Algorithm 1 over all requests' tree nodes
  tree-fixed      mode `fixed`, drafting="tree": `--tree-nodes` nodes per request
Both `dspark` methods price steps with one step cost model t(R, B) fitted here first, on timed
steps of the autoregressive, fixed-chain and fixed-tree engines at every batch size (so each
machine gets its own). Then repeats run the methods interleaved (method after method, repeat after
repeat) on the same prompts; the table gives the median (and min) tokens/s over repeats, τ = mean
accepted tokens per request per step (bonus included), and each method's ratio to autoregressive.
Every greedy output is checked against the autoregressive engine's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import click
import torch

from dspark.models import load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.target_runner import kv_mode_for
from dspark.runtime.torch_backend import TorchBackend

from .errors import OneLineErrors
from .generate_command import parse_device

DEMO = Path(str(resources.files("dspark.models") / "demo"))
METHODS = ("autoregressive", "chain", "tree", "tree-fixed")
# held-out-ish code prompts (the demo pair is trained on Python source)
PROMPTS = ["def parse_args(", "    for line in lines:\n        if ", "import os\nimport sys\n\n",
           "class Queue:\n    def __init__(self", "        if self.break_long_words:", "    return ''.join(",
           "def main():\n    ", "    with open(path) as f:\n", "    except KeyError:\n        ",
           "    @property\n    def name(self):\n", "    result = []\n    for ", "if __name__ == '__main__':\n"]


def scheduler_for(method: str, tree_nodes: int, gamma: int) -> SchedulerConfig:
    return {"autoregressive": SchedulerConfig("off"),
            "chain": SchedulerConfig("dspark", gate_drafting=False),
            "chain-fixed": SchedulerConfig("fixed", fixed_length=gamma),
            "tree": SchedulerConfig("dspark", drafting="tree", tree_nodes=tree_nodes),
            "tree-fixed": SchedulerConfig("fixed", drafting="tree", tree_nodes=tree_nodes)}[method]


def run_once(backend, info, method: str, prompts: list[list[int]], new_tokens: int, cost, tree_nodes: int,
             device_sync) -> tuple[float, float, list[list[int]], BatchEngine]:
    """-> tokens/s, τ, the outputs, the engine (its step records)."""
    rows, slot = len(prompts), max(map(len, prompts)) + new_tokens + 64
    capacity = Capacity(rows, rows * slot, slot)
    engine = BatchEngine(backend, info, capacity=capacity, scheduler=scheduler_for(method, tree_nodes, info.block_size),
                         cost_model=cost)
    ids = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]
    device_sync()
    begin = time.perf_counter()
    finished = engine.run_until_done()
    device_sync()
    seconds = time.perf_counter() - begin
    outputs = [finished[i].tokens for i in ids]
    lengths = [n for i in ids for n in finished[i].acceptance_lengths]
    return sum(map(len, outputs)) / seconds, sum(lengths) / max(len(lengths), 1), outputs, engine


def fit_cost(backend, info, prompts_by_r: dict[int, list[list[int]]], new_tokens: int, tree_nodes: int,
             device_sync) -> StepCostModel:
    samples = []
    for prompts in prompts_by_r.values():
        for method in ("autoregressive", "chain-fixed", "tree-fixed"):
            *_, engine = run_once(backend, info, method, prompts, new_tokens, None, tree_nodes, device_sync)
            samples += [(s.requests, s.padded_tokens, s.total_seconds - s.seconds.get("prefill", 0.0))
                        for s in engine.stats.steps if s.requests]
    return StepCostModel.fit(samples)


@click.command("engine_tree_bench", cls=OneLineErrors)
@click.option("--target", "target_dir", type=click.Path(path_type=Path), default=DEMO / "target", show_default=True)
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path), default=DEMO / "dspark", show_default=True)
@click.option("--requests", default="1,16", show_default=True, help="Batch sizes (concurrent requests), comma list.")
@click.option("--new-tokens", default=48, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--tree-nodes", default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True, callback=parse_device, help="PyTorch device: cpu or cuda.")
@click.option("--threads", default=0, show_default=True, help="Intra-op threads (0: leave as is).")
@click.option("--backend", "backend_name", type=click.Choice(["torch", "ort"]), default="torch", show_default=True)
@click.option("--host-kv", is_flag=True, help="PyTorch on a GPU: keep the target's cache on the host (every call "
              "moves it both ways), for comparison with the default device-resident cache.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="PyTorch on a GPU: replay recurring feed layouts as CUDA graphs.")
def main(target_dir: Path, drafter_dir: Path, requests: str, new_tokens: int, repeats: int, tree_nodes: int,
         device: str, threads: int, backend_name: str, host_kv: bool, cuda_graphs: bool) -> None:
    if threads:
        torch.set_num_threads(threads)
    from tokenizers import Tokenizer

    target, drafter = load_pair(target_dir, drafter_dir)
    tokenizer_file = target_dir / "tokenizer.json"
    encode = (Tokenizer.from_file(str(tokenizer_file)).encode if tokenizer_file.is_file() else None)
    texts = [encode(t).ids if encode else [3 + (7 * i + j) % 200 for j in range(8 + i)] for i, t in enumerate(PROMPTS)]
    sizes = [int(r) for r in requests.split(",")]
    prompts_by_r = {r: [texts[i % len(texts)] for i in range(r)] for r in sizes}
    if backend_name == "ort":
        from dspark.export.pipeline import export_pair
        from dspark.runtime.ort_backend import OrtBackend

        folder = Path(tempfile.mkdtemp(prefix="engine_tree_bench_"))
        export_pair(target_dir, drafter_dir, folder, check=False)
        backend = OrtBackend(folder, intra_op_threads=threads).open()
        info = ModelInfo.from_manifest(backend.manifest)
    else:
        # no CUDA: one line (OneLineErrors)
        backend = TorchBackend(target, drafter, device=device, resident_kv=not host_kv, cuda_graphs=cuda_graphs).open()
        info = ModelInfo.from_models(target, drafter)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    graphs = getattr(backend, "graph_cache", None) is not None
    click.echo(f"models: {target_dir} + {drafter_dir}; {backend_name} backend, device {device}"
               f"{', target KV on the host' if host_kv else ''}{', CUDA graphs' if graphs else ''}; "
               f"{new_tokens} new tokens; tree nodes ≤ {tree_nodes}; {repeats} interleaved repeats")
    cost = fit_cost(backend, info, prompts_by_r, min(new_tokens, 24), tree_nodes, sync)
    click.echo(f"step cost fitted here: {cost.to_dict()}; target KV mode {kv_mode_for(backend, None)}")
    click.echo(f"{'R':>3} {'method':<15} {'tau':>6} {'tok/s med':>10} {'tok/s min':>10} {'vs AR':>6}")
    for r, prompts in prompts_by_r.items():  # one batch size at a time: its rows print as soon as they exist
        speeds: dict[str, list[float]] = {m: [] for m in METHODS}
        taus: dict[str, float] = {}
        phases: dict[str, str] = {}
        reference = None
        for _ in range(repeats):
            for method in METHODS:
                speed, tau, outputs, engine = run_once(backend, info, method, prompts, new_tokens, cost, tree_nodes,
                                                       sync)
                phases[method] = phase_split(engine)
                reference = outputs if method == "autoregressive" else reference
                if outputs != reference:
                    raise click.ClickException(f"{method} at R={r} differs from target greedy decoding")
                speeds[method].append(speed)
                taus[method] = tau
        base = statistics.median(speeds["autoregressive"])
        for method in METHODS:
            median = statistics.median(speeds[method])
            click.echo(f"{r:>3} {method:<15} {taus[method]:>6.2f} {median:>10.1f} {min(speeds[method]):>10.1f} "
                       f"{median / base:>6.2f}")
        for method in METHODS:
            click.echo(f"    {method} ms/step (last repeat): {phases[method]}")
    if graphs:
        cache = backend.graph_cache
        kept = sorted({layout[0] for layout in cache.calls})
        eager = sorted({layout[0] for layout in cache.eager_layouts})
        click.echo(f"CUDA graphs: {len(cache.calls)} layouts replayed ({', '.join(kept) or 'none'}); "
                   f"{len(cache.eager_layouts)} measured faster eager or not capturable ({', '.join(eager) or 'none'})")


def phase_split(engine: BatchEngine) -> str:
    """Mean milliseconds per step in each phase the engine times (prefill: the admissions' share)."""
    steps = [s for s in engine.stats.steps if s.requests]
    names = sorted({name for s in steps for name in s.seconds})
    return " ".join(f"{name} {1e3 * sum(s.seconds.get(name, 0.0) for s in steps) / max(len(steps), 1):.2f}"
                    for name in names)

if __name__ == "__main__":
    main()
