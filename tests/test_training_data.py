"""Resumable training, epoch windows, and drafter data from the target's own continuations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dspark.models import TargetConfig, TargetModel
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.tools import demo_eval, distill_data
from dspark.tools.cli import main
from dspark.tools.demo_training import CHECKPOINT, ResumeError, Schedule, target_config_dict, train_target
from dspark.tools.training_data import DistilledRows, EpochWindows, MixedBatches, RandomWindows

CONFIG = target_config_dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=0)
STREAM = torch.arange(3000) % 29


class Interrupted(Exception):
    pass


class InterruptAt:
    """A batch source that dies at one step, as a killed run would."""

    def __init__(self, source: RandomWindows, step: int) -> None:
        self.source, self.step, self.batch = source, step, source.batch

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == self.step:
            raise Interrupted
        return self.source(step)


def _train(folder: Path, batches, schedule: Schedule, tokenizer: Path, **kwargs) -> dict[str, torch.Tensor]:
    train_target(batches, CONFIG, schedule, folder=folder, tokenizer_file=tokenizer, progress=False, **kwargs)
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    return path


def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(tmp_path: Path, tokenizer: Path) -> None:
    schedule = Schedule(steps=7, batch=3, seq_len=16, lr=1e-2, warmup=2, checkpoint_every=2)
    source = RandomWindows(STREAM, 3, 16, 0)
    straight = _train(tmp_path / "straight", source, schedule, tokenizer)
    folder = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        _train(folder, InterruptAt(source, 5), schedule, tokenizer)
    assert torch.load(folder / CHECKPOINT, weights_only=True)["step"] == 4
    resumed = _train(folder, source, schedule, tokenizer)
    assert not (folder / CHECKPOINT).exists()  # the finished run cleans up
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)
    log = (folder / "train.log").read_text()
    assert "resume target at step 4" in log


def test_a_checkpoint_of_another_run_is_refused_or_restarted(tmp_path: Path, tokenizer: Path) -> None:
    schedule = Schedule(steps=5, batch=3, seq_len=16, lr=1e-2, warmup=2, checkpoint_every=2)
    source = RandomWindows(STREAM, 3, 16, 0)
    folder = tmp_path / "run"
    with pytest.raises(Interrupted):
        _train(folder, InterruptAt(source, 3), schedule, tokenizer)
    other = Schedule(steps=5, batch=3, seq_len=16, lr=2e-2, warmup=2, checkpoint_every=2)
    with pytest.raises(ResumeError, match="another run"):
        _train(folder, source, other, tokenizer)
    fresh = _train(folder, source, other, tokenizer, resume=False)  # starts over: the other run's weights
    for name, tensor in _train(tmp_path / "other", source, other, tokenizer).items():
        torch.testing.assert_close(fresh[name], tensor, rtol=0, atol=0, msg=name)


def test_an_epoch_shows_every_window_once_in_a_new_order() -> None:
    source = EpochWindows(torch.arange(1000), batch=4, length=10, seed=3)
    assert source.windows == 100 and source.steps_per_epoch == 25
    epoch = [source(step)[0] for step in range(25)]
    starts = sorted(int(ids[0]) for batch in epoch for ids in batch)
    assert starts == list(range(0, 1000, 10))
    second = [source(step)[0] for step in range(25, 50)]
    assert sorted(int(ids[0]) for batch in second for ids in batch) == starts
    assert not all(torch.equal(a, b) for a, b in zip(epoch, second, strict=True))
    assert torch.equal(source(7)[0], epoch[7])  # a pure function of the step


def test_mixed_batches_stack_their_sources() -> None:
    rows = torch.arange(40).view(4, 10)
    mask = torch.zeros(4, 10)
    mask[:, 3:] = 1
    mixed = MixedBatches((DistilledRows(rows, mask, 3, 0), RandomWindows(torch.arange(100) + 500, 2, 10, 1)))
    ids, loss_mask = mixed(0)
    assert mixed.batch == 5 and ids.shape == (5, 10)
    assert (ids[:3] < 40).all() and (ids[3:] >= 500).all()
    assert loss_mask[:3, :3].sum() == 0 and loss_mask[3:].all()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distill")
    runner = CliRunner()
    for args in (["tokenizer", "--out", str(root / "tok"), "--vocab-size", "300", "--limit-files", "3"],
                 ["target", "--tokenizer", str(root / "tok" / "tokenizer.json"), "--out", str(root / "target"),
                  "--hidden-size", "32", "--intermediate-size", "64", "--layers", "3", "--heads", "4",
                  "--kv-heads", "2", "--batch", "2", "--seq-len", "32", "--limit-files", "3", "--steps", "20",
                  "--lr", "1e-2", "--no-progress"]):
        result = runner.invoke(main, ["train", *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return root / "target"


def test_batched_greedy_continuations_are_the_targets_own(tiny_target: Path) -> None:
    target = TargetModel.from_pretrained(tiny_target)
    prompts = torch.randint(2, 300, (5, 9), generator=torch.Generator().manual_seed(0))
    rows = distill_data.continue_prompts(target, prompts, new_tokens=12, temperature=0.0, seed=0, batch=2,
                                         progress=False)
    assert torch.equal(rows[:, :9], prompts)
    for prompt, row in zip(prompts, rows, strict=True):
        assert row[9:].tolist() == autoregressive_generate(target, prompt.tolist(), max_new_tokens=12)
    sampled = distill_data.continue_prompts(target, prompts, new_tokens=12, temperature=1.0, seed=0, batch=2,
                                            progress=False)
    again = distill_data.continue_prompts(target, prompts, new_tokens=12, temperature=1.0, seed=0, batch=2,
                                          progress=False)
    assert torch.equal(sampled, again) and not torch.equal(sampled, rows)


def test_heldout_loss_scores_every_token() -> None:
    stream = torch.arange(70) % 29
    target = TargetModel(TargetConfig.from_dict(CONFIG))
    result = demo_eval.heldout_loss(target, [stream, stream[:5]], length=16)
    assert result["tokens"] == 69 + 4
    assert abs(result["perplexity"] - torch.tensor(result["loss"]).exp().item()) < 0.05 * result["perplexity"]


def test_distill_data_cli_trains_a_drafter_and_refuses_foreign_files(tiny_target: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    data = tmp_path / "distill.safetensors"
    result = runner.invoke(main, ["train", "distill-data", "--target", str(tiny_target), "--out", str(data),
                                  "--prompts", "6", "--prompt-len", "8", "--new-tokens", "24", "--batch", "4",
                                  "--limit-files", "3", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ids, mask, meta = distill_data.load_distill_set(data, tiny_target)
    assert ids.shape == (12, 32) and meta["temperatures"] == [0.0, 1.0]
    assert mask[:, :7].sum() == 0 and mask[:, 7:].all()
    drafter_args = ["--draft-layers", "1", "--markov-rank", "8", "--num-anchors", "3", "--batch", "2",
                    "--limit-files", "3", "--no-progress", "--steps", "2"]
    for kind in ("target", "mixed"):
        out = tmp_path / f"drafter-{kind}"
        result = runner.invoke(main, ["train", "drafter", "--target", str(tiny_target), "--out", str(out),
                                      "--data", kind, "--distill-data", str(data), *drafter_args])
        assert result.exit_code == 0, result.output
        assert (out / "model.safetensors").is_file()
    result = runner.invoke(main, ["train", "drafter", "--target", str(tiny_target), "--out", str(tmp_path / "x"),
                                  "--distill-data", str(data), *drafter_args])
    assert result.exit_code != 0 and "--distill-data goes with --data target or mixed" in result.output
    foreign = tmp_path / "foreign.safetensors"
    save_file({"ids": ids, "loss_mask": mask}, str(foreign))
    with pytest.raises(distill_data.DistillDataError, match="not a distillation file"):
        distill_data.load_distill_set(foreign, tiny_target)
    other_target = tmp_path / "other"
    other_target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other_target / name).write_bytes((tiny_target / name).read_bytes() + (b" " if name == "config.json" else b""))
    with pytest.raises(distill_data.DistillDataError, match="another target"):
        distill_data.load_distill_set(data, other_target)
