"""Tree decoding: greedy equals target greedy; tree inputs; KV and drafter-context compaction;
batched tree feeds and KV commits for the batched runtime."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import golden_path, random_pair

from dspark.models import load_pair
from dspark.plugins import compose_full_mask
from dspark.runtime.capacity import CacheShape
from dspark.runtime.kv_cache import SlotCache
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.requests import RequestError
from dspark.runtime.tree_builder import DraftTree, build_tree
from dspark.runtime.tree_decoder import tree_generate
from dspark.runtime.tree_verifier import (
    accept_tree,
    compact_kv_cache,
    gather_accepted_kv,
    pack_trees,
    path_features,
    run_tree,
    tree_inputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
@pytest.mark.parametrize("mode", ["markov", "marginals"])
def test_random_pairs_greedy_tree_decoding_equals_target_greedy(head: str, mode: str) -> None:
    target, drafter = random_pair(1, drafter_overrides={"markov_head_type": head}, scale=8.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = autoregressive_generate(target, prompt, max_new_tokens=24)
    for nodes in (0, 1, 5, 24):
        result = tree_generate(target, drafter, prompt, max_new_tokens=24, num_nodes=nodes, mode=mode)
        assert result.tokens == expected, f"{nodes} nodes"
        assert all(r.tree_nodes <= nodes and r.acceptance_length <= r.tree_depth + 1 for r in result.rounds)


@pytest.fixture(scope="module")
def golden_pair():
    folder = golden_path("qwen3-tiny-vanilla")
    return load_pair(folder / "target", folder / "drafter")


@pytest.mark.parametrize("nodes,mode", [(4, "markov"), (16, "markov"), (48, "markov"), (16, "marginals")])
def test_golden_pair_greedy_tree_decoding_equals_target_greedy(golden_pair, nodes: int, mode: str) -> None:
    target, drafter = golden_pair
    rng = random.Random(nodes)
    for length in (9, 30):
        prompt = [rng.randrange(500) for _ in range(length)]
        expected = autoregressive_generate(target, prompt, max_new_tokens=40)
        result = tree_generate(target, drafter, prompt, max_new_tokens=40, num_nodes=nodes, mode=mode)
        assert result.tokens == expected


def test_golden_pair_node_scheduler_stays_lossless_and_varies_the_budget(golden_pair) -> None:
    target, drafter = golden_pair
    prompt = [67, 24, 319, 84, 473, 74, 431, 279, 434, 430, 368, 165, 406]
    expected = autoregressive_generate(target, prompt, max_new_tokens=40)
    result = tree_generate(target, drafter, prompt, max_new_tokens=40, num_nodes=32,
                           sps=lambda tokens: 1.0 / (1.0 + 0.05 * tokens))
    assert result.tokens == expected
    budgets = {r.tree_nodes for r in result.rounds}
    assert len(budgets) > 1 and max(budgets) < 32


def test_tree_inputs_are_ancestor_only_with_depth_positions() -> None:
    tree = DraftTree(parents=[-1, 0, 0, 1, 3], tokens=[7, 1, 2, 3, 4], depths=[0, 1, 1, 2, 3],
                     scores=[1.0, 0.5, 0.3, 0.2, 0.1])
    ids, positions, mask = tree_inputs(tree, past_length=5)
    assert ids.tolist() == [[7, 1, 2, 3, 4]]
    assert positions.tolist() == [[5, 6, 6, 7, 8]]
    assert mask.shape == (1, 1, 5, 10) and mask[0, 0, :, :5].all()
    assert mask[0, 0, 4, 5:].tolist() == [True, True, False, True, True]
    assert mask[0, 0, 2, 5:].tolist() == [True, False, True, False, False]


def test_compaction_keeps_the_accepted_path_like_a_chain_forward() -> None:
    """A hand-made tree whose accepted path skips nodes: the compacted target cache and the
    drafter's context features equal those of a plain causal forward over the accepted tokens."""
    target, _ = random_pair(2, scale=8.0)
    prompt = [5, 8, 13, 21, 3]
    greedy = autoregressive_generate(target, prompt, max_new_tokens=5)  # anchor, g1..g4
    wrong = [(g + 1) % target.config.vocab_size for g in greedy]
    # root -> 1 (wrong), 2 (g1) -> 3 (wrong, child of 2), 4 (g2, child of 2) -> 5 (g3, child of 4)
    tree = DraftTree(parents=[-1, 0, 0, 2, 2, 4, 1], depths=[0, 1, 1, 2, 2, 3, 2],
                     tokens=[greedy[0], wrong[1], greedy[1], wrong[2], greedy[2], greedy[3], greedy[2]],
                     scores=[1.0] * 7)
    prefill = target(torch.tensor([prompt]), torch.arange(len(prompt))[None])
    past = len(prompt)
    out = run_tree(target, tree, prefill.present, past)
    verdict = accept_tree(tree, out.logits[0], temperature=0.0)
    assert verdict.path == [0, 2, 4, 5] and verdict.tokens == greedy[1:5]

    chain_ids = prompt + greedy[:4]
    chain = target(torch.tensor([chain_ids]), torch.arange(len(chain_ids))[None])
    compacted = compact_kv_cache(out.present, past, verdict.path)
    for (k, v), (ck, cv) in zip(compacted, chain.present, strict=True):
        assert k.shape == ck.shape
        torch.testing.assert_close(k, ck, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, cv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(path_features(out.context_features, verdict.path),
                               chain.context_features[:, past:], atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible_per_seed() -> None:
    target, drafter = random_pair(4, scale=4.0)
    prompt = [1, 2, 3, 4]
    runs = [tree_generate(target, drafter, prompt, max_new_tokens=20, num_nodes=8, temperature=1.0, seed=s).tokens
            for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_requests_are_refused() -> None:
    target, drafter = random_pair(4)
    with pytest.raises(RequestError, match="num_nodes"):
        tree_generate(target, drafter, [1, 2], max_new_tokens=4, num_nodes=-1)
    with pytest.raises(RequestError, match="prompt is empty"):
        tree_generate(target, drafter, [], max_new_tokens=4, num_nodes=4)


def test_packed_trees_verify_in_one_batched_forward_like_one_by_one() -> None:
    """Two requests with different cache lengths and tree sizes, padded into one target call,
    give each node the logits of its own single-request tree forward."""
    target, drafter = random_pair(5, scale=8.0)
    prompts, trees = [[4, 9, 2, 7, 1, 3], [8, 8, 5]], []
    caches, singles = [], []
    for prompt in prompts:
        out = target(torch.tensor([prompt]), torch.arange(len(prompt))[None])
        hidden = drafter.forward_backbone(
            block_ids=torch.tensor([[2] + [drafter.config.mask_token_id] * 3]),
            block_position_ids=torch.arange(len(prompt), len(prompt) + 4)[None],
            context_features=out.context_features, context_position_ids=torch.arange(len(prompt))[None],
        ).hidden[0]
        trees.append(build_tree(drafter, hidden, 2, num_nodes=9 if len(prompt) == 6 else 4))
        caches.append(out.present)
        singles.append(run_tree(target, trees[-1], out.present, len(prompt)).logits[0])
    past = [len(p) for p in prompts]
    packed = pack_trees(trees, past)
    capacity = max(past)
    capacity_pad = [(0, 0, 0, capacity - n) for n in past]
    cache = [tuple(torch.cat([F.pad(c[i][j], pad) for c, pad in zip(caches, capacity_pad, strict=True)])
                   for j in (0, 1))
             for i in range(len(caches[0]))]
    mask = compose_full_mask(packed.tree_mask, torch.tensor(past), capacity)
    logits = target(packed.input_ids, packed.position_ids, attention_mask=mask, past_key_values=cache).logits
    for r, tree in enumerate(trees):
        torch.testing.assert_close(logits[r, : tree.num_nodes + 1], singles[r], atol=1e-5, rtol=1e-5)
    assert packed.parents[1, trees[1].num_nodes + 1 :].eq(-2).all()


def test_gathered_tree_kv_commits_the_accepted_paths_through_the_slot_cache() -> None:
    """The batched runtime's SlotCache.write commits contiguous entries; after gather_accepted_kv
    those are each row's accepted tree nodes, in path order."""
    offset, paths, past = 6, [[0, 2, 5], [0, 1]], [5, 3]
    present = [(torch.randn(2, 2, offset + 7, 4), torch.randn(2, 2, offset + 7, 4)) for _ in range(2)]
    cache = SlotCache(CacheShape(layers=2, kv_heads=2, head_dim=4), slots=2, max_len=16)
    cache.lengths[:] = past
    cache.write(gather_accepted_kv(present, offset, paths), source_offset=offset, counts=[len(p) for p in paths])
    assert cache.lengths.tolist() == [8, 5]
    for layer, (k, v) in enumerate(present):
        for r, path in enumerate(paths):
            for i, node in enumerate(path):
                assert torch.equal(torch.from_numpy(cache.keys[layer][r, :, past[r] + i]), k[r, :, offset + node])
                assert torch.equal(torch.from_numpy(cache.values[layer][r, :, past[r] + i]), v[r, :, offset + node])
