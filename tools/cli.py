"""Console entry points: `dspark`, `dspark-export`, `dspark-build-engine`.

Each command lives in its own module and is imported only when it runs, so `dspark --help`
stays fast and a missing optional dependency only affects the command that needs it.
"""

from __future__ import annotations

import importlib

import click

# name -> (module under dspark.tools, click command attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("generate_command", "generate", "Generate text with speculative decoding."),
    "train": ("train_command", "train", "Train the bundled demo tokenizer, target and drafters."),
    "bench": ("bench_command", "bench", "Benchmark against other runtimes, with plots."),
    "calibrate": ("calibrate_command", "calibrate", "Sequential Temperature Scaling of confidences."),
}
_NOT_BUILT = {
    "export": "use dspark-export",
    "serve": "an HTTP server",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*_COMMANDS, *_NOT_BUILT})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in _COMMANDS:
            module, attr, _ = _COMMANDS[name]
            return getattr(importlib.import_module(f"dspark.tools.{module}"), attr)
        if name in _NOT_BUILT:
            return _not_built(name, _NOT_BUILT[name])
        return None


def _not_built(name: str, what: str) -> click.Command:
    @click.command(name, help=f"[not built yet] {what}.", context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        click.echo(f"dspark {name}: not built yet ({what}).", err=True)
        raise SystemExit(2)

    return command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="dspark")
def main() -> None:
    """dspark: DSpark speculative decoding, compiled and served."""


def export_main() -> None:
    importlib.import_module("dspark.tools.export_command").export()


def build_engine_main() -> None:
    importlib.import_module("dspark.tools.build_engine_command").build_engine()
