"""The bundled demo pair as a ready engine: exported and built once into a user cache directory.

`dspark generate` without `--engine` uses it. The cache key is the demo's files (names, sizes,
modification times) plus the dspark version, so a changed demo or dspark builds a new engine;
a build that was interrupted lacks its completion marker and is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import click

# found, not imported: dspark.models imports torch, and `dspark serve`'s front end runs without it
DEMO_DIR = Path(importlib.util.find_spec("dspark.models").submodule_search_locations[0]).resolve() / "demo"
DEMO_TARGET, DEMO_DRAFTER = DEMO_DIR / "target", DEMO_DIR / "dspark"
COMPLETE = "BUILD_COMPLETE"


def cache_root() -> Path:
    """$DSPARK_CACHE, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark."""
    if os.environ.get("DSPARK_CACHE"):
        return Path(os.environ["DSPARK_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark"


def checkpoint_key(*folders: Path) -> str:
    """Short digest of every file's name, size and mtime in the folders: a cache key that costs
    a few stat calls, not a read of the weights. The exporter's and builders' own sources are in
    it too, so an engine cached by an older dspark (other graphs, another engine.json) is rebuilt."""
    digest = hashlib.sha256(metadata.version("dspark").encode())
    package = Path(__file__).resolve().parents[1]
    for source in sorted([*(package / "export").glob("*.py"), *(package / "engines").glob("*.py")]):
        digest.update(source.read_bytes())
    for folder in folders:
        for path in sorted(folder.resolve().iterdir()):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def cached_engine(target_dir: Path, drafter_dir: Path, root: Path, show_progress: bool = True,
                  threads: int = 1, calibration: Sequence[Sequence[int]] | None = None) -> Path:
    """root/engine: the pair exported to root/export and built (ONNX Runtime at `threads` intra-op
    threads, measured SPS table; with `calibration` prompts, its confidences fitted by STS on the
    engine's own draft rounds over them) unless root already holds a completed build."""
    engine = root / "engine"
    if (root / COMPLETE).is_file():
        return engine
    from dspark.engines.build import BuildOptions, build_engine
    from dspark.export.pipeline import export_pair

    def say(message: str) -> None:
        if show_progress:
            click.echo(message, err=True)

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    say(f"dspark: exporting and building an engine in {root} (once) ...")
    export_pair(target_dir, drafter_dir, root / "export", check=False, show_progress=show_progress)
    data = None
    if calibration is not None:
        data = root / "calibration.jsonl"
        data.write_text("".join(json.dumps({"ids": list(ids)}) + "\n" for ids in calibration))
    build_engine(root / "export", engine, BuildOptions(threads=threads), calibrate_data=data,
                 progress=lambda message: say(f"  {message}"))
    (root / COMPLETE).write_text("ok\n")
    return engine


def demo_engine_dir(show_progress: bool = True) -> Path:
    """The demo engine's directory, building it first if this machine has none yet."""
    if not (DEMO_TARGET / "config.json").is_file() or not (DEMO_DRAFTER / "config.json").is_file():
        raise click.ClickException(f"the bundled demo pair is missing from {DEMO_DIR}; reinstall dspark")
    root = cache_root() / f"demo-{checkpoint_key(DEMO_TARGET, DEMO_DRAFTER)}"
    return cached_engine(DEMO_TARGET, DEMO_DRAFTER, root, show_progress)
