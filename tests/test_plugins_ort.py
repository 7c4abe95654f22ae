"""dspark-domain ONNX nodes executed by ONNX Runtime match the numpy references."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_plugins_reference import random_trees

from dspark.plugins import ort as dort
from dspark.plugins.tree_accept.reference import tree_accept_greedy, tree_accept_sampling
from dspark.plugins.tree_attention_mask.reference import tree_attention_mask

pytest.importorskip("onnxruntime_extensions", reason="the ORT route needs onnxruntime-extensions")

ACCEPT_OUTPUTS = [("path", TensorProto.INT64), ("length", TensorProto.INT64), ("bonus", TensorProto.INT64)]
ACCEPT_OUTPUTS.append(("kv_keep", TensorProto.INT64))


def graph_model(nodes: list[onnx.NodeProto], inputs: list[tuple[str, int, list]], outputs) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "dspark_plugins",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(name, dtype, None) for name, dtype in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17), dort.opset_import()])


def test_mask_and_greedy_accept_graph_matches_reference():
    nodes = [
        dort.make_node("TreeAttentionMask", ["parents", "past"], ["mask", "position_ids", "packed"], name="mask"),
        dort.make_node(
            "TreeAccept",
            ["parents", "tokens", "past", "targets"],
            [n for n, _ in ACCEPT_OUTPUTS],
            name="accept",
            max_depth=5,
        ),
    ]
    ints = [("parents", TensorProto.INT64, ["B", "N"]), ("tokens", TensorProto.INT64, ["B", "N"])]
    ints += [("past", TensorProto.INT64, ["B"]), ("targets", TensorProto.INT64, ["B", "N"])]
    outputs = [("mask", TensorProto.BOOL), ("position_ids", TensorProto.INT64), ("packed", TensorProto.INT32)]
    model = graph_model(nodes, ints, outputs + ACCEPT_OUTPUTS)
    assert {n.domain for n in model.graph.node} == {"dspark"}

    rng = np.random.default_rng(0)
    parents, tokens = random_trees(rng, batch=5, n=40, vocab=3)  # 40 nodes: two words, bit 31 used
    parents[0, 1:33] = np.arange(32)  # a chain through node 32 sets the sign bit of word 0
    parents[0, 33:] = -2
    past, targets = rng.integers(0, 50, size=5), rng.integers(3, size=(5, 40))
    got = dort.make_session(model).run(None, {"parents": parents, "tokens": tokens, "past": past, "targets": targets})

    want_mask = tree_attention_mask(parents, past)
    for g, w in zip(got[:3], want_mask, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    assert got[2][0, 32, 0] == -1
    want = tree_accept_greedy(parents, tokens, past, targets, max_depth=5)
    for g, w in zip(got[3:], (want.accepted_path, want.accept_length, want.bonus_token, want.kv_keep), strict=True):
        np.testing.assert_array_equal(g, w)


def test_sampling_accept_graph_matches_reference():
    node = dort.make_node(
        "TreeAcceptSampling",
        ["parents", "tokens", "past", "p", "q", "u"],
        [n for n, _ in ACCEPT_OUTPUTS],
        name="accept",
        max_depth=3,
    )
    inputs = [("parents", TensorProto.INT64, ["B", "N"]), ("tokens", TensorProto.INT64, ["B", "N"])]
    inputs += [("past", TensorProto.INT64, ["B"]), ("p", TensorProto.FLOAT, ["B", "N", "V"])]
    inputs += [("q", TensorProto.FLOAT, ["B", "N", "V"]), ("u", TensorProto.FLOAT, ["B", "N"])]
    model = graph_model([node], inputs, ACCEPT_OUTPUTS)
    rng = np.random.default_rng(1)
    parents, tokens = random_trees(rng, batch=16, n=12, vocab=5)
    feeds = {
        "parents": parents,
        "tokens": tokens,
        "past": rng.integers(0, 9, size=16),
        "p": rng.dirichlet(np.ones(5), size=(16, 12)).astype(np.float32),
        "q": rng.dirichlet(np.ones(5), size=(16, 12)).astype(np.float32),
        "u": rng.random((16, 12)).astype(np.float32),
    }
    got = dort.make_session(model).run(None, feeds)
    want = tree_accept_sampling(*feeds.values(), max_depth=3)
    for g, w in zip(got, (want.accepted_path, want.accept_length, want.bonus_token, want.kv_keep), strict=True):
        np.testing.assert_array_equal(g, w)


def test_invalid_tree_fails_the_session_run_with_the_reference_message():
    node = dort.make_node("TreeAttentionMask", ["parents", "past"], ["mask", "position_ids", "packed"], name="m")
    inputs = [("parents", TensorProto.INT64, ["B", "N"]), ("past", TensorProto.INT64, ["B"])]
    model = graph_model([node], inputs, [("mask", TensorProto.BOOL), ("position_ids", TensorProto.INT64)])
    model.graph.output.append(helper.make_tensor_value_info("packed", TensorProto.INT32, None))
    with pytest.raises(dort.PluginInputError, match=r"TreeAttentionMask: parents\[0, 1\] = 2: a node.s parent must be"):
        dort.make_session(model).run(None, {"parents": np.array([[-1, 2, 0]]), "past": np.array([0])})


def test_exported_graph_keeps_the_dspark_domain_and_plain_ort_refuses_it():
    node = dort.make_node("TreeAttentionMask", ["parents", "past"], ["mask", "position_ids", "packed"], name="m")
    inputs = [("parents", TensorProto.INT64, ["B", "N"]), ("past", TensorProto.INT64, ["B"])]
    model = graph_model([node], inputs, [("mask", TensorProto.BOOL), ("position_ids", TensorProto.INT64)])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"plugin_namespace": b"dspark"}
    prepared = dort.prepare_for_ort(model)
    assert model.graph.node[0].domain == "dspark" and prepared.graph.node[0].domain == dort.ORT_PYOP_DOMAIN
    with pytest.raises(Exception, match="dspark"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_rejected_accept_inputs_raise_and_leave_sentinels_for_raw_sessions():
    node = dort.make_node(
        "TreeAccept",
        ["parents", "tokens", "past", "targets"],
        [n for n, _ in ACCEPT_OUTPUTS],
        name="a",
        max_depth=2,
    )
    inputs = [(name, TensorProto.INT64, None) for name in ("parents", "tokens", "past", "targets")]
    model = graph_model([node], inputs, ACCEPT_OUTPUTS)
    feeds = {"parents": np.array([[-1, 0]]), "tokens": np.array([[0, 1]]), "past": np.array([0])}
    feeds["targets"] = np.array([[1, 1, 1]])  # one column too many
    with pytest.raises(dort.PluginInputError, match=r"TreeAccept: target_tokens must have the shape of parents"):
        dort.make_session(model).run(None, feeds)
    raw = ort.InferenceSession(
        dort.prepare_for_ort(model).SerializeToString(),
        dort.session_options(),
        providers=["CPUExecutionProvider"],
    )
    path, length, bonus, kv_keep = raw.run(None, feeds)
    np.testing.assert_array_equal(path, [[-1, -1, -1]])
    np.testing.assert_array_equal(length, [0])
    np.testing.assert_array_equal(bonus, [-1])
    np.testing.assert_array_equal(kv_keep, [[-1, -1, -1]])
