"""Text in the Runtime: prompts and stop strings as text, TextResult beside the ids, the chat template, and
clear ArtifactErrors for a missing or broken tokenizer; the id API is unchanged."""

from __future__ import annotations

import json

import pytest
from test_serving_support import tiny_runtime

from dspark.export.artifacts import ArtifactError
from dspark.runtime.api import TextResult
from dspark.runtime.requests import RequestError
from dspark.runtime.stats import RequestResult
from dspark.runtime.text import StopWatch, TextCodec, TextStream

PROMPTS = ["def parse_args(", "The quick brown", "import os\n"]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with tiny_runtime(tmp_path_factory.mktemp("text"), scheduler="fixed") as rt:
        yield rt


def test_text_prompts_give_the_id_results_plus_text(runtime):
    by_text = runtime.generate(PROMPTS, max_new_tokens=12, temperature=0.8, seed=4)
    by_ids = runtime.generate([runtime.encode(p) for p in PROMPTS], max_new_tokens=12, temperature=0.8, seed=4)
    assert all(type(r) is RequestResult for r in by_ids)  # the id API returns what it always did
    for text_result, id_result in zip(by_text, by_ids, strict=True):
        assert isinstance(text_result, TextResult)
        assert text_result.tokens == id_result.tokens
        assert text_result.text == runtime.decode(id_result.tokens)


def test_stop_string_cuts_generate_and_stream_at_the_same_token(runtime):
    (full,) = runtime.generate(PROMPTS[0], max_new_tokens=24)
    for k in range(3, len(full.tokens)):  # a stop string that first appears with a later token
        stop = runtime.decode(full.tokens[:k])[-2:]
        if stop.strip("\ufffd") == stop and len(stop) == 2 and stop not in runtime.decode(full.tokens[: k - 1]):
            break
    else:
        pytest.fail("no usable stop string in this output")
    (cut,) = runtime.generate(PROMPTS[0], max_new_tokens=24, stop=[stop])
    assert cut.finish_reason == "stop" and cut.tokens == full.tokens[:k]
    assert cut.text == runtime.decode(full.tokens[:k])[:-2] and stop not in cut.text
    assert "".join(runtime.stream(PROMPTS[0], max_new_tokens=24, stop=[stop])) == cut.text
    assert "".join(runtime.stream(PROMPTS[0], max_new_tokens=24)) == full.text


def test_stream_of_ids_still_yields_token_lists(runtime):
    chunks = list(runtime.stream(runtime.encode(PROMPTS[1]), max_new_tokens=10))
    assert all(isinstance(c, list) for c in chunks)
    assert [t for c in chunks for t in c] == runtime.generate(runtime.encode(PROMPTS[1]), max_new_tokens=10)[0].tokens


def test_chat_renders_the_template(runtime):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    text = runtime.tokenizer.render_chat(messages)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    reply = runtime.chat(messages, max_new_tokens=6)
    assert reply.prompt_ids == runtime.tokenizer.encode(text, add_special_tokens=False)
    assert reply.tokens == runtime.generate(reply.prompt_ids, max_new_tokens=6)[0].tokens


@pytest.mark.parametrize(("messages", "message"), [
    ([], "non-empty list"), ("hi", "non-empty list"), ([{"role": "user"}], "content must be"),
    ([{"role": 3, "content": "x"}], "role must be"), ([{"role": "user", "content": "x", "tool_calls": []}],
                                                     "tool_calls is not supported"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "text only"),
])
def test_bad_chat_messages_are_request_errors(runtime, messages, message):
    with pytest.raises(RequestError, match=message):
        runtime.chat_prompt(messages)


def test_bad_text_requests_are_request_errors(runtime):
    with pytest.raises(RequestError, match="cannot be tokenized"):
        runtime.generate("\ud800", max_new_tokens=2)
    with pytest.raises(RequestError, match="stop strings must be non-empty"):
        runtime.generate("x", max_new_tokens=2, stop=[""])
    with pytest.raises(RequestError):
        runtime.generate([{"a": 1}], max_new_tokens=2, stop=["x"])


def test_chat_without_template_is_a_clear_request_error(tmp_path):
    with tiny_runtime(tmp_path, chat_template=None) as rt:
        assert rt.generate("x", max_new_tokens=2)[0].text is not None
        with pytest.raises(RequestError, match="no chat template"):
            rt.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_missing_and_broken_tokenizer_files_name_the_file(tmp_path):
    with tiny_runtime(tmp_path) as rt:
        folder = rt.text_dirs[0]
        (folder / "tokenizer.json").unlink()
        with pytest.raises(ArtifactError, match="tokenizer.json: is missing"):
            rt.generate("x", max_new_tokens=2)
        assert rt.generate([1, 2], max_new_tokens=2)[0].tokens  # ids need no tokenizer
        (folder / "tokenizer.json").write_text("{not json")
        with pytest.raises(ArtifactError, match="tokenizer.json: is not a readable tokenizer.json"):
            TextCodec.from_dir(folder)


def test_broken_tokenizer_config_and_oversized_vocabulary(tmp_path):
    with tiny_runtime(tmp_path) as rt:
        folder = rt.text_dirs[0]
        (folder / "tokenizer_config.json").write_text("[1, 2]")
        with pytest.raises(ArtifactError, match="tokenizer_config.json: holds a JSON list"):
            TextCodec.from_dir(folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
        with pytest.raises(ArtifactError, match="not a valid Jinja template"):
            TextCodec.from_dir(folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
        with pytest.raises(ArtifactError, match="must be a string"):
            TextCodec.from_dir(folder)
        (folder / "tokenizer_config.json").unlink()
        big = json.loads((folder / "tokenizer.json").read_text())
        big["model"]["vocab"].update({f"extra{i}": 1000 + i for i in range(5)})
        (folder / "tokenizer.json").write_text(json.dumps(big))
        with pytest.raises(ArtifactError, match="tokens but the model's vocabulary has 512"):
            rt.tokenizer  # noqa: B018


def test_text_stream_holds_back_partial_characters_and_stop_prefixes(runtime):
    codec = runtime.tokenizer
    ids = codec.encode("ab é ← done\n\nnext")
    stream = TextStream(codec, ["\n\n"])
    pieces = [stream.push([t]) for t in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert not any(p.endswith("\n") for p in pieces)  # "\n" could start the stop string: held back
    assert "".join(pieces) + stream.finish("ab é ← done") == "ab é ← done"
    watch = StopWatch(codec, ["\n\n"])
    cut = next(k for k in range(1, len(ids) + 1) if watch.check(ids[:k]) is not None)
    assert "\n\n" in codec.decode(ids[:cut]) and "\n\n" not in codec.decode(ids[: cut - 1])
    assert cut < len(ids) and StopWatch(codec, ["\n\n"]).check(ids) == cut  # all at once: the same token
