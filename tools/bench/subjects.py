"""What a bench run measures: the model folders, the export the runtime loads, prompts, stop token.

Without `--engine` the bench exports the pair and builds an engine into a cache folder under `--out`, keyed by
the checkpoint files' sizes and modification times, so a second run reuses it. With `--engine`
the runtime loads that directory as given; the checkpoint folders (needed by the acceptance
study and the peers, which run the Hugging Face target) then come only from `--target`,
`--drafter` and `--dflash`, and whatever needs a missing one is reported as skipped.

`--standin` adds a second target to the load sweep: the COST STAND-IN of the target checkpoint
(`dspark.models.inflate`), made into the user cache by `dspark train standin`'s own code unless a
current one is there, then exported and built with the same drafter into the bench's cache like
the pair itself. Its label, wherever it is reported, is `COST STAND-IN target (<params>)`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from dspark.export.artifacts import read_tokenizer
from dspark.export.engine_dir import is_engine_dir, read_engine_manifest
from dspark.models import DSparkDrafter

TOKENIZER_FIX = "re-export the pair, or give prompts as token ids"
DEMO_DIR = Path(__file__).resolve().parents[2] / "models" / "demo"
# where in each held-out module the demo engines' calibration prompts start: >= 0.027 of a module away
# from every fraction k/(n+1), n <= 5, where the bench's prompts start (`demo_calibration`)
CALIBRATION_FRACTIONS = (0.09, 0.29, 0.45, 0.63, 0.87)
CALIBRATION_PROMPT_LEN = 32


class BenchSetupError(ValueError):
    """The bench cannot find or use the models or prompts it was given."""


@dataclass(frozen=True)
class Subjects:
    runtime_dir: Path  # what Runtime.load opens: an export or engine directory
    target_dir: Path | None  # Hugging Face target folder (acceptance, peers, greedy reference)
    dspark_dir: Path | None  # DSpark drafter folder
    dflash_dir: Path | None  # DFlash drafter folder (no Markov head)
    source: str  # "demo", "checkpoints" or "engine"

    @property
    def tokenizer_path(self) -> Path | None:
        for folder in (self.runtime_dir, self.target_dir):
            if folder is not None and (folder / "tokenizer.json").is_file():
                return folder / "tokenizer.json"
        return None


def demo_folders() -> tuple[Path, Path, Path | None]:
    """The bundled demo pair, or BenchSetupError naming what is missing."""
    target, dspark, dflash = (DEMO_DIR / name for name in ("target", "dspark", "dflash"))
    missing = [str(d) for d in (target, dspark) if not (d / "config.json").is_file()]
    if missing:
        raise BenchSetupError(
            f"the bundled demo pair is not there ({', '.join(missing)} lack config.json): train it with "
            "`dspark train`, or pass --engine DIR or --target DIR --drafter DIR"
        )
    return target, dspark, dflash if (dflash / "config.json").is_file() else None


def cached_engine_dir(target_dir: Path, drafter_dir: Path, cache: Path, threads: int = 1,
                      calibration: Sequence[Sequence[int]] | None = None) -> Path:
    """An ONNX Runtime engine of the pair under cache/ (built once per intra-op thread count): the
    runtime then schedules with the engine's SPS table, measured at the count it runs with, and with
    `calibration` prompts its confidences are STS-calibrated (`dspark calibrate`) on them."""
    from dspark.tools.demo_engine import cached_engine, checkpoint_key

    suffix = ("" if threads == 1 else f"-t{threads}") + ("" if calibration is None else "-sts")
    root = cache / f"engine-{checkpoint_key(target_dir, drafter_dir)}{suffix}"
    return cached_engine(target_dir, drafter_dir, root, show_progress=False, threads=threads,
                         calibration=calibration)


def demo_calibration(tokenizer_path: Path) -> list[list[int]]:
    """The prompts a demo engine's confidences are calibrated on (STS, as `dspark calibrate` fits them):
    `CALIBRATION_PROMPT_LEN`-token windows of the held-out standard-library modules at
    `CALIBRATION_FRACTIONS` of each, apart from where the bench's own prompts lie (`load_prompts`: at
    1/(n+1), ..., n/(n+1) of each module, n <= 5 for up to 75 prompts).

    Why calibrate: the raw confidence head is under-confident at the block's later slots (on these
    windows, observed survival ~0.8 where Π c said 0.5 at slot 6), so Algorithm 1 cut blocks the target
    would have accepted: on the 100M stand-in at one request it verified 3.7 tokens a step where fixed
    γ = 7 accepted 4.7 of 8 and ran faster. A deployment calibrates on its own traffic the same way."""
    return [ids[start : start + CALIBRATION_PROMPT_LEN] for fraction in CALIBRATION_FRACTIONS
            for ids in heldout_streams(tokenizer_path)
            if len(ids) > 2 * CALIBRATION_PROMPT_LEN
            for start in [round((len(ids) - CALIBRATION_PROMPT_LEN) * fraction)]]


def confidence_note(runtime_dir: Path) -> str:
    """How the engine's confidences were calibrated, in one phrase for the report."""
    calibration = read_engine_manifest(runtime_dir)["calibration"] if is_engine_dir(runtime_dir) else None
    if not calibration:
        return "raw confidences (not STS-calibrated)"
    held = calibration.get("holdout") or {}
    ece = (f"held-out mean ECE {held['ece_before_mean']:.3f} -> {held['ece_after_mean']:.3f}" if held else
           f"mean ECE {calibration['ece_before_mean']:.3f} -> {calibration['ece_after_mean']:.3f}")
    return f"confidences STS-calibrated on {calibration['sequences']} prompts ({ece})"


def target_label(chosen: Subjects) -> str:
    """How the sweep names the pair's own target: 'demo target (5.2M)', 'target PARENT/NAME (…)', or the engine."""
    if chosen.target_dir is None:
        return f"engine {chosen.runtime_dir.name}"
    from dspark.models import TargetConfig
    from dspark.models.inflate import count_params, format_params, read_standin

    folder = chosen.target_dir
    if read_standin(folder) is not None:  # given a stand-in as --target: say so all the same
        return standin_label_short(folder)
    params = format_params(count_params(TargetConfig.from_folder(folder)))
    if chosen.source == "demo":
        return f"demo target ({params})"
    folder = folder.resolve()
    return f"target {folder.parent.name}/{folder.name} ({params})"


def standin_label_short(folder: Path) -> str:
    """'COST STAND-IN target (100M)': the label of every stand-in figure and table row."""
    from dspark.models.inflate import format_params, read_standin

    return f"COST STAND-IN target ({format_params(int(read_standin(folder)['params']))})"


@dataclass(frozen=True)
class Standin:
    checkpoint_dir: Path  # the inflated target (user cache)
    runtime_dir: Path  # its engine with the pair's drafter (bench cache)
    label: str  # COST STAND-IN target (<params>)
    record: dict  # the checkpoint's dspark_standin section, with the one-line label and the folders


def standin_checkpoint(chosen: Subjects, params_text: str, *, progress: bool = True) -> Path:
    """The stand-in of the chosen target with >= `params_text` parameters, in the user cache
    (<cache>/standin-<params>, as `dspark train standin` names it), made by that command's code
    unless it is already there and current."""
    import click

    from dspark.models import TargetConfig
    from dspark.models.inflate import InflateError, count_params, format_params, parse_params, plan_inflation
    from dspark.tools.demo_engine import cache_root
    from dspark.tools.train_command import standin_command

    if chosen.target_dir is None or chosen.dspark_dir is None:
        raise BenchSetupError("--standin inflates the target checkpoint: use the bundled demo pair or give "
                              "--target and --drafter (an --engine alone has no checkpoint to inflate)")
    demo = chosen.source == "demo"
    try:
        config = TargetConfig.from_folder(chosen.target_dir)
        params = parse_params(params_text, count_params(config))
        plan_inflation(config, params)
    except InflateError as exc:
        raise BenchSetupError(f"--standin-params: {exc}") from exc
    name = format_params(params) if demo else f"{chosen.target_dir.resolve().name}-{format_params(params)}"
    out = cache_root() / f"standin-{name}"
    try:
        standin_command.callback(target_dir=None if demo else chosen.target_dir, params_text=params_text,
                                 out=out, force=False, progress=progress)
    except click.ClickException as exc:
        raise BenchSetupError(f"--standin: {exc.format_message()}") from exc
    return out


def resolve_standin(chosen: Subjects, params_text: str, cache: Path, *, progress: bool = True,
                    threads: int = 1) -> Standin:
    """The stand-in checkpoint (made if needed) and its cached engine with the pair's drafter."""
    from dspark.models.inflate import read_standin, standin_label

    checkpoint = standin_checkpoint(chosen, params_text, progress=progress)
    calibration = demo_calibration(checkpoint / "tokenizer.json") if chosen.source == "demo" else None
    runtime_dir = cached_engine_dir(checkpoint, chosen.dspark_dir, cache, threads, calibration)
    record = {**read_standin(checkpoint), "label": standin_label(checkpoint), "checkpoint_dir": str(checkpoint),
              "runtime_dir": str(runtime_dir), "drafter_dir": str(chosen.dspark_dir)}
    return Standin(checkpoint, runtime_dir, standin_label_short(checkpoint), record)


def resolve(engine: Path | None, target: Path | None, drafter: Path | None, dflash: Path | None,
            cache: Path, threads: int = 1) -> Subjects:
    if (target is None) != (drafter is None):
        raise BenchSetupError("give --target and --drafter together")
    if engine is not None:
        return Subjects(engine, target, drafter, dflash, "engine")
    if target is not None:
        return Subjects(cached_engine_dir(target, drafter, cache, threads), target, drafter, dflash, "checkpoints")
    target, drafter, demo_dflash = demo_folders()
    return Subjects(cached_engine_dir(target, drafter, cache, threads, demo_calibration(target / "tokenizer.json")),
                    target, drafter, dflash or demo_dflash, "demo")


def without_markov(drafter: DSparkDrafter) -> DSparkDrafter:
    """A copy of the drafter that drafts from the backbone's logits alone (Markov head skipped).
    The confidence head goes too: it may read the Markov embedding, and acceptance is measured
    on full blocks, which never consult it."""
    ablated = copy.deepcopy(drafter)
    ablated.markov_head = None
    ablated.confidence_head = None
    return ablated


def stop_token(eos_token_ids: Sequence[int], mask_token_id: int) -> int:
    """The one stop token every system gets: the target's first eos id, or, for a checkpoint
    without one, the drafter's mask token (a token the target is not trained to produce)."""
    return int(eos_token_ids[0]) if eos_token_ids else int(mask_token_id)


@cache
def heldout_streams(tokenizer_path: Path) -> list[list[int]]:
    """The held-out standard-library modules as token ids (the demo pair's domain), encoded once a process: the
    bench's prompts and its engines' calibration prompts are both windows of them (~0.2 s an encoding)."""
    from dspark.tools import corpus

    tokenizer = read_tokenizer(tokenizer_path, TOKENIZER_FIX)
    return [e.ids for e in tokenizer.encode_batch(corpus.read_documents(corpus.corpus_files("heldout")))]


def load_prompts(path: Path | None, tokenizer_path: Path | None, *, count: int, length: int,
                 vocab_size: int, avoid: Sequence[int], seed: int = 0) -> tuple[list[list[int]], str]:
    """`count` prompts and where they came from.

    A prompts file is JSON lines ({"ids": [...]} or {"text": "..."}) or plain text, one prompt
    per line (text needs tokenizer.json). Without a file: windows of `length` tokens of the
    held-out standard-library modules when a tokenizer is there (the demo pair's domain),
    else random token ids (for untrained test models), never any id in `avoid`.
    """
    if path is not None:
        return _file_prompts(path, tokenizer_path, vocab_size)[:count], str(path)
    if tokenizer_path is not None:
        streams = heldout_streams(tokenizer_path)
        per_module = -(-count // len(streams))
        # windows at 1/(n+1), ..., n/(n+1) of each module: code, not just its opening docstring
        windows = [ids[start : start + length] for i in range(1, per_module + 1) for ids in streams
                   if len(ids) > length for start in [(len(ids) - length) * i // (per_module + 1)]]
        return windows[:count], "held-out standard-library modules"
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(avoid)])
    return ([allowed[torch.randint(0, len(allowed), (length,), generator=g)].tolist() for _ in range(count)],
            f"random token ids (seed {seed})")


def _file_prompts(path: Path, tokenizer_path: Path | None, vocab_size: int) -> list[list[int]]:
    if not path.is_file():
        raise BenchSetupError(f"--prompts {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenizer = None
    prompts = []
    for n, line in enumerate(lines, 1):
        record = json.loads(line) if path.suffix == ".jsonl" else {"text": line}
        if "ids" in record:
            ids = [int(t) for t in record["ids"]]
        elif "text" in record:
            if tokenizer_path is None:
                raise BenchSetupError(f"{path}:{n} is text but no tokenizer.json was found; give token ids "
                                      'as JSON lines {"ids": [...]}')
            if tokenizer is None:
                tokenizer = read_tokenizer(tokenizer_path, TOKENIZER_FIX)
            ids = tokenizer.encode(record["text"]).ids
        else:
            raise BenchSetupError(f'{path}:{n}: expected {{"ids": [...]}} or {{"text": "..."}}')
        if not ids or not all(0 <= t < vocab_size for t in ids):
            raise BenchSetupError(f"{path}:{n}: empty prompt or ids outside [0, {vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise BenchSetupError(f"--prompts {path} has no prompts")
    return prompts
