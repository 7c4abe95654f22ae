"""Shared fixtures: the golden DeepSpec sets and tiny random checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel

GOLDEN_DIR = Path(os.environ.get("DSPARK_GOLDEN", Path(__file__).resolve().parents[2] / "shared" / "golden"))

class GoldenDrafter(NamedTuple):
    set_name: str
    drafter_dir: str
    stem: str  # suffix of the tensors*/trace_tensors* files
    traces: tuple[str, ...]


GOLDEN_DRAFTERS = [
    GoldenDrafter("qwen3-tiny-vanilla", "drafter", "", ("traces.json", "traces_threshold_0.5.json")),
    GoldenDrafter("qwen3-tiny-gated-rnn", "drafter_gated", "_gated",
                  ("traces_gated.json", "traces_gated_threshold_0.5.json")),
    GoldenDrafter("qwen3-tiny-gated-rnn", "drafter_rnn", "_rnn",
                  ("traces_rnn.json", "traces_rnn_threshold_0.5.json")),
    GoldenDrafter("dflash-tiny", "drafter", "", ("traces.json",)),
]


def golden_path(*parts: str) -> Path:
    path = GOLDEN_DIR.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"golden fixtures not found at {path} (set DSPARK_GOLDEN)")
    return path


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


def tiny_target_config(**overrides) -> TargetConfig:
    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                  max_position_embeddings=512)
    fields.update(overrides)
    return TargetConfig(**fields)


def tiny_drafter_config(target: TargetConfig, **overrides) -> DrafterConfig:
    fields = dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=48,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  block_size=4, target_layer_ids=(0, 1), num_target_layers=target.num_hidden_layers,
                  mask_token_id=target.vocab_size - 1, markov_rank=4, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True)
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_pair(seed: int, target_overrides: dict | None = None, drafter_overrides: dict | None = None,
                scale: float = 1.0) -> tuple[TargetModel, DSparkDrafter]:
    """Random models; `scale` > 1 sharpens the target's distributions (peaked logits)."""
    torch.manual_seed(seed)
    tcfg = tiny_target_config(**(target_overrides or {}))
    dcfg = tiny_drafter_config(tcfg, **(drafter_overrides or {}))
    target = TargetModel(tcfg, dcfg.target_layer_ids).eval()
    drafter = DSparkDrafter(dcfg).eval()
    with torch.no_grad():
        for module in (target, drafter):
            for p in module.parameters():
                p.normal_(0.0, 0.02 * scale) if p.dim() > 1 else p.fill_(1.0)
        # Drafters copy the target's embedding and LM head, as DeepSpec initialises them.
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    return target, drafter


@pytest.fixture
def probes_whatever_the_ceiling(monkeypatch):
    """The drafting gate probes where drafting does not pay, even where no confidence could make it pay (their
    costs say drafting never pays, to keep the gate declined): for tests of the probes themselves. The rule that
    skips such probes (`drafting_gate.CEILING_MARGIN`) has its own tests."""
    from dspark.runtime import drafting_gate

    monkeypatch.setattr(drafting_gate, "CEILING_MARGIN", 0.0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only contend on a shared CPU (many times slower here).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixed_gamma_engine(backend, **drafter_flags):
    """A `fixed` γ engine of four 96-position slots on an export's backend, its drafter runner's path flags set
    (`fused`, `joined`): the engines that compare one drafting path with another."""
    from dspark.runtime.batch_loop import BatchEngine
    from dspark.runtime.capacity import Capacity
    from dspark.runtime.model_info import ModelInfo
    from dspark.runtime.prefix_scheduler import SchedulerConfig

    engine = BatchEngine(backend, ModelInfo.from_manifest(backend.manifest), capacity=Capacity(4, 4 * 96, 96),
                         scheduler=SchedulerConfig("fixed"))
    for name, value in drafter_flags.items():
        setattr(engine.drafter, name, value)
    return engine
