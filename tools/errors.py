"""One error policy for every command: a user error (a bad option value, checkpoint, artifact or
request) prints one line `<prog>: error: <message>` on stderr and exits with status 2, never a
traceback and never a usage block.

    @click.command("generate", cls=OneLineErrors)
    def generate(...) -> None: ...

The user-error types are named by module rather than imported, so a command still imports only
what it runs: an exception can only be an instance of a class whose module is already loaded.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

EXIT_USER_ERROR = 2

# (module, class): the errors a user can cause and fix; each message already says what is wrong
USER_ERRORS: tuple[tuple[str, str], ...] = (
    ("dspark.export.artifacts", "ArtifactError"),
    ("dspark.export.engine_dir", "BucketError"),
    ("dspark.export.lower", "ExportError"),
    ("dspark.models.config_fields", "CheckpointError"),
    ("dspark.models.config_fields", "IncompatibleDrafterError"),
    ("dspark.engines.export_source", "BuildError"),
    ("dspark.runtime.backend", "BackendUnavailable"),
    ("dspark.runtime.requests", "RequestError"),
    ("dspark.runtime.capacity", "CapacityError"),
    ("dspark.runtime.recovery.journal", "JournalError"),
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The user-error classes loaded so far (one not loaded cannot have been raised)."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)


def fail(ctx: click.Context, message: str) -> NoReturn:
    """Print `<prog>: error: <message>` as one line on stderr and exit 2."""
    line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    click.echo(f"{ctx.command_path}: error: {line}", err=True)
    ctx.exit(EXIT_USER_ERROR)


@contextmanager
def one_line_errors(ctx: click.Context) -> Iterator[None]:
    """Turn click errors (bad option values) and user errors raised inside into `fail`."""
    try:
        yield
    except click.ClickException as exc:
        fail(ctx, exc.format_message())
    except Exception as exc:
        if not isinstance(exc, user_error_types()):
            raise
        fail(ctx, str(exc))


class OneLineErrors(click.Command):
    """A click command under the policy, both while parsing its options and while it runs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with one_line_errors(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_errors(ctx):
            return super().invoke(ctx)
