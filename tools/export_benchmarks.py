"""ORT CPU measurements behind the export design choices; `python -m dspark.tools.export_benchmarks`.

1. target: concat-cache graph vs static-cache graph (plus the runtime's in-place write of the new
   keys/values) for one decode step, B=64, T=1, past=256.
2. drafter: shared LM head in the backbone (base logits out) vs in the head graphs, and one-step
   head graph run γ times vs the fused greedy block graph, B=64, 4 new context rows on 256 cached.
Medians of repeated runs, milliseconds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from dspark.export import contract as C
from dspark.export import feeds as F
from dspark.export.lower import lower
from dspark.export.parity import session
from dspark.export.pipeline import DEFAULT_OPSET, graph_jobs
from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel, load_pair
from dspark.runtime.cost_model import time_median


def _export_all(target, drafter, placement: C.Placement, out: Path) -> dict[str, tuple]:
    sessions = {}
    for job in graph_jobs(target, drafter, "float32", placement):
        lower(job.module, job.example, job.spec, out, opset=DEFAULT_OPSET)
        sessions[job.spec.name] = (session(out / job.spec.file), job.spec)
    return sessions


def _feed(spec: C.GraphSpec, tensors) -> dict[str, np.ndarray]:
    return {
        n: t.numpy() if isinstance(t, torch.Tensor) else t
        for n, t in zip(spec.input_names, tensors, strict=True)
    }


def bench_target(sessions, target, batch: int, past: int, repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    concat_feeds = F.target_feeds(target.config, F.Case(batch, 1, past), torch.float32, g)
    sess, spec = sessions[C.TARGET]
    feed = _feed(spec, concat_feeds)
    concat = 1000 * time_median(lambda: sess.run(None, feed), repeats=repeat)

    spare = 1  # capacity = past + 1: the slot this step writes (more slots = more masked columns)
    ssess, sspec = sessions[C.TARGET_STATIC]
    sfeed = _feed(sspec, F.static_feeds(concat_feeds, spare, g))
    caches = [sfeed[n] for n in sspec.input_names[3:]]
    rows = np.arange(batch)

    def static_step() -> None:
        outs = ssess.run(None, sfeed)
        for cache, new in zip(caches, outs[2:], strict=True):  # in-place write at slot `past`
            cache[rows, :, past] = new[:, :, 0]

    return {"concat_ms": concat, "static_ms": 1000 * time_median(static_step, repeats=repeat)}


def bench_drafter(sessions, drafter, placement: C.Placement, batch: int, repeat: int) -> dict[str, float]:
    c = drafter.config
    g = torch.Generator().manual_seed(0)
    bsess, bspec = sessions[C.BACKBONE]
    bfeed = _feed(bspec, F.backbone_feeds(c, F.Case(batch, 4, 256), torch.float32, g))
    result = {"backbone_ms": 1000 * time_median(lambda: bsess.run(None, bfeed), repeats=repeat)}
    if not C.has_head_graphs(c):
        return result
    outs = dict(zip(bspec.output_names, bsess.run(None, bfeed), strict=True))
    hidden, base = outs["block_hidden"], outs.get("base_logits")
    ssess, sspec = sessions[C.HEAD_STEP]
    gsess = sessions[C.HEAD_GREEDY][0]
    anchor = np.zeros(batch, np.int64)

    def steps() -> None:
        prev, state = anchor, np.zeros((batch, c.markov_rank), np.float32)
        for k in range(c.block_size):
            feed = {"hidden": hidden[:, k], "prev_ids": prev}
            if placement.lm_head_in_backbone:
                feed["base_logits"] = base[:, k]
            if "state" in sspec.input_names:
                feed["state"] = state
            out = ssess.run(None, feed)
            prev = out[0].argmax(-1)  # the runtime samples here; argmax for the comparison
            state = out[-1] if "state" in sspec.input_names else state

    gfeed = {"block_hidden": hidden, "anchor_ids": anchor}
    if placement.lm_head_in_backbone:
        gfeed["base_logits"] = base
    result["head_steps_ms"] = 1000 * time_median(steps, repeats=repeat)
    result["head_greedy_ms"] = 1000 * time_median(lambda: gsess.run(None, gfeed), repeats=repeat)
    return result


def random_pair(vocab: int, hidden: int) -> tuple[TargetModel, DSparkDrafter]:
    """A Qwen3 pair of the given width (default init; timing only): 4 target layers, 1 draft
    layer, block 7, vanilla Markov head of rank 16 with a Markov-aware confidence head."""
    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
    )
    target_config = TargetConfig(**shape, num_hidden_layers=4)
    drafter_config = DrafterConfig(
        **shape,
        num_hidden_layers=1,
        block_size=7,
        target_layer_ids=(0, 2),
        num_target_layers=4,
        mask_token_id=vocab - 1,
        markov_rank=16,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    torch.manual_seed(0)
    return TargetModel(target_config, (0, 2)).eval(), DSparkDrafter(drafter_config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target folder (default: a random pair, see --vocab)")
    parser.add_argument("--drafter", help="drafter folder")
    parser.add_argument("--vocab", type=int, default=32768, help="vocab of the random pair")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random pair")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    if args.target and args.drafter:
        target, drafter = load_pair(args.target, args.drafter)
    else:
        target, drafter = random_pair(args.vocab, args.hidden)
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}")
    for in_backbone in (True, False):
        placement = C.Placement(lm_head_in_backbone=in_backbone)
        with tempfile.TemporaryDirectory() as tmp:
            sessions = _export_all(target, drafter, placement, Path(tmp))
            if in_backbone:
                print("target:", bench_target(sessions, target, args.batch, args.past, args.repeat))
            print(
                f"drafter lm_head_in_backbone={in_backbone}:",
                bench_drafter(sessions, drafter, placement, args.batch, args.repeat),
            )


if __name__ == "__main__":
    main()
