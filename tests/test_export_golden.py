"""ORT round trip of every golden set: exported graphs reproduce DeepSpec's tensors (<= 1e-4),
and the target graphs verify trees exactly like plain causal sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GOLDEN_DRAFTERS, golden_path
from safetensors.torch import load_file

from dspark.export import feeds as F
from dspark.export.manifest import read_manifest
from dspark.export.parity import session
from dspark.export.pipeline import export_pair
from dspark.models import causal_mask

ATOL = 1e-4


@pytest.fixture(scope="module", params=GOLDEN_DRAFTERS, ids=lambda g: f"{g.set_name}/{g.drafter_dir}")
def golden_export(request, tmp_path_factory):
    g = request.param
    root = golden_path(g.set_name)
    out = tmp_path_factory.mktemp("export")
    export_pair(root / "target", root / g.drafter_dir, out, check=False)
    tensors = {k: v.numpy() for k, v in load_file(str(root / f"tensors{g.stem}.safetensors")).items()}
    return out, read_manifest(out), tensors


def run(out, manifest, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    spec = manifest["graphs"][graph]
    sess = session(out / spec["file"])
    names = [o["name"] for o in spec["outputs"]]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def empty_kv(manifest, prefix: str, owner: str, batch: int = 1) -> dict[str, np.ndarray]:
    m = manifest[owner]
    shape = (batch, m["num_kv_heads"], 0, m["head_dim"])
    return {
        f"{prefix}.{i}.{k}": np.zeros(shape, np.float32)
        for i in range(m["num_layers"])
        for k in ("key", "value")
    }


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=ATOL)


def test_target_graphs_match_golden(golden_export):
    out, manifest, t = golden_export
    ids = t["prompt_ids"]
    n = ids.shape[1]
    base = {
        "input_ids": ids,
        "position_ids": np.arange(n)[None],
        "attention_mask": causal_mask(1, n, 0).numpy(),
    }
    res = run(out, manifest, "target", {**base, **empty_kv(manifest, "past_key_values", "target")})
    close(res["logits"], t["target_logits"])
    close(res["context_features"], t["context_features"])
    # Static cache: 5 garbage slots the mask hides must change nothing.
    spare = 5
    m = manifest["target"]
    cache = {
        name: np.random.default_rng(0)
        .standard_normal((*v.shape[:2], spare, *v.shape[3:]))
        .astype(np.float32)
        for name, v in empty_kv(manifest, "cache", "target").items()
    }
    mask = np.concatenate((np.zeros((1, 1, n, spare), bool), base["attention_mask"]), axis=-1)
    res = run(out, manifest, "target_static", {**base, "attention_mask": mask, **cache})
    close(res["logits"], t["target_logits"])
    close(res["context_features"], t["context_features"])
    assert res["new.0.key"].shape == (1, m["num_kv_heads"], n, m["head_dim"])


def test_drafter_graphs_match_golden(golden_export):
    out, manifest, t = golden_export
    d = manifest["drafter"]
    n = t["context_features"].shape[1]
    block = d["block_size"]
    positions = t["draft_position_ids"]
    feeds = {
        "block_ids": t["draft_input_ids"],
        "block_position_ids": positions[:, n:],
        "context_features": t["context_features"],
        "context_position_ids": positions[:, :n],
        "attention_mask": np.ones((1, 1, block, n + block), bool),
        **empty_kv(manifest, "past_context", "drafter"),
    }
    res = run(out, manifest, "drafter_backbone", feeds)
    close(res["block_hidden"], t["draft_block_hidden"])
    close(res["base_logits"], t["draft_base_logits"])
    for i in range(d["num_layers"]):
        close(res[f"present_context.{i}.key"], t[f"draft_cache_k_layer{i}"])
        close(res[f"present_context.{i}.value"], t[f"draft_cache_v_layer{i}"])
    if "drafter_head_step" not in manifest["graphs"]:
        assert d["markov_rank"] == 0 and not d["enable_confidence_head"]
        close(res["base_logits"], t["draft_corrected_logits"])
        assert (res["base_logits"].argmax(-1) == t["draft_tokens"]).all()
        return

    anchor = t["draft_anchor_token"]
    greedy = run(
        out,
        manifest,
        "drafter_head_greedy",
        {
            "block_hidden": t["draft_block_hidden"],
            "base_logits": t["draft_base_logits"],
            "anchor_ids": anchor,
        },
    )
    close(greedy["logits"], t["draft_corrected_logits"])
    np.testing.assert_array_equal(greedy["draft_ids"], t["draft_tokens"])
    close(greedy["confidence_logits"], t["confidence_logits"])

    state = np.zeros((1, d["markov_rank"]), np.float32)
    for k in range(block):
        feeds = {
            "hidden": t["draft_block_hidden"][:, k],
            "base_logits": t["draft_base_logits"][:, k],
            "prev_ids": t["confidence_prev_token_ids"][:, k],
        }
        if d["head_state"]:
            feeds["state"] = state
        step = run(out, manifest, "drafter_head_step", feeds)
        close(step["logits"], t["draft_corrected_logits"][:, k])
        close(step["confidence_logit"], t["confidence_logits"][:, k])
        state = step.get("next_state", state)


def test_manifest_describes_the_pair(golden_export):
    out, manifest, t = golden_export
    assert manifest["drafter"]["block_size"] == t["draft_input_ids"].shape[1]
    assert manifest["drafter"]["mask_token_id"] == int(t["draft_input_ids"][0, -1])
    assert manifest["target"]["context_feature_size"] == t["context_features"].shape[-1]
    for graph in manifest["graphs"].values():
        assert [f["path"] for f in graph["files"]] == [graph["file"]]
        assert len(graph["files"][0]["sha256"]) == 64
        assert (out / graph["file"]).stat().st_size == graph["files"][0]["bytes"]


@pytest.mark.parametrize("graph", ["target", "target_static"])
def test_tree_nodes_equal_their_root_paths(golden_export, graph):
    """Each tree node's logits equal the last logits of its root-to-node path run causally."""
    out, manifest, t = golden_export
    if manifest["drafter"]["target_layer_ids"] != [0, 2]:
        pytest.skip("one golden target is enough for the tree test")
    g = torch.Generator().manual_seed(7)
    prompt = t["prompt_ids"]
    past = prompt.shape[1]
    prefill = run(
        out,
        manifest,
        "target",
        {
            "input_ids": prompt,
            "position_ids": np.arange(past)[None],
            "attention_mask": causal_mask(1, past, 0).numpy(),
            **empty_kv(manifest, "past_key_values", "target"),
        },
    )
    cache = {
        k.replace("present", "past_key_values"): v for k, v in prefill.items() if k.startswith("present")
    }
    parents = F.random_parents(12, g)
    tokens = torch.randint(0, 500, (1, 12), generator=g).numpy()
    mask = F.tree_mask(parents, past).numpy()
    positions = F.tree_positions(parents, past).numpy()
    if graph == "target":
        tree = run(
            out,
            manifest,
            graph,
            {"input_ids": tokens, "position_ids": positions, "attention_mask": mask, **cache},
        )["logits"]
    else:
        static = {k.replace("past_key_values", "cache"): v for k, v in cache.items()}
        tree = run(
            out,
            manifest,
            graph,
            {"input_ids": tokens, "position_ids": positions, "attention_mask": mask, **static},
        )["logits"]
    assert len(set(parents)) > 2  # a real tree, not a chain
    for node in range(12):
        path = []
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        chain = run(
            out,
            manifest,
            "target",
            {
                "input_ids": tokens[:, path],
                "position_ids": np.arange(past, past + len(path))[None],
                "attention_mask": causal_mask(1, len(path), past).numpy(),
                **cache,
            },
        )["logits"]
        close(tree[:, path[-1]], chain[:, -1])
