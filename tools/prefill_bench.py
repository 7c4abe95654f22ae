"""What a prefill costs with logits at every position against logits at the prompt's last one only.

    python -m dspark.tools.prefill_bench --export DIR [--tokens 1024] [--repeats 3]

DIR is a dspark-export (or ORT engine) directory with the fused target (`logits_rows`). Each way runs in
its own process (so one's memory does not hide the other's): the target's forward over one prompt of
`--tokens` tokens, as the engine's prefill calls it (`TargetRunner.forward(last_only=...)`), repeated;
printed: the logits' shape, the fastest and the first call, and the process's resident memory while the
output is held, above the loaded engine's. `full` is what a prefill cost before `logits_rows`: the LM head
over every prompt position and [1, tokens, vocab] logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from .errors import OneLineErrors


def measure(export: Path, tokens: int, repeats: int, last_only: bool) -> dict:
    import numpy as np
    import psutil

    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.prefix_scheduler import SchedulerConfig
    from dspark.runtime.step_batch import StepBatch

    options = RuntimeOptions(scheduler=SchedulerConfig("off"), max_requests=1, max_seq_len=tokens + 16,
                             live_cost=False)
    with Runtime.load(export, options) as runtime:
        engine = runtime.engine()
        if not engine.target.selects_logits:
            raise click.ClickException(f"{export} has no fused target with logits_rows: re-export it")
        vocab = runtime.info.vocab_size
        batch = StepBatch.prompts([np.random.default_rng(0).integers(1, vocab, tokens).tolist()])
        before, seconds, held, shape = psutil.Process().memory_info().rss, [], 0, ()
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = engine.target.forward(batch, last_only=last_only)
            seconds.append(time.perf_counter() - t0)
            held = max(held, psutil.Process().memory_info().rss - before)
            shape = tuple(out.logits.shape)
            del out
    return {"logits": shape, "min_ms": 1e3 * min(seconds), "first_ms": 1e3 * seconds[0], "held_mib": held / 2**20}


@click.command("prefill-bench", cls=OneLineErrors)
@click.option("--export", "export_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Export or ORT engine directory with the fused target.")
@click.option("--tokens", default=1024, show_default=True, type=click.IntRange(min=2), help="Prompt length.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--only", type=click.Choice(["full", "last"]), hidden=True)  # the child processes
def main(export_dir: Path, tokens: int, repeats: int, only: str | None) -> None:
    """Prefill time and memory, logits everywhere vs at the last position."""
    if only is not None:
        click.echo(json.dumps(measure(export_dir, tokens, repeats, only == "last")))
        return
    click.echo(f"prefill of one {tokens}-token prompt through {export_dir} (fused target), {repeats} calls each")
    for way in ("full", "last"):
        done = subprocess.run([sys.executable, "-m", "dspark.tools.prefill_bench", "--export", str(export_dir),
                               "--tokens", str(tokens), "--repeats", str(repeats), "--only", way],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise click.ClickException(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        click.echo(f"  logits at {'every position' if way == 'full' else 'the last only '}: logits {r['logits']}, "
                   f"{r['min_ms']:.0f} ms (fastest; first {r['first_ms']:.0f}), memory held "
                   f"+{r['held_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
