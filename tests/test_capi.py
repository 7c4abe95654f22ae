"""The C API end to end: libdspark and the example service (dspark_generate) built with cmake and the system
compiler, run against the bundled demo engine. Greedy outputs equal the Python API's token for token (polling,
callbacks, text); 8 C++ client threads lose nothing; find_package(dspark) works from the package folder and
refuses a python without this dspark; the library also runs inside a Python process (ctypes), on that
interpreter. Refusals and the lifecycle, from C: test_capi_errors.py."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark.runtime.capi import CAPI_DIR, bridge

PROMPTS = [[1, 2, 3], [67, 24, 319, 84, 473], [5, 6, 7, 8], [100, 200, 300], [42]]
_BUILD: dict[str, object] = {}  # one build per session, shared with test_capi_errors.py


@dataclass
class CapiBuild:
    prefix: Path  # the installed tree: bin/dspark_generate, lib/libdspark.so, include/, lib/cmake/dspark
    engine: Path  # the demo engine

    @property
    def generate(self) -> Path:
        return self.prefix / "bin" / "dspark_generate"


def run_checked(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command[:3])} failed:\n{(done.stdout + done.stderr)[-3000:]}"
    return done


@pytest.fixture(scope="session")
def capi_build(tmp_path_factory) -> CapiBuild:
    from dspark.tools.capi import build, toolchain_problem
    from dspark.tools.demo_engine import demo_engine_dir

    problem = toolchain_problem()
    if problem:
        pytest.skip(f"the C API cannot be built here: {problem}")
    if "build" not in _BUILD:
        prefix = build(tmp_path_factory.mktemp("capi"), cmake_args=("-DDSPARK_WERROR=ON",))
        _BUILD["build"] = CapiBuild(prefix, demo_engine_dir(show_progress=False))
    return _BUILD["build"]


@pytest.fixture(scope="session")
def demo_runtime(capi_build):
    from dspark.runtime.api import Runtime

    if "runtime" not in _BUILD:
        _BUILD["runtime"] = Runtime.load(capi_build.engine)
    return _BUILD["runtime"]


@pytest.fixture(scope="session")
def expected_tokens(demo_runtime):
    """(prompt ids, max_new_tokens) -> the Python API's greedy tokens."""
    cache = _BUILD.setdefault("expected", {})

    def expected(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = demo_runtime.generate([prompt], max_new_tokens=max_new_tokens)[0].tokens
        return cache[key]
    return expected


def generate(capi_build: CapiBuild, lines: list[str], *args: str, code: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([str(capi_build.generate), str(capi_build.engine), *args], input="".join(
        f"{line}\n" for line in lines), capture_output=True, text=True, timeout=120)
    assert done.returncode == code, f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def ids_lines(stdout: str) -> list[list[int]]:
    return [[int(t) for t in line.split()] for line in stdout.splitlines()]


def test_header_and_bridge_agree_on_codes():
    header = (CAPI_DIR / "dspark.h").read_text()
    statuses = dict(re.findall(r"DSPARK_(OK|ERR_\w+) = (\d+)", header))
    assert {name.removeprefix("ERR_"): int(v) for name, v in statuses.items()} == bridge.STATUS
    reasons = dict(re.findall(r"DSPARK_FINISH_(\w+) = (\d+)", header))
    assert {"" if k == "NONE" else k.lower(): int(v) for k, v in reasons.items()} == bridge.FINISH
    assert re.search(r"#define DSPARK_API_VERSION 1\b", header)


def test_tool_prints_where_the_sources_are():
    for flag, needed in (("--cmake-dir", "dsparkConfig.cmake"), ("--include-dir", "dspark.hpp")):
        out = run_checked([sys.executable, "-m", "dspark.tools.capi", flag]).stdout.strip()
        assert (Path(out) / needed).is_file()


@pytest.mark.parametrize("mode", [(), ("--callback",)], ids=["poll", "callback"])
def test_greedy_stream_equals_python(capi_build, expected_tokens, mode):
    done = generate(capi_build, [" ".join(map(str, p)) for p in PROMPTS], "--ids", "--max-new-tokens", "40", *mode)
    assert ids_lines(done.stdout) == [expected_tokens(p, 40) for p in PROMPTS]


def test_text_stream_equals_python(capi_build, demo_runtime):
    prompts = ["def parse_args(", "class Server:"]
    done = generate(capi_build, prompts, "--max-new-tokens", "48")
    expected = [demo_runtime.generate(p, max_new_tokens=48)[0].text for p in prompts]
    assert done.stdout == "".join(f"{text}\n" for text in expected)


@pytest.mark.parametrize("mode", [(), ("--callback",)], ids=["poll", "callback"])
def test_eight_client_threads_lose_nothing(capi_build, expected_tokens, mode):
    prompts = [[t + 1, k + 10, 3 * t + k + 5] for k in range(4) for t in range(8)]  # thread t: lines t, t+8, ...
    done = generate(capi_build, [" ".join(map(str, p)) for p in prompts], "--ids", "--threads", "8",
                    "--max-new-tokens", "24", *mode)
    assert ids_lines(done.stdout) == [expected_tokens(p, 24) for p in prompts]
    summary = done.stderr.strip().splitlines()[-1]
    assert "threads=8 requests=32 tokens=768 " in summary


def test_example_reports_refusals_and_goes_on(capi_build, expected_tokens):
    done = generate(capi_build, ["1 2 99999", "3 4 5", ""], "--ids", "--max-new-tokens", "8", code=1)  # bad max: probe
    lines = done.stdout.splitlines()
    assert lines[0] == "error: DSPARK_ERR_REQUEST: prompt has token ids outside the vocabulary [0, 4096): [99999]"
    assert [int(t) for t in lines[1].split()] == expected_tokens([3, 4, 5], 8)
    assert lines[2] == "error: DSPARK_ERR_REQUEST: prompt is empty: give at least one token id"
    done = subprocess.run([str(capi_build.generate), "/nonexistent/engine"], input="1\n", capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "DSPARK_ERR_ARTIFACT: /nonexistent/engine: is not a directory" in done.stderr


CONSUMER_C = """#include <dspark.h>
#include <stdio.h>
int main(void) { printf("api %d\\n", dspark_version()); return dspark_version() == DSPARK_API_VERSION ? 0 : 1; }
"""


def consumer(tmp: Path, dspark_dir: str, python: str) -> subprocess.CompletedProcess:
    (tmp / "main.c").write_text(CONSUMER_C)
    (tmp / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.18)\nproject(consumer C)\n"
                                        "find_package(dspark REQUIRED)\nadd_executable(consumer main.c)\n"
                                        "target_link_libraries(consumer PRIVATE dspark::dspark)\n")
    return subprocess.run(["cmake", "-S", str(tmp), "-B", str(tmp / "build"), f"-Ddspark_DIR={dspark_dir}",
                           f"-DDSPARK_PYTHON_EXECUTABLE={python}"], capture_output=True, text=True)


def test_find_package_from_the_package_folder(capi_build, tmp_path):
    """-Ddspark_DIR=$(python -m dspark.tools.capi --cmake-dir): libdspark is built from the package's sources."""
    cmake_dir = run_checked([sys.executable, "-m", "dspark.tools.capi", "--cmake-dir"]).stdout.strip()
    assert consumer(tmp_path, cmake_dir, sys.executable).returncode == 0
    run_checked(["cmake", "--build", str(tmp_path / "build"), "-j2"])
    assert run_checked([str(tmp_path / "build" / "consumer")]).stdout == "api 1\n"


def test_find_package_refuses_a_python_without_this_dspark(capi_build, tmp_path):
    done = consumer(tmp_path, str(CAPI_DIR), "/bin/true")
    assert done.returncode != 0
    assert "does not import the dspark at" in done.stdout + done.stderr


IN_PROCESS = textwrap.dedent("""
    import ctypes, sys
    from dspark.runtime.api import Runtime
    lib = ctypes.CDLL(sys.argv[1])
    class Params(ctypes.Structure):
        _fields_ = [("struct_size", ctypes.c_uint32), ("prompt_ids", ctypes.POINTER(ctypes.c_int32)),
                    ("n_prompt_ids", ctypes.c_size_t), ("prompt_text", ctypes.c_char_p),
                    ("max_new_tokens", ctypes.c_int32), ("temperature", ctypes.c_double), ("seed", ctypes.c_int64),
                    ("stop_ids", ctypes.c_void_p), ("n_stop_ids", ctypes.c_size_t), ("stop_strings", ctypes.c_void_p),
                    ("n_stop_strings", ctypes.c_size_t), ("callback", ctypes.c_void_p), ("user_data", ctypes.c_void_p)]
    engine, request = ctypes.c_uint64(), ctypes.c_uint64()
    assert lib.dspark_open(sys.argv[2].encode(), None, ctypes.byref(engine)) == 0
    params = Params()
    lib.dspark_request_params_init(ctypes.byref(params))
    params.prompt_text, params.max_new_tokens = b"import os", 32
    assert lib.dspark_submit(engine, ctypes.byref(params), ctypes.byref(request)) == 0
    out, got, done, tokens = (ctypes.c_int32 * 64)(), ctypes.c_size_t(), ctypes.c_int(), []
    while not done.value:
        assert lib.dspark_wait(engine, request, out, 64, ctypes.byref(got), ctypes.byref(done), -1) == 0
        tokens += out[: got.value]
    assert lib.dspark_close(engine) == 0
    print(tokens == Runtime.load(sys.argv[2]).generate("import os", max_new_tokens=32)[0].tokens)
""")


def test_library_inside_a_python_process_uses_that_interpreter(capi_build):
    lib = next((capi_build.prefix / "lib").glob("libdspark.so*"))
    done = run_checked([sys.executable, "-c", IN_PROCESS, str(lib), str(capi_build.engine)], timeout=300)
    assert done.stdout.strip() == "True"
