"""The fused ORT target flavour (`export/fused_target.py`) against the PyTorch TargetModel.

Every case drives the graph the way the runtime should (`SharedKVRunner`: one K/V buffer per layer
bound as past and present) and compares each row with a full, cache-free forward of that row's
whole token sequence: prefill (batch 1 and 2 rows of different lengths), one-token decode and
k-token verification (k = 2..8) on pasts of different lengths per row, with rollback of rejected
tokens and a right-padded row. Tolerance atol = rtol = 1e-4 (float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import golden_path, random_pair, tiny_target_config
from safetensors.torch import load_file

from dspark.export import contract as C
from dspark.export import feeds as F
from dspark.export.fused_parity import SharedKVRunner, causal_slots, tree_slots
from dspark.export.fused_target import build_fused_target, export_fused_target
from dspark.export.lower import ExportError, lower
from dspark.export.target_graph import TargetGraph
from dspark.models import DrafterConfig, TargetModel

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
ATOL = 1e-4
GOLDEN_PROMPT = [67, 24, 319, 84, 473, 74, 431, 279, 434, 430, 368, 165, 406, 119, 397, 251, 84, 194, 157, 1, 37,
                 245, 202, 432]


def _session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


class Fused:
    def __init__(self, model: TargetModel, tree: bool = False) -> None:
        self.model = model
        self.spec = C.target_fused_spec(model.config, len(model.context_layer_ids) * model.config.hidden_size,
                                        "float32", tree=tree)
        self.session = _session(build_fused_target(model, tree=tree).SerializeToString())

    def runner(self, batch: int, capacity: int) -> SharedKVRunner:
        return SharedKVRunner(self.session, self.spec, batch, capacity)


def _load(target_dir: Path, drafter_dir: Path, tree: bool = False) -> Fused:
    ids = DrafterConfig.from_folder(drafter_dir).target_layer_ids
    return Fused(TargetModel.from_pretrained(target_dir, ids), tree)


def _pair_dirs(name: str) -> tuple[Path, Path]:
    if name == "golden":
        root = golden_path("qwen3-tiny-vanilla")
        return root / "target", root / "drafter"
    return DEMO / "target", DEMO / "dspark"


@pytest.fixture(scope="module", params=["golden", "demo"])
def fused(request) -> Fused:
    return _load(*_pair_dirs(request.param))


@pytest.fixture(scope="module", params=["golden", "demo"])
def fused_tree(request) -> Fused:
    return _load(*_pair_dirs(request.param), tree=True)


def _reference(model: TargetModel, tokens: list[int]):
    """Cache-free forward of one row: logits [T, V], features [T, F], present per layer (k, v) [kvh, T, hd]."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), torch.arange(len(tokens))[None])
    return out.logits[0].numpy(), out.context_features[0].numpy(), [(k[0].numpy(), v[0].numpy())
                                                                    for k, v in out.present]


def _check_rows(fused: Fused, runner: SharedKVRunner, rows: list[list[int]], new: list[list[int]],
                logits: np.ndarray, features: np.ndarray, worst: dict) -> None:
    """Row b had `rows[b]` committed and ran `new[b]` (its real tokens; the rest is padding).
    `worst` collects the largest |diff| per output; every element must pass atol = rtol = 1e-4 (the
    golden README's tolerance: the demo's layer outputs reach |150|, where float32 rounding alone is
    ~1e-5 and the plain traced graph differs from PyTorch by up to 6.5e-5)."""
    for b, (past, ran) in enumerate(zip(rows, new, strict=True)):
        ref_logits, ref_features, present = _reference(fused.model, past + ran)
        n, total = len(ran), len(past) + len(ran)
        pairs = [("logits", logits[b, :n], ref_logits[-n:]), ("features", features[b, :n], ref_features[-n:])]
        pairs += [("kv", runner.kv[2 * i + j][b, :, :total], ref) for i, kv in enumerate(present)
                  for j, ref in enumerate(kv)]
        for name, got, ref in pairs:
            worst[name] = max(worst[name], float(np.abs(got - ref).max()))
            np.testing.assert_allclose(got, ref, atol=ATOL, rtol=ATOL, err_msg=f"{name} of row {b}")


def test_prefill_batch_1_and_2(fused):
    g = np.random.default_rng(0)
    vocab = fused.model.config.vocab_size
    worst = dict.fromkeys(("logits", "features", "kv"), 0.0)
    one = fused.runner(1, 64)
    prompt = g.integers(0, vocab, 24).tolist()
    logits, features = one.step([prompt], [0])
    _check_rows(fused, one, [[]], [prompt], logits, features, worst)

    two = fused.runner(2, 64)
    prompts = [g.integers(0, vocab, 24).tolist(), g.integers(0, vocab, 13).tolist()]
    ids = np.zeros((2, 24), np.int64)
    ids[0], ids[1, :13] = prompts[0], prompts[1]  # row 1 right-padded with token 0
    logits, features = two.step(ids, [0, 0])
    _check_rows(fused, two, [[], []], prompts, logits, features, worst)
    print(f"\nprefill max |diff| {worst}")


def test_decode_and_verify_with_rollback(fused):
    """Rows at different pasts: one-token decode, then k = 2..8 verification steps that accept a
    random prefix (rollback = shorter past next step); row 1 is right-padded by 2 tokens in each."""
    g = np.random.default_rng(1)
    vocab = fused.model.config.vocab_size
    runner = fused.runner(2, 96)
    rows = [g.integers(0, vocab, 21).tolist(), g.integers(0, vocab, 9).tolist()]
    ids = np.zeros((2, 21), np.int64)
    ids[0], ids[1, :9] = rows[0], rows[1]
    runner.step(ids, [0, 0])
    worst = dict.fromkeys(("logits", "features", "kv"), 0.0)

    new = [[int(g.integers(vocab))] for _ in rows]
    logits, features = runner.step(np.array(new), [len(r) for r in rows])
    _check_rows(fused, runner, rows, new, logits, features, worst)
    rows = [r + n for r, n in zip(rows, new, strict=True)]

    for k in range(2, 9):
        ids = g.integers(0, vocab, (2, k))
        real = [ids[0].tolist(), ids[1, : max(1, k - 2)].tolist()]
        logits, features = runner.step(ids, [len(r) for r in rows])
        _check_rows(fused, runner, rows, real, logits, features, worst)
        rows = [r + ran[: int(g.integers(0, len(ran) + 1))] for r, ran in zip(rows, real, strict=True)]
    print(f"\ndecode + verify k=2..8 max |diff| {worst}, final pasts {[len(r) for r in rows]}")


def test_tree_verification_and_compaction(fused_tree):
    """Rows at pasts 19 and 8 verify flattened random trees (row 1 right-padded); each node's logits
    equal those of its root-to-node path; after moving an accepted path's K/V slots down, a chain
    step on top matches a full recompute."""
    fused, g = fused_tree, np.random.default_rng(4)
    model, vocab = fused.model, fused.model.config.vocab_size
    runner = fused.runner(2, 64)
    rows = [g.integers(0, vocab, 19).tolist(), g.integers(0, vocab, 8).tolist()]
    ids = np.zeros((2, 19), np.int64)
    ids[0], ids[1, :8] = rows[0], rows[1]
    runner.step(ids, [0, 0], *causal_slots([0, 0], 19))

    torch_g = torch.Generator().manual_seed(5)
    nodes, real = 7, (7, 5)
    parents = [F.random_parents(n, torch_g) for n in real]
    tree_ids = g.integers(0, vocab, (2, nodes))
    pasts = [len(r) for r in rows]
    positions = np.zeros((2, nodes), np.int64)
    mask = np.zeros((2, 1, nodes, max(pasts) + nodes), bool)
    for b, (p, par) in enumerate(zip(pasts, parents, strict=True)):  # feeds.py's tree rows, causal padding
        positions[b] = np.arange(p, p + nodes)
        positions[b, : len(par)] = F.tree_positions(par, p)[0].numpy()
        mask[b, 0, :, : p + nodes] = np.tril(np.ones((nodes, p + nodes), bool), k=p)
        mask[b, 0, : len(par), : p + len(par)] = F.tree_mask(par, p)[0, 0].numpy()
    slots = tree_slots(parents, pasts, nodes)
    np.testing.assert_array_equal(slots[0], positions)
    np.testing.assert_array_equal(slots[1], mask)
    logits, features = runner.step(tree_ids, pasts, positions, mask)
    worst = 0.0
    paths = []
    for b, par in enumerate(parents):
        for t in range(len(par)):
            path = _path(par, t)
            ref_logits, ref_features, _ = _reference(model, rows[b] + tree_ids[b, path].tolist())
            np.testing.assert_allclose(logits[b, t], ref_logits[-1], atol=ATOL, rtol=ATOL)
            np.testing.assert_allclose(features[b, t], ref_features[-1], atol=ATOL, rtol=ATOL)
            worst = max(worst, float(np.abs(logits[b, t] - ref_logits[-1]).max()))
        paths.append(max((_path(par, t) for t in range(len(par))), key=len))

    for b, path in enumerate(paths):  # accept the deepest path: move its slots down
        for kv in runner.kv:
            kv[b, :, pasts[b]: pasts[b] + len(path)] = kv[b][:, [pasts[b] + n for n in path]]
        rows[b] = rows[b] + tree_ids[b, path].tolist()
    new = g.integers(0, vocab, (2, 2))
    pasts = [len(r) for r in rows]
    logits, _ = runner.step(new, pasts, *causal_slots(pasts, 2))
    for b in range(2):
        ref_logits, _, _ = _reference(model, rows[b] + new[b].tolist())
        np.testing.assert_allclose(logits[b], ref_logits[-2:], atol=ATOL, rtol=ATOL)
    print(f"\ntree nodes max |diff| {worst:.2e}, accepted paths {paths}")


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


def test_golden_prompt_matches_deepspec_tensors():
    root = golden_path("qwen3-tiny-vanilla")
    fused = _load(root / "target", root / "drafter")
    tensors = load_file(str(root / "tensors.safetensors"))
    assert tensors["prompt_ids"][0].tolist() == GOLDEN_PROMPT
    logits, features = fused.runner(1, 32).step([GOLDEN_PROMPT], [0])
    logit_diff = float(np.abs(logits[0] - tensors["target_logits"][0].numpy()).max())
    feature_diff = float(np.abs(features[0] - tensors["context_features"][0].numpy()).max())
    print(f"\ngolden prompt: logits max |diff| {logit_diff:.2e}, context_features {feature_diff:.2e}")
    assert logit_diff <= ATOL and feature_diff <= ATOL


def _optimized_nodes(path: Path, tmp: Path) -> int:
    import onnx

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp / f"{path.stem}.opt.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return len(onnx.load(options.optimized_model_filepath).graph.node)


def test_node_count_after_ort_optimizer(tmp_path):
    fused = _load(DEMO / "target", DEMO / "dspark")
    model, features = fused.model, fused.spec.outputs[1].dims[2]
    g = torch.Generator().manual_seed(0)
    lower(TargetGraph(model), F.target_feeds(model.config, F.Case(2, 3, 5), torch.float32, g),
          C.target_spec(model.config, features, "float32"), tmp_path, opset=17)
    (fused_path,) = export_fused_target(model, tmp_path)
    (tree_path,) = export_fused_target(model, tmp_path, tree=True)
    plain = _optimized_nodes(tmp_path / "target.onnx", tmp_path)
    fused_nodes, tree_nodes = _optimized_nodes(fused_path, tmp_path), _optimized_nodes(tree_path, tmp_path)
    print(f"\nnodes after ORT_ENABLE_ALL (demo target, 4 layers): plain target.onnx {plain}, "
          f"target_fused.onnx {fused_nodes}, target_fused_tree.onnx {tree_nodes}")
    # the tree graph: + the mask -> bias Where; the chain graph: + logits_rows' Unsqueeze and GatherND
    assert fused_nodes * 3 < plain and tree_nodes - 1 == fused_nodes - 2


def _random_target(seed: int, **overrides) -> TargetModel:
    torch.manual_seed(seed)
    model = TargetModel(tiny_target_config(head_dim=16, **overrides), (-1, 1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("overrides", [{}, {"model_type": "llama", "qk_norm": False, "attention_bias": True}],
                         ids=["qwen3", "llama-bias-packed-qkv"])
def test_random_architectures(overrides):
    """Llama (no q/k norm: packed QKV straight into GQA) with projection biases; layer id -1."""
    fused = Fused(_random_target(3, **overrides))
    g = np.random.default_rng(2)
    runner = fused.runner(2, 40)
    rows = [g.integers(0, 32, 11).tolist(), g.integers(0, 32, 6).tolist()]
    ids = np.zeros((2, 11), np.int64)
    ids[0], ids[1, :6] = rows[0], rows[1]
    worst = dict.fromkeys(("logits", "features", "kv"), 0.0)
    logits, features = runner.step(ids, [0, 0])
    _check_rows(fused, runner, [[], []], rows, logits, features, worst)
    new = g.integers(0, 32, (2, 4))
    logits, features = runner.step(new, [11, 6])
    _check_rows(fused, runner, rows, new.tolist(), logits, features, worst)


def test_unshared_feeding_concatenates():
    """Without IO binding the graph also runs: past [B, kvh, P, hd] in, present [B, kvh, P+T, hd] out."""
    fused = Fused(_random_target(4))
    model, c = fused.model, fused.model.config
    g = np.random.default_rng(3)
    tokens = g.integers(0, 32, (2, 9))
    feeds = {"input_ids": tokens[:, :6], "seqlens_k": np.array([5, 5], np.int32),
             "total_sequence_length": np.array(6, np.int32), "logits_rows": np.array([[5], [3]])}
    for name in C.kv_names("past_key_values", c.num_hidden_layers):
        feeds[name] = np.zeros((2, c.num_key_value_heads, 0, c.head_dim), np.float32)
    first = fused.session.run(None, feeds)
    feeds = {"input_ids": tokens[:, 6:], "seqlens_k": np.array([8, 8], np.int32),
             "total_sequence_length": np.array(9, np.int32), "logits_rows": np.tile(np.arange(3), (2, 1)),
             **dict(zip(C.kv_names("past_key_values", c.num_hidden_layers), first[3:], strict=True))}
    outs = fused.session.run(None, feeds)
    assert outs[3].shape == (2, c.num_key_value_heads, 9, c.head_dim)
    np.testing.assert_array_equal(outs[2], outs[0].argmax(-1))  # greedy_ids: the logits' first maximum
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens), torch.arange(9).expand(2, 9)).logits.numpy()
    assert np.abs(outs[0] - ref[:, 6:]).max() <= ATOL
    # logits_rows picks positions per row: logits [2, 1, V] at positions 5 and 3 of the first call
    assert first[0].shape == (2, 1, c.vocab_size) and first[2].shape == (2, 1)
    assert np.abs(first[0][:, 0] - ref[[0, 1], [5, 3]]).max() <= ATOL


def test_float16_runs_on_cpu():
    model = _random_target(5)
    spec = C.target_fused_spec(model.config, 2 * model.config.hidden_size, "float16")
    runner = SharedKVRunner(_session(build_fused_target(model.half().float(), "float16").SerializeToString()),
                            spec, 1, 16)
    tokens = list(range(1, 11))
    logits, _ = runner.step([tokens], [0])
    ref, _, _ = _reference(model, tokens)
    assert logits.dtype == np.float16
    assert np.abs(logits[0].astype(np.float32) - ref).max() < 2e-2


def test_external_data_and_refusals(tmp_path):
    model = _random_target(6)
    files = export_fused_target(model, tmp_path, external_data_threshold=1024)
    assert [f.name for f in files] == ["target_fused.onnx", "target_fused.onnx.data"]
    session = _session(str(files[0]))
    spec = C.target_fused_spec(model.config, 2 * model.config.hidden_size, "float32")
    logits, _ = SharedKVRunner(session, spec, 1, 8).step([[1, 2, 3]], [0])
    assert np.abs(logits[0] - _reference(model, [1, 2, 3])[0]).max() <= ATOL
    with pytest.raises(ValueError, match="exceed the capacity"):
        SharedKVRunner(session, spec, 1, 8).step([[1, 2, 3]], [6])
    with pytest.raises(ExportError, match="multiple of 16"):
        build_fused_target(TargetModel(tiny_target_config(head_dim=8)))
    with pytest.raises(ExportError, match="dtype"):
        build_fused_target(model, "int8")


def test_export_pair_fused_flavour(tmp_path):
    """export_pair(flavours=("plain", "fused", "packed")) adds target_fused.onnx, target_fused_tree.onnx,
    target_fused_packed.onnx, drafter_backbone_fused.onnx and drafter_draft_greedy_fused.onnx with their
    parity; the plain graphs each record flavour "plain" ("packed" alone, without "fused", is refused)."""
    from dspark.export.manifest import read_manifest
    from dspark.export.pipeline import export_pair

    root = golden_path("qwen3-tiny-vanilla")
    manifest = export_pair(root / "target", root / "drafter", tmp_path, flavours=("plain", "fused", "packed"))
    assert read_manifest(tmp_path, verify="sha256")["graphs"]["target_fused"]["flavour"] == "fused"
    flavours = {name: entry["flavour"] for name, entry in manifest["graphs"].items()}
    assert flavours.pop("target_fused") == flavours.pop("target_fused_tree") == "fused"
    assert flavours.pop("target_fused_packed") == "fused"
    assert flavours.pop("drafter_backbone_fused") == flavours.pop("drafter_draft_greedy_fused") == "fused"
    assert set(flavours.values()) == {"plain"}
    assert manifest["dropped_graphs"] == {} and manifest["flavours"] == ["plain", "fused", "packed"]
    for name in ("target_fused", "target_fused_tree", "target_fused_packed", "drafter_backbone_fused",
                 "drafter_draft_greedy_fused"):
        parity = manifest["parity"][name]
        print(f"\n{name} parity: {parity}")
        assert parity["passed"] and max(parity["max_abs_diff"].values()) <= ATOL
    assert any("tree" in case for case in manifest["parity"]["target_fused_tree"]["cases"])
    entry = manifest["graphs"]["target_fused"]
    assert [t["name"] for t in entry["inputs"][:3]] == ["input_ids", "seqlens_k", "total_sequence_length"]
    assert entry["inputs"][2] == {"name": "total_sequence_length", "dtype": "int32", "dims": []}
    with pytest.raises(ExportError, match="flavours"):
        export_pair(root / "target", root / "drafter", tmp_path / "x", flavours=("fused",))
    with pytest.raises(ExportError, match="needs 'fused'"):
        export_pair(root / "target", root / "drafter", tmp_path / "y", flavours=("plain", "packed"))


def test_fused_graph_is_dropped_when_it_cannot_pass(tmp_path, monkeypatch):
    from dspark.export import pipeline

    graphs, parity, dropped = {}, {}, {}
    small, drafter = random_pair(0)  # head_dim 8: neither fused graph can hold it
    for graph in pipeline.fused_graphs(small, drafter, "float32", 17, tmp_path, 2**31 - 1):
        pipeline._export_fused(graph, True, graphs, parity, dropped)
    assert "multiple of 16" in dropped["target_fused"]["reason"] and not graphs and not list(tmp_path.iterdir())
    assert "multiple of 16" in dropped["drafter_backbone_fused"]["reason"]

    monkeypatch.setattr(pipeline, "fused_parity", lambda *a: {"max_abs_diff": {"logits": 1.0}, "passed": False})
    dropped.clear()
    _, drafter = random_pair(0, drafter_overrides={"head_dim": 16})
    target_graph = pipeline.fused_graphs(_random_target(7), drafter, "float32", 17, tmp_path, 2**31 - 1)[0]
    pipeline._export_fused(target_graph, True, graphs, parity, dropped)
    assert dropped["target_fused"]["reason"] == "parity against PyTorch failed"
    assert not graphs and not parity and not list(tmp_path.iterdir())


def test_the_tree_graph_is_not_built_packed():
    model = TargetModel(tiny_target_config(head_dim=16))
    with pytest.raises(ExportError, match="tree variant"):
        build_fused_target(model, tree=True, packed=True)
