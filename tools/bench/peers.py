"""What users would otherwise run on the same target checkpoint, one request at a time.

- Hugging Face transformers `generate`: greedy, and prompt-lookup decoding
  (`prompt_lookup_num_tokens`, n-gram drafts copied from the prompt and the output so far).
- onnxruntime-genai: the model builder's ONNX export of the Hugging Face folder, its plain
  greedy loop, and its built-in n-gram speculation (`GeneratorParams.set_speculative_options`).
  The builder invents eos/pad ids when the checkpoint has none; the bench overwrites them in
  genai_config.json (eos = the shared stop token, pad = -1). Its fused attention refuses
  batched multi-token steps with a past, so it is a batch-1 peer here.
- onnxruntime-genai draft-model speculation: its `model.type: "speculative"` pairs the target's
  export with an autoregressive draft model's export (`model.draft` in genai_config.json, the
  draft's own decoder section; both builds fp32 CPU, same session options, same vocabulary) and
  drafts `speculative.max_draft_tokens` tokens per round, batch 1, greedy-verified. The draft
  model is `dspark train draft-model`'s 1-2 layer Qwen3 on the target's tokenizer and corpus; the
  generator's own speculative statistics (rounds, drafted and accepted tokens) go into the row.

A peer whose package is missing, or whose model cannot be built, raises PeerUnavailable with
the reason; the bench reports it and goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dspark.tools.demo_engine import checkpoint_key

from .timeline import System, Timeline

INSTALL_HINT = "pip install 'dspark[bench]'"


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why and how to get it, `system` which peer."""

    def __init__(self, message: str, system: str | None = None) -> None:
        super().__init__(message)
        self.system = system


def transformers_systems(target_dir: Path, *, stop: int, threads: int, lookup_tokens: int = 4) -> list[System]:
    try:
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
    except ImportError as exc:
        raise PeerUnavailable(f"skipped: {INSTALL_HINT} (transformers: {exc})") from exc

    class TimelineStreamer(BaseStreamer):
        """Records every chunk `generate` emits; the first `put` is the prompt itself."""

        def __init__(self, timeline: Timeline) -> None:
            self.timeline, self.prompt_seen = timeline, False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:
                self.timeline.deliver(value.flatten().tolist())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise PeerUnavailable(f"failed: transformers cannot load {target_dir}: {exc}") from exc

    def runner(**extra: int):
        def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
            ids = torch.tensor([prompt])
            timeline = Timeline()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=stop, pad_token_id=stop,
                               streamer=TimelineStreamer(timeline), **extra)
            return timeline

        return generate

    version = f"transformers {transformers.__version__}"
    return [
        System("HF transformers greedy", version, runner()),
        System(f"HF transformers prompt lookup (k={lookup_tokens})", version,
               runner(prompt_lookup_num_tokens=lookup_tokens)),
    ]


def build_genai_model(target_dir: Path, cache: Path, *, stop: int, threads: int, precision: str = "fp32") -> Path:
    """The model builder's CPU export of the target (fp32, or int4: its MatMulNBits model), cached;
    genai_config.json patched."""
    out = cache / f"ortgenai-{checkpoint_key(target_dir)}{'' if precision == 'fp32' else f'-{precision}'}"
    config_path = out / "genai_config.json"
    if not config_path.is_file():
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(target_dir),
                   "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache / "ortgenai-builder-cache")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not config_path.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PeerUnavailable(f"failed: onnxruntime-genai model builder ({' '.join(command)}): {tail}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["model"]["eos_token_id"] = stop
    config["model"]["pad_token_id"] = -1
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    return out


def _genai_greedy(og: ModuleType, model: Any, prompt: list[int], max_new_tokens: int,
                  speculative: dict[str, int] | None = None) -> tuple[Timeline, Any]:
    """One greedy generation through onnxruntime-genai's loop, each token timed as it arrives;
    returns the timeline and the generator (whose speculative statistics a caller may read)."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_new_tokens)
    if speculative:
        params.set_speculative_options(**speculative)
    timeline = Timeline()
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
        timeline.deliver([int(generator.get_next_tokens()[0])])
    return timeline, generator


def genai_systems(target_dir: Path, cache: Path, *, stop: int, threads: int, ngram_size: int = 3,
                  draft_tokens: int = 4) -> list[System]:
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise PeerUnavailable(f"skipped: {INSTALL_HINT} (onnxruntime-genai: {exc})") from exc
    model = og.Model(str(build_genai_model(target_dir, cache, stop=stop, threads=threads)))

    def runner(speculative: dict[str, int] | None):
        def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
            return _genai_greedy(og, model, prompt, max_new_tokens, speculative)[0]

        return generate

    version = f"onnxruntime-genai {og.__version__}"
    ngram = runner({"ngram_size": ngram_size, "max_draft_tokens": draft_tokens})
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        def ngram(prompt: list[int], max_new_tokens: int) -> Timeline:
            raise PeerUnavailable(f"skipped: {version} has no GeneratorParams.set_speculative_options")

    return [System("onnxruntime-genai greedy", version, runner(None)),
            System(f"onnxruntime-genai n-gram (n={ngram_size}, k={draft_tokens})", version, ngram)]


def genai_int4_greedy(target_dir: Path, cache: Path, *, threads: int) -> System:
    """onnxruntime-genai greedy on its model builder's int4 model of the target (MatMulNBits at its CPU
    default, int8 activations), never stopping early: a peer for the quantized engines."""
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise PeerUnavailable(f"skipped: {INSTALL_HINT} (onnxruntime-genai: {exc})") from exc
    eos = json.loads((target_dir / "config.json").read_text(encoding="utf-8")).get("eos_token_id") or 0
    eos = eos[0] if isinstance(eos, list) else eos
    model = og.Model(str(build_genai_model(target_dir, cache, stop=eos, threads=threads, precision="int4")))

    def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
        params = og.GeneratorParams(model)
        length = len(prompt) + max_new_tokens  # min_length: eos does not end it early (as the engines run)
        params.set_search_options(do_sample=False, max_length=length, min_length=length)
        timeline, generator = Timeline(), og.Generator(model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
            timeline.deliver([int(generator.get_next_tokens()[0])])
        return timeline

    return System("onnxruntime-genai int4 greedy", f"onnxruntime-genai {og.__version__}", generate)


DRAFT_STATS = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "tokens_emitted", "target_forward_passes",
               "total_draft_ms", "total_target_ms")


def draft_model_name(draft_tokens: int) -> str:
    return f"onnxruntime-genai draft model (k={draft_tokens})"


def speculative_overlay(target_build: Path, draft_build: Path, draft_tokens: int) -> dict:
    """The genai_config.json overlay that turns the target's build into draft-model speculation:
    the draft build's decoder section as `model.draft`, its file named relative to the target's
    folder (onnxruntime-genai joins it to the config's folder)."""
    draft = json.loads((draft_build / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
    draft["filename"] = os.path.relpath(draft_build / draft["filename"], target_build)
    return {"model": {"type": "speculative", "draft": draft}, "speculative": {"max_draft_tokens": draft_tokens}}


def genai_draft_systems(target_dir: Path, draft_dir: Path | None, cache: Path, *, stop: int, threads: int,
                        draft_tokens: int = 4) -> list[System]:
    """onnxruntime-genai's draft-model speculative decoding of `target_dir` with `draft_dir`."""
    name = draft_model_name(draft_tokens)
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise PeerUnavailable(f"skipped: {INSTALL_HINT} (onnxruntime-genai: {exc})", name) from exc
    version = f"onnxruntime-genai {og.__version__}"
    if draft_dir is None:
        raise PeerUnavailable(f"skipped: no draft model for this target; make one with `dspark train draft-model "
                              f"--target {target_dir}` ({version})", name)
    try:
        target_build = build_genai_model(target_dir, cache, stop=stop, threads=threads)
        draft_build = build_genai_model(draft_dir, cache, stop=stop, threads=threads)
    except PeerUnavailable as exc:
        raise PeerUnavailable(str(exc), name) from exc
    config = og.Config(str(target_build))
    try:
        config.overlay(json.dumps(speculative_overlay(target_build, draft_build, draft_tokens)))
        model = og.Model(config)
    except RuntimeError as exc:  # a runtime without `model.type: speculative`, or a draft it refuses
        raise PeerUnavailable(f"skipped: {version} does not run draft-model speculation with {draft_dir}: {exc}",
                              name) from exc

    def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
        timeline, generator = _genai_greedy(og, model, prompt, max_new_tokens)
        stats = generator.get_speculative_stats() if hasattr(generator, "get_speculative_stats") else {}
        timeline.counters = {key: stats[key] for key in DRAFT_STATS if key in stats}
        return timeline

    return [System(name, version, generate)]
