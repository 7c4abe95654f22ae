"""Compare dspark's models and reference decoder with DeepSpec's golden fixtures.

    python -m dspark.tools.golden_report GOLDEN_DIR

prints, per golden drafter, the largest |difference| of every single-forward tensor and whether
every greedy trace (tokens, per-round accepted and proposal lengths) is reproduced. The test
suite asserts the same quantities (tests/test_golden_models.py, tests/test_golden_traces.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark.models import DSparkDrafter, TargetModel, load_pair
from dspark.runtime.proposer import propose_block
from dspark.runtime.reference_decoder import speculative_generate


@torch.no_grad()
def single_forward_tensors(target: TargetModel, drafter: DSparkDrafter, golden: dict[str, torch.Tensor]
                           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our tensor and DeepSpec's for every float in a golden `tensors*.safetensors` file that
    covers the target forward and round 0's draft block."""
    ids = golden["prompt_ids"]
    n = ids.shape[1]
    features = target(ids, torch.arange(n)[None])
    anchor = golden["draft_anchor_token"].reshape(1)
    gamma, mask = drafter.config.block_size, drafter.config.mask_token_id
    block_ids = torch.cat((anchor[:, None], torch.full((1, gamma - 1), mask)), dim=1)
    out = drafter.forward_backbone(
        block_ids=block_ids,
        block_position_ids=golden["draft_position_ids"][:, n:],
        context_features=features.context_features,
        context_position_ids=golden["draft_position_ids"][:, :n],
    )
    block = propose_block(drafter, out.hidden, anchor, temperature=0.0)
    pairs = {
        "target_logits": features.logits,
        "context_features": features.context_features,
        "drafter_context_projected": drafter.project_context(features.context_features),
        "draft_block_hidden": out.hidden,
        "draft_base_logits": drafter.base_logits(out.hidden),
        "draft_corrected_logits": block.logits,
        "draft_tokens": block.tokens,
    }
    if block.confidence_logits is not None:
        pairs["confidence_logits"] = block.confidence_logits
    for layer, (k, v) in enumerate(out.present_context):
        pairs[f"draft_cache_k_layer{layer}"], pairs[f"draft_cache_v_layer{layer}"] = k, v
    return {name: (ours, golden[name]) for name, ours in pairs.items()}


def trace_matches(target: TargetModel, drafter: DSparkDrafter, trace: dict) -> bool:
    """Every sample's tokens and per-round accepted/proposal lengths equal DeepSpec's."""
    for sample in trace["samples"]:
        # DeepSpec's loop stops once max_new_tokens follow the prefill token and then truncates,
        # so its last round is ours with one token more.
        result = speculative_generate(target, drafter, sample["prompt_ids"],
                                      max_new_tokens=trace["max_new_tokens"] + 1,
                                      confidence_threshold=trace["confidence_threshold"])
        if (result.tokens[: trace["max_new_tokens"]] != sample["generated_ids"]
                or [r.acceptance_length for r in result.rounds] != sample["acceptance_lengths"]
                or [r.proposal_length for r in result.rounds] != sample["proposal_lengths"]):
            return False
    return True


def report(golden_dir: Path) -> None:
    for set_dir in sorted(p for p in golden_dir.iterdir() if (p / "target").is_dir()):
        for drafter_dir in sorted(p for p in set_dir.iterdir() if p.name.startswith("drafter")):
            stem = drafter_dir.name.removeprefix("drafter")
            target, drafter = load_pair(set_dir / "target", drafter_dir)
            tensors = single_forward_tensors(target, drafter, load_file(str(set_dir / f"tensors{stem}.safetensors")))
            worst = max((ours.float() - ref.float()).abs().max().item() for ours, ref in tensors.values())
            print(f"{set_dir.name}/{drafter_dir.name}: max |diff| over {len(tensors)} tensors = {worst:.2e}")
            for trace_file in sorted(set_dir.glob(f"traces{stem}*.json")):
                ok = trace_matches(target, drafter, json.loads(trace_file.read_text()))
                print(f"  {trace_file.name}: {'identical' if ok else 'DIFFERENT'}")


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DSPARK_GOLDEN")
    if not folder:
        sys.exit("usage: python -m dspark.tools.golden_report GOLDEN_DIR (or set DSPARK_GOLDEN)")
    report(Path(folder))
