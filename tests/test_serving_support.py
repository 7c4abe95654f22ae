"""Shared pieces of the serving tests (no tests here): the golden tiny pair with a small byte-level BPE
tokenizer and a chat template, a Runtime on it, and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import golden_path

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.prefix_scheduler import SchedulerConfig

# A cost model under which Algorithm 1 admits some drafts and refuses others (as in test_runtime_batching).
COST = StepCostModel(intercept=1e-3, per_request=2e-4, per_token=4e-4)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    return parser.parse_args(argv)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "import os\nimport sys\n\nclass Server:\n    def __init__(self, host, port):\n        self.host = host\n",
    "for i in range(10):\n    print(i, i * i)\nwhile True:\n    break\n# comments, numbers 12345 and é ü ←",
]


def write_tokenizer(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 400) -> None:
    """A byte-level BPE tokenizer (ids < the golden pair's 512) trained in milliseconds on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict = {"eos_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_pair(root: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> tuple[Path, Path]:
    """The golden qwen3-tiny-vanilla target (with a tokenizer) and drafter, under root."""
    target = root / "target"
    shutil.copytree(golden_path("qwen3-tiny-vanilla", "target"), target)
    write_tokenizer(target, chat_template=chat_template)
    return target, golden_path("qwen3-tiny-vanilla", "drafter")


def tiny_opener(root: Path, *, scheduler: str = "dspark", max_requests: int = 64, max_seq_len: int = 256,
                chat_template: str | None = CHAT_TEMPLATE) -> Callable[[], Runtime]:
    """A picklable call that opens a Runtime on the tiny pair (written under root now): what a ProcessService
    runs in its engine process, and what tiny_runtime calls here."""
    target, drafter = tiny_pair(root, chat_template=chat_template)
    # live_cost off: a cost model learnt from timed steps makes the dspark scheduler's budgets, and so a sampled
    # request's tokens, depend on timing; the tests compare sampled outputs across runs by seed.
    options = RuntimeOptions(scheduler=SchedulerConfig(scheduler), max_requests=max_requests, max_seq_len=max_seq_len,
                             live_cost=False)
    return functools.partial(Runtime.from_checkpoints, target, drafter, options, cost_model=COST)


def loop_breaking_runtime(open_runtime: Callable[[], Runtime], marker: Path) -> Runtime:
    """open_runtime(), whose first engine's results hand-off raises once `marker` does not exist yet (then
    creates it): a bug in the service's loop outside any step, in the first engine process only."""
    runtime = open_runtime()
    engine = runtime.engine
    if marker.exists():
        return runtime

    def breaking_engine(*args: Any, **kwargs: Any) -> Any:
        made = engine(*args, **kwargs)
        take = made.take_finished

        def take_finished() -> Any:
            if made._step >= 2 and not marker.exists():
                marker.touch()
                raise RuntimeError("a bug in the loop")
            return take()

        made.take_finished = take_finished
        return made

    runtime.engine = breaking_engine
    return runtime


def tiny_runtime(root: Path, **options: Any) -> Runtime:
    return tiny_opener(root, **options)()


@contextlib.contextmanager
def engine_service(kind: str, runtime: Runtime, open_runtime: Callable[[], Runtime], **service_options: Any
                   ) -> Iterator[Any]:
    """kind "thread": the EngineService over `runtime` in this process; "process": a ProcessService that opens
    the same pair (`open_runtime`) in an engine process of its own."""
    if kind == "process":
        from dspark.runtime.serving.process_service import ProcessService

        with ProcessService(open_runtime, **service_options) as service:
            yield service
    else:
        from dspark.runtime.serving.service import EngineService

        with EngineService(runtime, **service_options) as service:
            yield service


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def running_server(app, *, start_timeout: float = 20.0) -> Iterator[str]:
    """`app` under uvicorn in a thread on a free loopback port; yields its base URL; shut down at exit."""
    import uvicorn

    sock = free_socket()
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            backlog=2048, limit_concurrency=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    host, port = sock.getsockname()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
