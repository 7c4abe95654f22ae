"""The C API's refusals and lifecycle from plain C: a probe program (capi_probe/probe.c) built as a find_package(dspark)
consumer of the installed tree, run against the demo engine. Every bad call gives its status code and a clear
message, never a crash: bad engine paths and options, bad token ids, bad max_new_tokens, NULL pointers, small
buffers, unknown and released handles, and every call after dspark_close. Also: polling one token at a time
loses nothing, cancel ends a request, a callback gets exactly one last event (even from close), and 8 pthreads
submitting at once get Python's tokens. The same probe runs under AddressSanitizer + UBSan when that builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_capi
from test_capi import run_checked

from dspark.runtime.capi import bridge

# test_capi's session fixtures: one build of libdspark, one Runtime, one cache of expected tokens.
capi_build, demo_runtime, expected_tokens = test_capi.capi_build, test_capi.demo_runtime, test_capi.expected_tokens

PROBE_DIR = Path(__file__).with_name("capi_probe")  # probe.c and its CMakeLists.txt (a find_package consumer)

S = bridge.STATUS


def build_probe(tmp: Path, dspark_dir: Path, *flags: str) -> Path:
    """The probe as a find_package(dspark) consumer, with dspark_DIR pointing at `dspark_dir`."""
    run_checked(["cmake", "-S", str(PROBE_DIR), "-B", str(tmp / "build"), f"-Ddspark_DIR={dspark_dir}",
                 f"-DDSPARK_PYTHON_EXECUTABLE={sys.executable}", *flags])
    run_checked(["cmake", "--build", str(tmp / "build"), "-j2"])
    return tmp / "build" / "probe"


def run_probe(probe: Path, engine: Path, tmp: Path, env: dict | None = None) -> dict[str, str]:
    """name -> the rest of its output line ("<status> <message>" for calls)."""
    done = subprocess.run([str(probe), str(engine), str(tmp)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"probe crashed or failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "done", done.stdout[-2000:]
    return {name: rest for name, _, rest in (line.partition(" ") for line in lines[:-1])}


def status(results: dict[str, str], name: str) -> tuple[int, str]:
    code, _, message = results[name].partition(" ")
    return int(code), message


@pytest.fixture(scope="module")
def probe_results(capi_build, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    probe = build_probe(tmp, capi_build.prefix / "lib" / "cmake" / "dspark")
    return run_probe(probe, capi_build.engine, tmp)


REFUSALS = {  # name -> (status, words the message must hold)
    "cancel_before_open": ("UNKNOWN_HANDLE", "no engine was opened"),
    "open_null_out": ("INVALID_ARGUMENT", "engine"),
    "open_missing_dir": ("ARTIFACT", "/nonexistent/engine: is not a directory"),
    "open_not_an_engine": ("ARTIFACT", "export.json: is missing"),
    "open_bad_scheduler": ("INVALID_ARGUMENT", "scheduler mode 'bogus' is unknown"),
    "open_negative_slots": ("INVALID_ARGUMENT", "options.max_requests must be >= 0"),
    "open_small_struct": ("INVALID_ARGUMENT", "dspark_options.struct_size is 4"),
    "submit_out_of_vocab": ("REQUEST", "outside the vocabulary [0, 4096): [99999]"),
    "submit_negative_id": ("REQUEST", "outside the vocabulary [0, 4096): [-5]"),
    "submit_empty_prompt": ("REQUEST", "prompt is empty"),
    "submit_zero_max": ("REQUEST", "max_new_tokens must be >= 1, got 0"),
    "submit_negative_max": ("REQUEST", "max_new_tokens must be >= 1, got -4"),
    "submit_past_positions": ("REQUEST", "exceeds the model's max_position_embeddings"),
    "submit_past_slot": ("CAPACITY", ""),
    "submit_bad_temperature": ("REQUEST", "temperature must be a finite number >= 0, got -1"),
    "submit_nan_temperature": ("REQUEST", "temperature must be a finite number >= 0, got nan"),
    "submit_null_params": ("INVALID_ARGUMENT", "params is NULL"),
    "submit_no_prompt": ("INVALID_ARGUMENT", "give params.prompt_ids or params.prompt_text"),
    "submit_bad_utf8": ("REQUEST", "prompt_text is not valid UTF-8"),
    "submit_null_stop_ids": ("INVALID_ARGUMENT", "params.stop_ids is NULL but n_stop_ids is 2"),
    "poll_null_out": ("INVALID_ARGUMENT", "tokens must hold at least one token"),
    "poll_released": ("UNKNOWN_HANDLE", "has no request"),
    "release_twice": ("UNKNOWN_HANDLE", "has no request"),
    "stats_unknown_request": ("UNKNOWN_HANDLE", "has no request 999"),
    "poll_unknown_engine": ("UNKNOWN_HANDLE", "no engine 12345"),
    "tokenize_small": ("BUFFER_TOO_SMALL", "ids holds 1"),
    "detokenize_small": ("BUFFER_TOO_SMALL", "text holds 2"),
    "detokenize_bad_id": ("REQUEST", "outside the vocabulary"),
    **{name: ("CLOSED", "is closed") for name in (
        "submit_after_close", "poll_after_close", "wait_after_close", "cancel_after_close", "stats_after_close",
        "release_after_close", "info_after_close", "tokenize_after_close")},
    "close_twice": ("CLOSED", "engine 1 is closed"),
}
SUCCEEDS = ("open", "submit", "poll_after_end", "stats", "release", "submit_long", "cancel", "stats_cancelled",
            "submit_to_release", "release_under_waiter",
            "tokenize", "detokenize", "info", "submit_callback", "submit_then_close", "close")


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusal_gives_status_and_message(probe_results, name):
    code, words = REFUSALS[name]
    assert status(probe_results, name)[0] == S[code], f"{name}: {probe_results[name]}"
    assert words in status(probe_results, name)[1]


def test_good_calls_succeed(probe_results):
    assert {name: status(probe_results, name) for name in SUCCEEDS} == dict.fromkeys(SUCCEEDS, (0, ""))
    assert probe_results["version"] == "1"
    assert probe_results["status_name"] == "DSPARK_ERR_CLOSED"


def tokens_of(results: dict[str, str], name: str) -> list[int]:
    code, rest = status(results, name)
    assert code == 0, results[name]
    return [int(t) for t in rest.split()]


def test_one_token_at_a_time_and_callbacks_lose_nothing(probe_results, expected_tokens):
    expected = expected_tokens([1, 2, 3], 24)
    assert tokens_of(probe_results, "tokens_cap1") == expected
    assert tokens_of(probe_results, "callback_tokens") == expected
    assert probe_results["callback_finish"] == "1 1"  # exactly one last event; finish reason length
    assert probe_results["poll_after_end_values"] == "0 1"  # nothing more, finished
    assert probe_results["empty_waits"] == "0"  # dspark_wait(-1) returns only with tokens or at the end
    assert probe_results["cap_violations"] == "0"  # never more tokens than cap


def test_stats_describe_the_request(probe_results, demo_runtime):
    values = probe_results["stats_values"].split()
    finished, reason, prompt, generated, rounds, verified = map(int, values[:6])
    accepted, ttft, total = map(float, values[6:])
    assert (finished, reason, prompt, generated) == (1, 1, 3, 24)
    assert 1 <= rounds <= 24 and verified >= rounds
    assert 1.0 <= accepted <= demo_runtime.info.block_size + 1
    # prefill commits the first token, each round the rest; accepted × rounds is a whole number of tokens, which
    # the probe's printf("%f") of the mean leaves within 5e-7 × rounds of it (23/7 printed: 22.999998 for 23)
    assert round(accepted * rounds) + 1 >= generated
    assert 0 < ttft <= total


def test_cancel_and_close_end_requests(probe_results):
    finished, reason, n = map(int, probe_results["cancelled_values"].split())
    assert (finished, reason) == (1, 3) and n < 100
    assert probe_results["close_finish"] == "1 4"  # the last event came before dspark_close returned


def test_requests_in_one_registry_bucket_keep_their_tokens(probe_results, expected_tokens):
    a, b = map(int, probe_results["far_apart_ids"].split())
    assert b - a == 1024
    assert tokens_of(probe_results, "far_apart_first") == expected_tokens([1, 2, 3], 8)
    assert tokens_of(probe_results, "far_apart_second") == expected_tokens([5, 6, 7], 8)


def test_release_wakes_a_waiting_thread(probe_results):
    """A thread blocked in dspark_wait(-1) on a request another thread releases comes back: finished (the
    release ended it) or, if it was between two waits, DSPARK_ERR_UNKNOWN_HANDLE; never a hang."""
    finished, code = map(int, probe_results["released_waiter"].split())
    assert (finished, code) in ((1, 0), (0, S["UNKNOWN_HANDLE"]))


def test_eight_pthreads_get_python_tokens(probe_results, expected_tokens):
    for t in range(8):
        for k in range(3):
            assert tokens_of(probe_results, f"thread_{t}_{k}") == expected_tokens([t + 1, k + 2, 7], 16), (t, k)


def test_text_round_trip_and_info(probe_results, demo_runtime):
    assert probe_results["tokenize_needed"] == str(len(demo_runtime.encode("def parse_args(")))
    assert probe_results["detokenize_text"] == demo_runtime.decode(demo_runtime.encode("def parse_args("))
    eos = demo_runtime.info.eos_token_ids
    assert probe_results["info_values"].split() == ["4096", "8", "128", str(len(eos)), str(eos[0])]


def test_probe_under_address_sanitizer(capi_build, tmp_path_factory, expected_tokens):
    """libdspark and the probe built with -fsanitize=address,undefined (leak checks off: the embedded interpreter
    is never finalized, by design); the whole probe must pass and ASan/UBSan must stay silent."""
    tmp = tmp_path_factory.mktemp("asan")
    from dspark.tools.capi import build

    try:
        prefix = build(tmp / "install", sanitize="address,undefined", cmake_args=("-DDSPARK_BUILD_EXAMPLES=OFF",))
    except Exception as exc:
        pytest.skip(f"no sanitizer build here: {str(exc)[:300]}")
    probe = build_probe(tmp, prefix / "lib" / "cmake" / "dspark", "-DCMAKE_C_FLAGS=-fsanitize=address,undefined "
                                                                  "-fno-omit-frame-pointer")
    env = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    results = run_probe(probe, capi_build.engine, tmp, env)
    assert status(results, "close") == (0, "")
    assert tokens_of(results, "tokens_cap1") == expected_tokens([1, 2, 3], 24)
    assert tokens_of(results, "thread_7_2") == expected_tokens([8, 4, 7], 16)
