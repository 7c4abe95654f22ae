"""`dspark generate`: speculative decoding of one prompt through the batched runtime."""

from __future__ import annotations

import json
import time

import click

_DIR = click.Path(exists=True, file_okay=False, path_type=str)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


@click.command("generate")
@click.option("--engine", "engine_dir", type=_DIR,
              help="Engine or dspark-export directory (ONNX Runtime). Default: the bundled demo pair, built "
                   "into the user cache on first use.")
@click.option("--target", "target_dir", type=_DIR, help="Target checkpoint (PyTorch reference backend).")
@click.option("--drafter", "drafter_dir", type=_DIR, help="Drafter checkpoint (with --target).")
@click.option("--prompt", help="Prompt text (needs tokenizer.json in the engine or target directory).")
@click.option("--prompt-ids", help="Prompt token ids, comma-separated: 1,2,3.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--scheduler", default="dspark", show_default=True,
              type=click.Choice(["dspark", "fixed", "threshold", "off"]))
@click.option("--gamma", type=click.IntRange(min=0), help="Draft tokens per round for --scheduler fixed.")
@click.option("--threshold", default=0.5, show_default=True,
              help="Confidence cut-off for --scheduler threshold.")
@click.option("--kv-mode", default="concat", show_default=True, type=click.Choice(["concat", "static"]))
@click.option("--json", "as_json", is_flag=True, help="Print ids, rounds, acceptance and speed as JSON.")
def generate(engine_dir, target_dir, drafter_dir, prompt, prompt_ids, max_new_tokens, temperature, seed,
             scheduler, gamma, threshold, kv_mode, as_json) -> None:
    """Generate with DSpark speculative decoding (lossless: same distribution as the target)."""
    from pathlib import Path

    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.kv_cache import CapacityError
    from dspark.runtime.prefix_scheduler import SchedulerConfig
    from dspark.runtime.reference_decoder import RequestError

    if engine_dir is not None and target_dir is not None:
        raise click.UsageError("give either --engine DIR or --target DIR --drafter DIR, not both")
    if target_dir is not None and drafter_dir is None:
        raise click.UsageError("--target needs --drafter")
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if engine_dir is None and target_dir is None:
        from dspark.tools.demo_engine import demo_engine_dir

        engine_dir = str(demo_engine_dir())
    tokenizer = None
    if prompt is not None:
        path = Path(engine_dir or target_dir) / "tokenizer.json"
        if not path.is_file():
            raise click.UsageError(f"--prompt needs {path}; pass --prompt-ids instead")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        ids = tokenizer.encode(prompt).ids
    else:
        ids = _parse_ids(prompt_ids)
    options = RuntimeOptions(
        scheduler=SchedulerConfig(scheduler, fixed_length=gamma, threshold=threshold), kv_mode=kv_mode,
        max_requests=1, max_seq_len=len(ids) + max_new_tokens + 64,
    )
    runtime = (Runtime.load(engine_dir, options) if engine_dir
               else Runtime.from_checkpoints(target_dir, drafter_dir, options))
    begin = time.perf_counter()
    try:
        (result,) = runtime.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                     stop=runtime.info.eos_token_ids)
    except (RequestError, CapacityError) as exc:
        raise click.UsageError(str(exc)) from exc
    seconds = time.perf_counter() - begin
    if as_json:
        click.echo(json.dumps({
            "output_ids": result.tokens, "rounds": result.rounds,
            "mean_accepted_length": result.mean_acceptance_length,
            "acceptance_lengths": result.acceptance_lengths, "verified_tokens": result.verified_tokens,
            "tokens_per_second": len(result.tokens) / seconds, "finish_reason": result.finish_reason,
            "scheduler": scheduler,
        }))
    else:
        click.echo(tokenizer.decode(result.tokens) if tokenizer else ",".join(map(str, result.tokens)))
