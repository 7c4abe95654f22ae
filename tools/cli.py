"""Console entry points: `dspark`, `dspark-export`, `dspark-build-engine`.

Each command lives in its own module and is imported only when it runs, so `dspark --help`
(which lists the one-line help kept here) stays fast and a missing optional dependency only
affects the command that needs it. `dspark export` and `dspark build-engine` are the very
command objects the `dspark-export` and `dspark-build-engine` scripts run. export, build-engine,
generate and calibrate report user errors as one line and exit status 2 (`dspark.tools.errors`).
"""

from __future__ import annotations

import importlib

import click

# name -> (module under dspark.tools, click command attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "export": ("export_command", "export", "Export a target and its drafter to ONNX (as dspark-export)."),
    "build-engine": ("build_engine_command", "build_engine",
                     "Build an engine from an export (as dspark-build-engine)."),
    "generate": ("generate_command", "generate", "Generate text with speculative decoding."),
    "train": ("train_command", "train", "Train the bundled demo tokenizer, target and drafters."),
    "bench": ("bench_command", "bench", "Benchmark against other runtimes, with plots."),
    "calibrate": ("calibrate_command", "calibrate", "Sequential Temperature Scaling of confidences."),
    "serve": ("serve_command", "serve", "Serve the OpenAI API (completions, chat), metrics and a dashboard."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return _load(name) if name in _COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the help kept above, without importing any command module."""
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _load(name: str) -> click.Command:
    module, attr, _ = _COMMANDS[name]
    return getattr(importlib.import_module(f"dspark.tools.{module}"), attr)


@click.group("dspark", cls=_LazyGroup)
@click.version_option(package_name="dspark")
def main() -> None:
    """dspark: DSpark speculative decoding, compiled and served."""


def export_main() -> None:
    """The `dspark-export` script: the command `dspark export` runs (its usage names the script)."""
    _load("export")(prog_name="dspark-export")


def build_engine_main() -> None:
    """The `dspark-build-engine` script: the command `dspark build-engine` runs."""
    _load("build-engine")(prog_name="dspark-build-engine")
