"""Semantics of the plugin operators' numpy references (the source of truth for ORT, CUDA, TensorRT)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark import plugins
from dspark.plugins.tree_accept.reference import tree_accept_greedy, tree_accept_sampling
from dspark.plugins.tree_attention_mask.reference import pack_bits, tree_attention_mask, unpack_bits

# Hand-made tree, 7 nodes, node 6 is padding:      0
#                                                 / \
#                                                1   2
#                                               / \   \
#                                              3   4   5
PARENTS = np.array([[-1, 0, 0, 1, 1, 2, -2]])
TOKENS = np.array([[9, 1, 2, 3, 4, 5, 0]])


def random_trees(
    rng: np.random.Generator, batch: int, n: int, *, pad: float = 0.2, vocab: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Random valid trees [batch, n] and tokens whose siblings never repeat a token."""
    parents = np.full((batch, n), -2, dtype=np.int64)
    tokens = np.zeros((batch, n), dtype=np.int64)
    parents[:, 0] = -1
    tokens[:, 0] = rng.integers(vocab, size=batch)
    for b in range(batch):
        for i in range(1, n):
            real = np.flatnonzero(parents[b, :i] != -2)
            if rng.random() < pad:
                continue
            parent = int(rng.choice(real))
            taken = set(tokens[b, np.flatnonzero(parents[b, :i] == parent)].tolist())
            free = [t for t in range(vocab) if t not in taken]
            if not free:
                continue
            parents[b, i] = parent
            tokens[b, i] = rng.choice(free)
    return parents, tokens


def root_path(parents_row: np.ndarray, i: int) -> list[int]:
    path = [i]
    while parents_row[path[-1]] >= 0:
        path.append(int(parents_row[path[-1]]))
    return path[::-1]


def test_mask_positions_and_words_on_hand_made_tree():
    mask, position_ids, packed = tree_attention_mask(PARENTS, np.array([5]))
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 1],  # padding sees only itself
        ],
        dtype=bool,
    )
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == bool
    np.testing.assert_array_equal(mask[0, 0], expected)
    np.testing.assert_array_equal(position_ids, [[5, 6, 6, 7, 7, 7, 5]])
    np.testing.assert_array_equal(packed[0, :, 0], [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0b1000000])


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([[0, 0, 1]], r"parents\[0, 0\] = 0: node 0 must be the root"),
        ([[-1, 0, 2]], r"parents\[0, 2\] = 2: a node's parent must be an earlier node"),
        ([[-1, 0, -3]], r"parents\[0, 2\] = -3"),
        ([[-1, -2, 1]], r"parents\[0, 2\] = 1 is a padding node"),
    ],
)
def test_invalid_trees_are_rejected_with_the_offending_entry(parents, message):
    with pytest.raises(ValueError, match=message):
        tree_attention_mask(np.array(parents), np.zeros(1, dtype=np.int64))


def test_mask_is_the_root_path_on_random_trees():
    rng = np.random.default_rng(0)
    parents, _ = random_trees(rng, batch=6, n=40)
    past = rng.integers(0, 100, size=6)
    mask, position_ids, _ = tree_attention_mask(parents, past)
    for b in range(6):
        for i in range(40):
            allowed = {i} if parents[b, i] == -2 else set(root_path(parents[b], i))
            assert set(np.flatnonzero(mask[b, 0, i]).tolist()) == allowed
            assert position_ids[b, i] == past[b] + len(allowed) - 1


def test_packed_mask_equals_packed_bool_mask_including_sign_bit():
    chain = np.concatenate([[-1], np.arange(69)])[None]  # node i's parent is i - 1: row 69 sets 70 bits
    rng = np.random.default_rng(1)
    trees, _ = random_trees(rng, batch=3, n=70)
    for parents in (chain, trees):
        mask, _, packed = tree_attention_mask(parents, np.zeros(len(parents), dtype=np.int64))
        assert packed.shape == (len(parents), 70, 3) and packed.dtype == np.int32
        np.testing.assert_array_equal(unpack_bits(packed, 70), mask[:, 0])
    np.testing.assert_array_equal(pack_bits(np.ones(32, dtype=bool)), [-1])  # bit 31 is the sign bit
    _, _, packed = tree_attention_mask(chain, np.zeros(1, dtype=np.int64))
    np.testing.assert_array_equal(packed[0, 69], [-1, -1, 0b111111])


def test_full_mask_prepends_the_filled_cache_columns():
    mask, _, _ = tree_attention_mask(np.repeat(PARENTS, 2, axis=0), np.array([2, 4]))
    full = plugins.compose_full_mask(mask, np.array([2, 4]), past_capacity=5)
    assert full.shape == (2, 1, 7, 12)
    np.testing.assert_array_equal(full[:, 0, :, :5].all(axis=1), [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(full[:, :, :, 5:], mask)


def test_greedy_accept_on_hand_made_tree():
    targets = np.array([[2, 7, 5, 8, 8, 6, 0]])  # root wants 2 (node 2), node 2 wants 5 (node 5)
    result = tree_accept_greedy(PARENTS, TOKENS, np.array([5]), targets, max_depth=3)
    np.testing.assert_array_equal(result.accepted_path, [[0, 2, 5, -1]])
    np.testing.assert_array_equal(result.accept_length, [3])
    np.testing.assert_array_equal(result.bonus_token, [6])
    np.testing.assert_array_equal(result.kv_keep, [[5, 7, 10, -1]])
    capped = tree_accept_greedy(PARENTS, TOKENS, np.array([5]), targets, max_depth=1)
    np.testing.assert_array_equal(capped.accepted_path, [[0, 2]])
    np.testing.assert_array_equal(capped.bonus_token, [5])  # target argmax at node 2
    none = tree_accept_greedy(PARENTS, TOKENS, np.array([0]), np.array([[7, 0, 0, 0, 0, 0, 0]]), max_depth=3)
    np.testing.assert_array_equal(none.accepted_path, [[0, -1, -1, -1]])
    np.testing.assert_array_equal(none.accept_length, [1])
    np.testing.assert_array_equal(none.bonus_token, [7])


def test_greedy_takes_the_first_matching_sibling():
    parents = np.array([[-1, 0, 0, 2]])
    tokens = np.array([[0, 4, 4, 5]])  # both children carry 4; only the second has a child
    result = tree_accept_greedy(parents, tokens, np.array([0]), np.array([[4, 5, 5, 1]]), max_depth=2)
    np.testing.assert_array_equal(result.accepted_path, [[0, 1, -1]])
    np.testing.assert_array_equal(result.bonus_token, [5])


def test_greedy_equals_longest_matching_path_brute_force():
    rng = np.random.default_rng(2)
    batch, n, vocab = 64, 24, 3
    parents, tokens = random_trees(rng, batch, n, pad=0.1, vocab=vocab)
    targets = rng.integers(vocab, size=(batch, n))
    for max_depth in (2, n - 1):
        result = tree_accept_greedy(parents, tokens, np.zeros(batch, dtype=np.int64), targets, max_depth)
        for b in range(batch):
            paths = [root_path(parents[b], i) for i in range(n) if parents[b, i] != -2]
            matching = [
                p
                for p in paths
                if len(p) <= max_depth + 1 and all(tokens[b, c] == targets[b, u] for u, c in itertools.pairwise(p))
            ]
            best = max(matching, key=len)  # siblings never share a token: the longest one is unique
            assert sum(len(p) == len(best) for p in matching) == 1
            assert result.accepted_path[b, : len(best)].tolist() == best
            assert (result.accepted_path[b, len(best) :] == -1).all()
            assert result.accept_length[b] == len(best)
            assert result.bonus_token[b] == targets[b, best[-1]]


def one_hot(tokens: list[int], vocab: int) -> np.ndarray:
    return np.eye(vocab)[tokens]


def test_sampling_accepts_certain_tokens_and_draws_bonus_from_the_residual():
    parents = np.array([[-1, 0, 0]])
    tokens = np.array([[0, 1, 2]])
    target = np.array([[[0.0, 0.0, 0.5, 0.5], [0.25] * 4, [0.25] * 4]])
    draft = one_hot([0, 1, 2], 4)[None]  # deterministic children: q_c = one-hot(token c)
    # node 1 (token 1) has p = 0: rejected whatever u; node 2 (token 2) has p = 0.5: accepted iff u < 0.5
    accept = tree_accept_sampling(parents, tokens, np.array([3]), target, draft, np.array([[0.0, 0.9, 0.4]]), 2)
    np.testing.assert_array_equal(accept.accepted_path, [[0, 2, -1]])
    np.testing.assert_array_equal(accept.kv_keep, [[3, 5, -1]])
    assert accept.bonus_token[0] == 0  # p at node 2 is uniform, u = 0 picks token 0
    reject = tree_accept_sampling(parents, tokens, np.array([3]), target, draft, np.array([[0.0, 0.1, 0.6]]), 2)
    np.testing.assert_array_equal(reject.accepted_path, [[0, -1, -1]])
    assert reject.bonus_token[0] == 3  # residual: p without tokens 1 and 2 -> all mass on token 3


def test_sampling_is_a_function_of_its_inputs():
    rng = np.random.default_rng(3)
    parents, tokens = random_trees(rng, batch=8, n=12, vocab=5)
    target = rng.dirichlet(np.ones(5), size=(8, 12))
    draft = plugins.child_draft_probs(
        parents=parents,
        draft_tokens=tokens,
        parent_probs=rng.dirichlet(np.ones(5), size=(8, 12)),
        process="iid",
    )
    uniforms = rng.random((8, 12))
    past = np.zeros(8, dtype=np.int64)
    first = tree_accept_sampling(parents, tokens, past, target, draft, uniforms, 11)
    second = tree_accept_sampling(parents, tokens, past, target, draft, uniforms, 11)
    for name in ("accepted_path", "accept_length", "bonus_token", "kv_keep"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert (first.accept_length > 1).any() and (first.accept_length == 1).any()


def test_child_draft_probs_per_process():
    parents = np.array([[-1, 0, 0, 1]])
    tokens = np.array([[0, 2, 1, 3]])
    q = np.tile(np.array([0.1, 0.2, 0.3, 0.4]), (1, 4, 1))
    iid = plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=q, process="iid")
    np.testing.assert_allclose(iid[0, 1:], q[0, 1:])
    np.testing.assert_array_equal(iid[0, 0], 0)
    wor = plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=q, process="without_replacement")
    np.testing.assert_allclose(wor[0, 2], [0.1 / 0.7, 0.2 / 0.7, 0, 0.4 / 0.7])  # sibling 1 took token 2
    np.testing.assert_allclose(wor[0, 3], q[0, 1])  # first child of node 1
    det = plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=q, process="deterministic")
    np.testing.assert_array_equal(det[0, 1:], one_hot([2, 1, 3], 4))
    with pytest.raises(ValueError, match="process must be one of"):
        plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=q, process="topk")


def test_api_returns_torch_for_torch_inputs():
    parents = torch.from_numpy(PARENTS)
    tree = plugins.tree_attention_mask(parents, torch.tensor([5]))
    assert isinstance(tree.mask, torch.Tensor) and tree.mask.dtype == torch.bool
    assert tree.position_ids.tolist() == [[5, 6, 6, 7, 7, 7, 5]]
    result = plugins.tree_accept_greedy(
        parents=parents,
        draft_tokens=torch.from_numpy(TOKENS),
        past_lengths=torch.tensor([5]),
        target_tokens=torch.tensor([[2, 7, 5, 8, 8, 6, 0]]),
        max_depth=3,
    )
    assert isinstance(result.accepted_path, torch.Tensor)
    assert result.accepted_path.tolist() == [[0, 2, 5, -1]] and result.bonus_token.tolist() == [6]


def test_schemas_match_the_reference_signatures():
    import yaml

    root = Path(plugins.__file__).resolve().parent
    mask = yaml.safe_load((root / "tree_attention_mask" / "schema.yaml").read_text())
    assert list(mask["inputs"]) == ["parents", "past_lengths"]
    assert list(mask["outputs"]) == ["mask", "position_ids", "packed_mask"]
    accept = {op["name"]: op for op in yaml.safe_load((root / "tree_accept" / "schema.yaml").read_text())["ops"]}
    greedy_args = list(inspect.signature(tree_accept_greedy).parameters)
    sampling_args = list(inspect.signature(tree_accept_sampling).parameters)
    assert [*accept["TreeAccept"]["inputs"], *accept["TreeAccept"]["attributes"]] == greedy_args
    assert [*accept["TreeAcceptSampling"]["inputs"], *accept["TreeAcceptSampling"]["attributes"]] == sampling_args
    for op in accept.values():
        assert list(op["outputs"]) == [f.name for f in dataclasses.fields(plugins.TreeAcceptResult)]
