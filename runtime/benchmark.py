"""Runtime benchmarks on an export directory (ONNX Runtime, CPU), printed as tables.

    python -m dspark.runtime.benchmark --export DIR [--threads 1]

1. Target step time vs past length and vs batch size, concat KV (the past is gathered from the
   slot buffers and copied in, the graph returns past ++ new) against the static-cache graph
   (slot buffers bound in place, only new rows come back), both timed with the copy-in/write-
   back the engine does.
2. End-to-end tokens/s of the scheduler (`dspark`) vs fixed γ vs `off` at 1, 8, 64 concurrent
   requests, greedy, with the padding the verification paid.
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark.export import contract as C

from .api import Runtime, RuntimeOptions
from .cost_model import time_median
from .ort_backend import OrtBackend
from .prefix_scheduler import SchedulerConfig


def target_step_seconds(backend: OrtBackend, kv_mode: str, batch: int, past: int, tokens: int,
                        capacity: int) -> float:
    m = backend.manifest["target"]
    layers = m["num_layers"]
    # the engine's buffers, each with its layer's dims (Gemma-4's layers differ)
    slots = [torch.randn(batch, t.dims[1], capacity, t.dims[3]) for t in backend.specs[C.TARGET].inputs
             if t.name.startswith("past_key_values.")]
    ids = torch.randint(0, m["vocab_size"], (batch, tokens))
    positions = (past + torch.arange(tokens)).expand(batch, -1).contiguous()
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, 1, -1, -1)
    if kv_mode == "static":
        graph, names = C.TARGET_STATIC, C.kv_names("cache", layers)
        seen = (torch.arange(capacity) < past).expand(batch, 1, tokens, -1)
        mask = torch.cat((seen, causal), dim=-1).contiguous()

        def kv() -> list[torch.Tensor]:
            return slots
    else:
        graph, names = C.TARGET, C.kv_names("past_key_values", layers)
        mask = torch.ones(batch, 1, tokens, past + tokens, dtype=torch.bool)
        mask[..., past:] = causal

        def kv() -> list[torch.Tensor]:
            return [s[:, :, :past] for s in slots]  # non-contiguous view: copied into ORT

    def step() -> None:
        out = backend.run(graph, {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                                  **dict(zip(names, kv(), strict=True))})
        prefix = "new" if kv_mode == "static" else "present"
        offset = 0 if kv_mode == "static" else past
        for name, buf in zip(C.kv_names(prefix, layers), slots, strict=True):
            buf[:, :, past : past + tokens] = torch.from_numpy(out[name][:, :, offset : offset + tokens])

    return time_median(step, repeats=5)


def kv_table(backend: OrtBackend) -> None:
    print("target step time (ms), T new tokens per row; capacity 1024 slots per row for static")
    print(f"{'batch':>5} {'past':>5} {'T':>2} {'concat':>8} {'static':>8}")
    for batch, past in [(1, 64), (1, 512), (1, 960), (8, 64), (8, 512), (8, 960), (64, 64), (64, 512),
                        (64, 960)]:
        for tokens in (1, 8):
            concat = target_step_seconds(backend, "concat", batch, past, tokens, 1024)
            static = target_step_seconds(backend, "static", batch, past, tokens, 1024)
            print(f"{batch:>5} {past:>5} {tokens:>2} {1e3 * concat:8.2f} {1e3 * static:8.2f}")


def throughput_table(export_dir: str, threads: int, prompts: list[list[int]], max_new_tokens: int) -> None:
    print(f"\ngreedy decoding, {max_new_tokens} new tokens per request, ORT CPU ({threads} thread), concat KV")
    print(f"{'requests':>8} {'scheduler':>9} {'tok/s':>8} {'accept':>6} {'verified':>8} {'padding':>7} "
          f"{'steps':>5}")
    for concurrent in (1, 8, 64):
        batch = [prompts[i % len(prompts)] for i in range(concurrent)]
        for name, scheduler in [("dspark", SchedulerConfig("dspark")), ("fixed", SchedulerConfig("fixed")),
                                ("off", SchedulerConfig("off"))]:
            options = RuntimeOptions(scheduler=scheduler, max_requests=concurrent, max_seq_len=256)
            runtime = Runtime.load(export_dir, options, threads=threads)
            runtime.generate(batch, max_new_tokens=2)  # sessions created and warm before timing
            begin = time.perf_counter()
            results = runtime.generate(batch, max_new_tokens=max_new_tokens)
            seconds = time.perf_counter() - begin
            s = runtime.stats.summary()
            tokens = sum(len(r.tokens) for r in results)
            print(f"{concurrent:>8} {name:>9} {tokens / seconds:8.1f} {s['mean_acceptance_length']:6.2f} "
                  f"{s['verified_tokens']:>8} {s['padding_fraction']:7.1%} {s['steps']:>5}")
            if name == "dspark":
                print(f"{'':>8} {'':>9} cost model (ms): {runtime.cost_model.to_dict()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", required=True, help="dspark-export output directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-kv", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_kv:
        kv_table(OrtBackend(args.export, intra_op_threads=args.threads))
    g = torch.Generator().manual_seed(0)
    vocab = OrtBackend(args.export).manifest["target"]["vocab_size"]
    prompts = [torch.randint(0, min(vocab, 500), (n,), generator=g).tolist() for n in (24, 7, 50, 13)]
    throughput_table(args.export, args.threads, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
