"""`dspark calibrate ENGINE DATA`: Sequential Temperature Scaling of an engine's drafter confidences."""

from __future__ import annotations

import click

from .errors import OneLineErrors


@click.command("calibrate", cls=OneLineErrors)
@click.argument("engine_dir", type=str)
@click.argument("data", type=str)
@click.option("--tokenizer", type=str, help="tokenizer.json for text data (default: the engine's or export's).")
@click.option("--prompt-len", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each sequence used as the prompt.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens decoded per prompt (each round is one calibration row).")
@click.option("--holdout", default=0.25, show_default=True, type=click.FloatRange(0.0, 1.0, max_open=True),
              help="Fraction of the sequences kept out of the fit to report held-out ECE.")
def calibrate(engine_dir, data, tokenizer, prompt_len, max_new_tokens, holdout) -> None:
    """Fit per-slot confidence temperatures on DATA; write them and ECE before/after to engine.json."""
    from dspark.engines.build import calibrate_engine

    prog = click.get_current_context().command_path
    manifest = calibrate_engine(engine_dir, data, tokenizer=tokenizer, prompt_len=prompt_len,
                                max_new_tokens=max_new_tokens, holdout_fraction=holdout,
                                progress=lambda m: click.echo(f"{prog}: {m}", err=True))
    cal = manifest["calibration"]
    click.echo(f"temperatures   {' '.join(f'{t:.3f}' for t in cal['temperatures'])}")
    click.echo(f"ECE before     {' '.join(f'{e:.4f}' for e in cal['ece_before'])}  (mean {cal['ece_before_mean']:.4f})")
    click.echo(f"ECE after      {' '.join(f'{e:.4f}' for e in cal['ece_after'])}  (mean {cal['ece_after_mean']:.4f})")
    if cal["holdout"]:
        h = cal["holdout"]
        click.echo(f"held out ({h['samples']} rounds): mean ECE "
                   f"{h['ece_before_mean']:.4f} -> {h['ece_after_mean']:.4f}")
    click.echo(f"wrote {engine_dir}/engine.json and {engine_dir}/{cal['diagram']}")
