"""Draft trees inside the batched engine (runtime/tree_batch.py, tree_step.py): per-depth batched
expansion equals the one-request best-first builder, one head call per depth whatever the batch,
Algorithm 1 over all requests' nodes, the committed KV equals a fresh prefill of the kept tokens,
greedy output equals the target's with requests arriving mid-flight (PyTorch: every kv mode; ONNX
Runtime: fused, static, concat), and sampling follows the target's law (a chi-square with a
control that fails)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import golden_path
from sampling_law import PROMPT, VOCAB, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair
from tokenizers import Tokenizer

from dspark.export import contract as C
from dspark.models import load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig, SchedulerConfigError, admit_by_throughput
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.torch_backend import TorchBackend
from dspark.runtime.tree_batch import TreeOptions, grow_trees
from dspark.runtime.tree_builder import build_tree
from dspark.runtime.tree_decoder import tree_generate

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = Path(str(resources.files("dspark.models") / "demo"))
# a step cost under which Algorithm 1 admits a few nodes per request on the demo pair and refuses the rest
COST = StepCostModel(intercept=2e-3, per_request=2e-4, per_token=1e-4)
TEXTS = ["def parse_args(", "    for line in lines:\n        if ", "import os\nimport sys\n\n",
         "class Queue:\n    def __init__(self", "        if self.break_long_words:", "    return ''.join("]


@pytest.fixture(scope="module")
def demo():
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    tokenizer = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    return target, drafter, [tokenizer.encode(t).ids for t in TEXTS]


def tree_engine(backend, info, *, mode="dspark", kv_mode="concat", slots=3, nodes=8, top_k=3) -> BatchEngine:
    return BatchEngine(backend, info, capacity=Capacity(slots, slots * 200, 200), kv_mode=kv_mode, cost_model=COST,
                       scheduler=SchedulerConfig(mode, drafting="tree", tree_nodes=nodes, tree_top_k=top_k))


def run_mid_flight(engine: BatchEngine, prompts, budgets) -> dict[int, list[int]]:
    ids = {}
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        ids[engine.submit(prompt, max_new_tokens=budget)] = i
        engine.step()  # a request joins every step while the others are mid-flight
    finished = engine.run_until_done()
    return {i: finished[r].tokens for r, i in ids.items()}


@pytest.mark.parametrize("pair", ["demo", "gated-rnn"])  # the RNN head carries a state along each path
def test_per_depth_trees_equal_the_best_first_builder_and_take_one_head_call_per_depth(demo, pair):
    if pair == "demo":
        target, drafter, _ = demo
    else:
        target, drafter = load_pair(golden_path("qwen3-tiny-gated-rnn", "target"),
                                    golden_path("qwen3-tiny-gated-rnn", "drafter_rnn"))
    backend = TorchBackend(target, drafter).open()
    info = ModelInfo.from_models(target, drafter)
    rows, rng = 6, np.random.default_rng(0)
    hidden = (rng.standard_normal((rows, info.block_size, drafter.config.hidden_size)) * 0.5).astype(np.float32)
    with torch.no_grad():
        base = drafter.base_logits(torch.from_numpy(hidden)).numpy()
    anchors = rng.integers(0, info.vocab_size, rows)
    calls = backend.times.count(C.HEAD_STEP)
    grown = grow_trees(lambda feeds: backend.run(C.HEAD_STEP, feeds), hidden, base, anchors,
                       TreeOptions(max_nodes=10, top_k=3), feed_base_logits=True, state_size=info.head_state_size)
    assert backend.times.count(C.HEAD_STEP) - calls == grown.head_calls <= info.block_size
    assert grown.expanded[0] == rows  # the first call expanded every request's root at once
    for r in range(rows):
        one = build_tree(drafter, torch.from_numpy(hidden[r]), int(anchors[r]), num_nodes=10, top_k=3)
        tree = grown.trees[r]
        assert (tree.parents, tree.tokens, tree.depths) == (one.parents, one.tokens, one.depths), f"request {r}"
        assert tree.scores == pytest.approx(one.scores, rel=1e-4)  # batched vs one-row float32 head


def test_algorithm_1_admits_nodes_across_requests(demo):
    """With a cost model the node budgets are Algorithm 1's over every request's best-first nodes:
    recomputed from the trees' own scores, and they differ between requests."""
    target, drafter, prompts = demo
    backend = TorchBackend(target, drafter)
    engine = tree_engine(backend, ModelInfo.from_models(target, drafter), slots=6, nodes=12)
    for p in prompts:
        engine.submit(p, max_new_tokens=6)
    record = engine.step()
    trees = engine.trees.last.trees
    scores = [t.scores[1:] for t in trees]
    lengths = [len(s) for s in scores]
    # every tree is a prefix of its request's ranking: Algorithm 1 stopped at one score for all
    decision = admit_by_throughput(scores, lambda tau, b: tau / COST.seconds(len(trees), b))
    assert list(decision.lengths) == lengths
    assert len(set(lengths)) > 1 and 0 < max(lengths) < 12
    assert record.expected_accepts == pytest.approx(len(trees) + sum(sum(s) for s in scores))


@pytest.mark.parametrize("kv_mode", ["concat", "static"])
def test_greedy_equals_the_target_with_requests_arriving_mid_flight(demo, kv_mode):
    target, drafter, prompts = demo
    budgets = [24, 17, 30, 12, 21, 26]
    engine = tree_engine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), kv_mode=kv_mode)
    out = run_mid_flight(engine, prompts, budgets)
    for i, prompt in enumerate(prompts):
        assert out[i] == autoregressive_generate(target, prompt, max_new_tokens=budgets[i]), f"prompt {i}"
    accepted = [n for s in engine.stats.steps for n in s.acceptance_lengths]
    assert max(accepted) > 2  # trees were accepted beyond one draft
    assert engine.trees.verifier.graph == (C.TARGET_STATIC if kv_mode == "static" else C.TARGET)


def test_rounds_equal_the_one_request_tree_decoder(demo):
    """Six requests batched, fixed 10-node trees: each request's tokens and per-round acceptance
    lengths are `tree_decoder.tree_generate`'s, one request at a time (same trees, same accepted
    paths, the drafter fed the same context)."""
    target, drafter, prompts = demo
    engine = tree_engine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), mode="fixed",
                         slots=6, nodes=10, top_k=3)
    ids = [engine.submit(p, max_new_tokens=30) for p in prompts]
    finished = engine.run_until_done()
    for i, prompt in zip(ids, prompts, strict=True):
        one = tree_generate(target, drafter, prompt, max_new_tokens=30, num_nodes=10, top_k=3)
        assert finished[i].acceptance_lengths == [r.acceptance_length for r in one.rounds]
        assert finished[i].tokens == one.tokens[:30]


def test_a_drafter_without_heads_grows_trees_from_its_base_logits():
    """DFlash (no sequential head): children come from the block's per-slot logits; still lossless."""
    target, drafter = load_pair(golden_path("dflash-tiny", "target"), golden_path("dflash-tiny", "drafter"))
    info = ModelInfo.from_models(target, drafter)
    assert not info.has_heads
    engine = tree_engine(TorchBackend(target, drafter), info, mode="fixed", nodes=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 21, 8, 40)]
    out = run_mid_flight(engine, prompts, [20] * 4)
    for i, prompt in enumerate(prompts):
        assert out[i] == autoregressive_generate(target, prompt, max_new_tokens=20), f"prompt {i}"
    assert max(n for s in engine.stats.steps for n in s.acceptance_lengths) > 2


def test_committed_kv_is_the_accepted_path_compacted(demo):
    """After tree steps, each row's committed keys/values equal the target's own prefill of
    prompt + committed tokens (rejected siblings were never counted, the path sits in order)."""
    target, drafter, prompts = demo
    engine = tree_engine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), mode="fixed",
                         nodes=10)
    for p in prompts[:3]:
        engine.submit(p, max_new_tokens=40)
    for _ in range(4):
        engine.step()
    assert max(n for s in engine.stats.steps for n in s.acceptance_lengths) > 2
    for row, a in enumerate(engine.active):
        kept = a.result.prompt_ids + a.result.tokens[:-1]  # the anchor is not in the cache yet
        assert int(engine.target_kv.lengths[row]) == len(kept) == a.start
        with torch.no_grad():
            present = target(torch.tensor([kept]), torch.arange(len(kept))[None]).present
        for layer, (k, v) in enumerate(present):
            np.testing.assert_allclose(engine.target_kv.keys[layer][row, :, : len(kept)], k[0].numpy(), atol=2e-5)
            np.testing.assert_allclose(engine.target_kv.values[layer][row, :, : len(kept)], v[0].numpy(), atol=2e-5)


def test_tree_drafting_refuses_what_it_cannot_run(demo):
    target, drafter, _ = demo
    with pytest.raises(SchedulerConfigError, match="tree drafting runs with mode"):
        SchedulerConfig("threshold", drafting="tree")
    with pytest.raises(SchedulerConfigError, match="drafting 'trees' is unknown"):
        SchedulerConfig("dspark", drafting="trees")
    with pytest.raises(ValueError, match="needs a step cost model"):
        BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                    capacity=Capacity(1, 200, 200), scheduler=SchedulerConfig("dspark", drafting="tree"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from dspark.export.pipeline import export_pair
    from dspark.runtime.ort_backend import OrtBackend

    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path("qwen3-tiny-vanilla", "target"), golden_path("qwen3-tiny-vanilla", "drafter"), out,
                check=False)
    return OrtBackend(out, intra_op_threads=1)


@pytest.mark.parametrize("kv_mode", ["fused", "static", "concat"])
def test_ort_greedy_equals_the_target(exported, kv_mode):
    target, _ = load_pair(golden_path("qwen3-tiny-vanilla", "target"), golden_path("qwen3-tiny-vanilla", "drafter"))
    engine = tree_engine(exported, ModelInfo.from_manifest(exported.manifest), mode="fixed", kv_mode=kv_mode, slots=2,
                         nodes=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 21, 8, 40)]
    out = run_mid_flight(engine, prompts, [24] * 4)
    for i, prompt in enumerate(prompts):
        assert out[i] == autoregressive_generate(target, prompt, max_new_tokens=24), f"prompt {i}"
    assert engine.kv_mode == kv_mode and engine.trees.verifier.graph in (C.TARGET, C.TARGET_STATIC)


def test_sampling_follows_the_target_law():
    """(t2, t3) of 3-token requests at T = 1 on the peaked 8-token pair, trees of 4 nodes, 2 children
    per node: against the exact law (pooled chi-square), and against the law at T = 0.7 (must fail)."""
    target, drafter = small_pair()
    engine = tree_engine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), mode="fixed",
                         slots=128, nodes=4, top_k=2)
    ids = [engine.submit(PROMPT, max_new_tokens=3, temperature=1.0, seed=s) for s in range(1500)]
    greedy = engine.submit(PROMPT, max_new_tokens=6)  # a greedy row among sampling rows: its own rule
    finished = engine.run_until_done()
    assert finished[greedy].tokens == autoregressive_generate(target, PROMPT, max_new_tokens=6)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in ids:
        counts[finished[i].tokens[1], finished[i].tokens[2]] += 1
    accepted = [n for s in engine.stats.steps for n in s.acceptance_lengths]
    assert max(accepted) > 2 and max(s.lengths[0] for s in engine.stats.steps) == 4  # deep tree nodes accepted
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(target, 1.0)) > 1e-3
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(target, 0.7)) < 1e-6  # the test can tell
