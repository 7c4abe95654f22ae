"""The drafting gate in the engine: the first step drafts only the probe rows, greedy output stays the target's
through skips, probes and arrivals, rows catching up draft what a drafter fed their whole context drafts, and a
long prompt's catch-up is paid by its own row. Also the engine helpers other gate tests share."""

from __future__ import annotations

from functools import cache
from itertools import pairwise

import numpy as np
import pytest
import torch
from conftest import golden_path, load_json
from test_drafting_gate import CHEAP, DEAR, GAMMA, SplitCost

from dspark.models import load_pair
from dspark.runtime import probe_spacing
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.proposer import propose_block
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.stats import StepRecord
from dspark.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread", "probes_whatever_the_ceiling")


@cache
def pair():
    return load_pair(golden_path("qwen3-tiny-vanilla", "target"), golden_path("qwen3-tiny-vanilla", "drafter"))


@cache
def prompts() -> tuple[tuple[int, ...], ...]:
    samples = load_json(golden_path("qwen3-tiny-vanilla", "traces.json"))["samples"]
    base = [s["prompt_ids"] for s in samples]
    return tuple(tuple(p) for p in [*base, *(p[: max(3, len(p) // 2)] for p in base), base[2] * 4, base[1][::-1]])


@cache
def greedy(prompt: tuple[int, ...], new: int) -> list[int]:
    return autoregressive_generate(pair()[0], list(prompt), max_new_tokens=new)


class Recorder:
    """The backend's drafter backbone calls: (rows, context rows) each."""

    def __init__(self, backend: TorchBackend) -> None:
        self.calls: list[tuple[int, int]] = []
        run = backend._run

        def recording(graph, feeds):
            if graph == "drafter_backbone":
                self.calls.append(tuple(feeds["context_features"].shape[:2]))
            return run(graph, feeds)

        backend._run = recording


def engine_for(cost: SplitCost, slots: int = 8, overlap: bool = False, **config) -> tuple[BatchEngine, Recorder]:
    """`overlap`: probes draft on the worker (probe_overlap); off, a probe step's record shows its rows. `config`:
    more SchedulerConfig fields."""
    target, drafter = pair()
    backend = TorchBackend(target, drafter)
    recorder = Recorder(backend)
    engine = BatchEngine(backend, ModelInfo.from_models(target, drafter), capacity=Capacity(slots, 1 << 16, 1024),
                         scheduler=SchedulerConfig("dspark", prompt_lookup=0, overlap_probes=overlap, **config),
                         cost_model=cost,
                         kv_mode="concat")
    return engine, recorder


def launches(engine: BatchEngine) -> list[list[int]]:
    """The rows of each probe the engine hands to the worker, as it launches them."""
    seen: list[list[int]] = []
    launch = engine._launch_probe

    def counting(plan, *args):
        seen.append(plan.rows.tolist())
        return launch(plan, *args)

    engine._launch_probe = counting
    return seen


def drafted_rows(record: StepRecord) -> list[int]:
    if record.confidence_logits is None:
        return []
    return np.flatnonzero(np.isfinite(record.confidence_logits[:, 0])).tolist()


def run(engine: BatchEngine, arrivals: dict[int, list[tuple[int, ...]]], new: int) -> dict[int, tuple[int, ...]]:
    """Step until idle, submitting arrivals[step] before that step -> request id: its prompt."""
    asked, step = {}, 0
    while step <= max(arrivals) or not engine.idle:
        for prompt in arrivals.get(step, []):
            asked[engine.submit(list(prompt), max_new_tokens=new)] = prompt
        engine.step()
        step += 1
    return asked


def test_engine_drafts_only_the_probe_rows_from_the_first_step():
    engine, recorder = engine_for(DEAR)
    batch = list(prompts())[:8]
    run(engine, {0: batch}, 24)
    steps = [s for s in engine.stats.steps if s.requests > engine.gate.probe_rows]
    probe_rows = engine.gate.probe_rows
    shortest = sorted(np.argsort([len(q) for q in batch], kind="stable")[:probe_rows].tolist())
    assert drafted_rows(steps[0]) == shortest  # the rows with the least context to catch up
    assert recorder.calls[0] == (probe_rows, max(len(batch[r]) for r in shortest))  # the drafter ran on them alone
    assert max(rows for rows, _ in recorder.calls) <= engine.gate.probe_rows
    probes = [i for i, s in enumerate(steps) if drafted_rows(s)]
    assert probes[0] == 0  # then one a probe's price paid by plain steps later (DEAR: past this run's end)
    assert all(b - a > engine.gate.probe_every for a, b in pairwise(probes))
    for s in steps:  # only a probe row ever verifies drafts, and a probe step is no drafting step
        rows = set(drafted_rows(s))
        assert all(length == 0 for r, length in enumerate(s.lengths) if r not in rows)
        assert not s.drafted and len(rows) in (0, engine.gate.probe_rows)
    # under padded verification (the default) probes verify anchors only: drafts would pad every row
    assert all(max(s.lengths) == 0 for s in steps if drafted_rows(s))
    # a probe's confidences over all rows are host numpy, as every step's (no torch call between graph calls)
    assert all(isinstance(s.confidence_logits, np.ndarray) for s in steps if s.confidence_logits is not None)


@pytest.mark.parametrize("overlap", [False, True], ids=["probes-in-line", "probes-overlapped"])
@pytest.mark.parametrize(("cost", "steps"), [(DEAR, "p."), (CHEAP, "A"), (SplitCost(3.5e-4, 1e-4), "Ap.")],
                         ids=["skip-and-probe", "draft", "middle"])
def test_greedy_output_is_the_targets_with_skips_probes_and_arrivals(cost, steps, overlap, monkeypatch):
    """`steps`: the kinds of step the run goes through, A every row drafts, p a probe, . none
    (the middle table: drafting pays at 3 rows, not at 6, so the gate drafts, stops, probes, drafts).
    Probes come every probe_every steps here, however dear (PROBE_SHARE), so that this run has some.
    Overlapped, a probe drafts beside plain steps: its rows show in no step's record, its launches count."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)
    engine, _ = engine_for(cost, slots=6, overlap=overlap)
    launched = launches(engine)
    p = list(prompts())
    new = 40
    asked = run(engine, {0: p[:3], 2: p[3:5], 5: p[5:7], 11: p[7:10], 19: p[:2]}, new)
    finished = engine.take_finished()
    assert len(finished) == len(asked) == 12
    for request_id, prompt in asked.items():
        assert finished[request_id].tokens == greedy(prompt, new)
    kinds = {"A" if s.drafted else "p" if drafted_rows(s) else "." for s in engine.stats.steps if s.requests > 4}
    if overlap:
        kinds |= {"p"} if any(len(rows) < 5 for rows in launched) else set()
    else:
        assert not launched
    assert kinds == set(steps)


def reference_drafts(sequence: list[int]) -> list[int]:
    """The block a drafter fed the whole context of `sequence` (anchor last) drafts, greedy."""
    target, drafter = pair()
    n = len(sequence) - 1
    with torch.no_grad():
        features = target(torch.tensor([sequence[:-1]]), torch.arange(n)[None]).context_features
        masks = torch.full((1, GAMMA - 1), drafter.config.mask_token_id)
        anchor = torch.tensor([sequence[-1]])
        backbone = drafter.forward_backbone(block_ids=torch.cat((anchor[:, None], masks), dim=1),
                                            block_position_ids=torch.arange(n, n + GAMMA)[None],
                                            context_features=features, context_position_ids=torch.arange(n)[None])
        return propose_block(drafter, backbone.hidden, anchor, 0.0).tokens[0].tolist()


def test_rows_catching_up_draft_what_a_drafter_fed_their_whole_context_drafts(monkeypatch):
    """Probes of a few rows (gathered slots) after skipped steps, and long prompts arriving while
    every row drafts (calls split by backlog): each drafted row's block is the reference block."""
    checked = 0
    for cost in (DEAR, CHEAP):
        engine, recorder = engine_for(cost)
        blocks: list[tuple[list[list[int]], np.ndarray, list[int]]] = []
        propose = engine._propose

        def capture(drafting, *args, engine=engine, propose=propose, blocks=blocks):
            sequences = [[*a.result.prompt_ids, *a.result.tokens] for a in engine.active]
            block = propose(drafting, *args)
            blocks.append((sequences, np.asarray(block.tokens).copy(), drafting.tolist()))
            return block

        monkeypatch.setattr(engine, "_propose", capture)
        p = list(prompts())
        run(engine, {0: p[:6], 3: [p[8]], 9: [p[2] * 3]}, 24)
        if cost is CHEAP:
            assert any(rows == 1 and ctx >= 150 for rows, ctx in recorder.calls)  # long prompts: calls of their own
        for sequences, tokens, rows in blocks:
            for r in rows:
                assert tokens[r].tolist() == reference_drafts(sequences[r])
                checked += 1
    assert checked > 40


def test_a_long_prompt_arriving_is_paid_by_its_own_row():
    engine, recorder = engine_for(CHEAP)
    p = list(prompts())
    run(engine, {0: p[:5], 4: [p[2] * 4]}, 16)  # 200 prompt tokens join 5 rows drafting ~8 each
    widest = max(ctx for _, ctx in recorder.calls)
    assert widest >= 200
    assert all(rows == 1 for rows, ctx in recorder.calls if ctx == widest)  # nobody else padded to it

