"""Compare dspark's models and reference decoder with DeepSpec's golden fixtures.

    python -m dspark.tools.golden_report [--per-tensor] [--onnx] GOLDEN_DIR

prints, per golden drafter, the largest |difference| of every single-forward tensor (with
--per-tensor: of each golden tensor, hidden states and training forward included; with --onnx:
also of the exported plain graphs run on ONNX Runtime) and whether
every greedy trace (tokens, per-round accepted and proposal lengths) is reproduced. The test
suite asserts the same quantities (tests/test_golden_models.py, tests/test_golden_traces.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from dspark.models import DSparkDrafter, TargetModel, load_pair
from dspark.models.loss import LossWeights, dspark_loss
from dspark.models.training import target_training_features, training_forward
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


@torch.no_grad()
def extra_tensors(target: TargetModel, drafter: DSparkDrafter, golden: dict[str, torch.Tensor], info: dict,
                  block_hidden: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Ours and DeepSpec's for the golden tensors `single_forward_tensors` leaves out, where the set
    has them: every hidden state, the pre-soft-cap logits, the block embedding, and the training
    forward and loss. `block_hidden`: our round-0 draft block hidden [1, γ, H]."""
    ids = golden["prompt_ids"]
    n, layers, pairs = ids.shape[1], target.config.num_hidden_layers, {}
    if "draft_noise_embedding" in golden:
        scale = drafter.config.embedding_scale
        pairs["draft_noise_embedding"] = drafter.embed_tokens(golden["draft_input_ids"]) * scale, \
            golden["draft_noise_embedding"]
    if "draft_lm_head_raw" in golden:
        pairs["draft_lm_head_raw"] = drafter.lm_head(block_hidden), golden["draft_lm_head_raw"]
    if "target_hidden_states_all" in golden:
        probe = TargetModel(target.config, tuple(range(-1, layers - 1)))
        probe.load_state_dict(target.state_dict())
        raw: list[torch.Tensor] = []
        hook = probe.layers[-1].register_forward_hook(lambda _m, _i, output: raw.append(output[0]))
        hidden = probe(ids, torch.arange(n)[None]).context_features.split(target.config.hidden_size, dim=-1)
        hook.remove()
        final = probe.norm(raw[0])
        pairs["target_hidden_states_all"] = torch.stack((*hidden, final)), golden["target_hidden_states_all"]
        for name, ours in (("target_last_layer_raw", raw[0]), ("target_logits_pre_softcap", probe.lm_head(final))):
            if name in golden:
                pairs[name] = ours, golden[name]
    if "train_draft_logits" in golden and "loss_kwargs" in info.get("train_forward", {}):
        features, last_hidden = target_training_features(target, ids)
        out = training_forward(drafter, input_ids=ids, context_features=features, target_last_hidden=last_hidden,
                               loss_mask=golden["train_loss_mask"], anchor_positions=golden["train_anchor_positions"])
        kw = info["train_forward"]["loss_kwargs"]
        loss = dspark_loss(out, LossWeights(ce=kw["ce_loss_alpha"], tv=kw["l1_loss_alpha"],
                                            confidence=kw["confidence_head_alpha"], decay_gamma=kw["loss_decay_gamma"]))
        pairs.update(train_last_hidden_states=(last_hidden, golden["train_last_hidden_states"]),
                     train_draft_logits=(out.draft_logits, golden["train_draft_logits"]),
                     train_aligned_target_logits=(out.aligned_target_logits, golden["train_aligned_target_logits"]),
                     train_loss=(loss.total.reshape(1), golden["train_loss"]))
        if out.confidence_logits is not None:
            pairs["train_confidence_pred"] = out.confidence_logits, golden["train_confidence_pred"]
    return pairs


def onnx_deviations(set_dir: Path, drafter_dir: Path, golden: dict[str, torch.Tensor]) -> dict[str, float]:
    """Export the pair (plain graphs, into a temporary folder) and run ONNX Runtime on the golden
    prompt and round 0's block: {graph/output: largest |diff| from DeepSpec's tensor}."""
    from dspark.export.parity import session  # onnxruntime only when asked for
    from dspark.export.pipeline import export_pair

    g = {k: v.numpy() for k, v in golden.items()}
    ids, n = g["prompt_ids"], g["prompt_ids"].shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        graphs = export_pair(set_dir / "target", drafter_dir, out, check=False, flavours=("plain",))["graphs"]

        def run(graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            for t in graphs[graph]["inputs"]:  # empty caches, each with its layer's dims
                if t["name"] not in feeds:
                    feeds[t["name"]] = np.zeros((1, t["dims"][1], 0, t["dims"][3]), np.float32)
            names = [o["name"] for o in graphs[graph]["outputs"]]
            return dict(zip(names, session(out / graphs[graph]["file"]).run(names, feeds), strict=True))

        res = {"target/" + k: v for k, v in run("target", {
            "input_ids": ids, "position_ids": np.arange(n)[None],
            "attention_mask": np.tril(np.ones((n, n), bool))[None, None]}).items()}
        block = g["draft_input_ids"].shape[1]
        res.update({"drafter_backbone/" + k: v for k, v in run("drafter_backbone", {
            "block_ids": g["draft_input_ids"], "block_position_ids": g["draft_position_ids"][:, n:],
            "context_features": g["context_features"], "context_position_ids": g["draft_position_ids"][:, :n],
            "attention_mask": np.ones((1, 1, block, n + block), bool)}).items()})
        if "drafter_head_greedy" in graphs:
            res.update({"drafter_head_greedy/" + k: v for k, v in run("drafter_head_greedy", {
                "block_hidden": g["draft_block_hidden"], "base_logits": g["draft_base_logits"],
                "anchor_ids": g["draft_anchor_token"]}).items()})
    reference = {"target/logits": "target_logits", "target/context_features": "context_features",
                 "drafter_backbone/block_hidden": "draft_block_hidden",
                 "drafter_backbone/base_logits": "draft_base_logits",
                 "drafter_head_greedy/logits": "draft_corrected_logits",
                 "drafter_head_greedy/draft_ids": "draft_tokens",
                 "drafter_head_greedy/confidence_logits": "confidence_logits"}
    reference.update({f"drafter_backbone/present_context.{i}.{kind}": f"draft_cache_{kind[0]}_layer{i}"
                      for i in range(8) for kind in ("key", "value")})
    return {name: float(np.abs(res[name].astype(np.float64) - g[ref]).max())
            for name, ref in reference.items() if name in res and ref in g}


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


def report(golden_dir: Path, per_tensor: bool = False, onnx: bool = False) -> None:
    """`per_tensor`: every golden tensor's largest |diff|, the training forward included. `onnx`:
    also the exported graphs' on ONNX Runtime."""
    for set_dir in sorted(p for p in golden_dir.iterdir() if (p / "target").is_dir()):
        for drafter_dir in sorted(p for p in set_dir.iterdir() if p.name.startswith("drafter")):
            stem = drafter_dir.name.removeprefix("drafter")
            target, drafter = load_pair(set_dir / "target", drafter_dir)
            golden = load_file(str(set_dir / f"tensors{stem}.safetensors"))
            tensors = single_forward_tensors(target, drafter, golden)
            if per_tensor:
                info = json.loads((set_dir / f"tensors{stem}.json").read_text()).get("info", {})
                tensors.update(extra_tensors(target, drafter, golden, info, tensors["draft_block_hidden"][0]))
            worst = max((ours.float() - ref.float()).abs().max().item() for ours, ref in tensors.values())
            print(f"{set_dir.name}/{drafter_dir.name}: max |diff| over {len(tensors)} tensors = {worst:.2e}")
            for name, (ours, ref) in tensors.items() if per_tensor else ():
                print(f"  {name}: {(ours.float() - ref.float()).abs().max().item():.2e}")
            if onnx:
                deviations = onnx_deviations(set_dir, drafter_dir, golden)
                print(f"  ONNX Runtime, plain graphs: max |diff| over {len(deviations)} outputs = "
                      f"{max(deviations.values()):.2e}")
                for name, value in deviations.items() if per_tensor else ():
                    print(f"    {name}: {value:.2e}")
            for trace_file in sorted(set_dir.glob(f"traces{stem}*.json")):
                ok = trace_matches(target, drafter, json.loads(trace_file.read_text()))
                print(f"  {trace_file.name}: {'identical' if ok else 'DIFFERENT'}")


if __name__ == "__main__":
    flags = {"--per-tensor", "--onnx"}
    args = [a for a in sys.argv[1:] if a not in flags]
    folder = args[0] if args else os.environ.get("DSPARK_GOLDEN")
    if not folder:
        sys.exit("usage: python -m dspark.tools.golden_report [--per-tensor] [--onnx] GOLDEN_DIR "
                 "(or set DSPARK_GOLDEN)")
    report(Path(folder), per_tensor="--per-tensor" in sys.argv[1:], onnx="--onnx" in sys.argv[1:])
