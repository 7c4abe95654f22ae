"""The C API's refusals and lifecycle from plain C: a probe program (below) built as a find_package(dspark)
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

PROBE_C = r"""
#include <dspark.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static void show(const char *name, dspark_status s) {
    printf("%s %d %s\n", name, (int)s, s == DSPARK_OK ? "" : dspark_last_error());
    fflush(stdout);
}
#define SHOW(name, call) show(name, (call))

static const char *engine_dir;
static dspark_engine e;

static dspark_status submit(const int32_t *ids, size_t n, int max_new, double temperature, dspark_request *r) {
    dspark_request_params p;
    dspark_request_params_init(&p);
    p.prompt_ids = ids; p.n_prompt_ids = n; p.max_new_tokens = max_new; p.temperature = temperature;
    return dspark_submit(e, &p, r);
}

static void print_tokens(const char *name, const int32_t *t, size_t n) { /* one line, one write: threads call it */
    char line[8192];
    int at = snprintf(line, sizeof line, "%s 0", name);
    for (size_t i = 0; i < n && at < (int)sizeof line - 16; i++)
        at += snprintf(line + at, sizeof line - at, " %d", t[i]);
    printf("%s\n", line);
    fflush(stdout);
}

static int empty_waits;    /* dspark_wait(-1) calls that came back with neither tokens nor the end */
static int cap_violations; /* calls that said they gave more tokens than asked for */

/* Every token of r, with dspark_wait and a buffer of `cap`. */
static size_t collect(dspark_request r, int32_t *out, size_t cap, size_t chunk, dspark_status *last) {
    size_t total = 0, n = 0;
    int finished = 0;
    while (!finished && total < cap) {
        *last = dspark_wait(e, r, out + total, chunk < cap - total ? chunk : cap - total, &n, &finished, -1);
        if (*last != DSPARK_OK) break;
        if (!n && !finished) __atomic_add_fetch(&empty_waits, 1, __ATOMIC_RELAXED);
        if (n > chunk) __atomic_add_fetch(&cap_violations, 1, __ATOMIC_RELAXED);
        total += n;
    }
    return total;
}

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int events, finished_events, reason;
    size_t n;
    int32_t t[512];
} box_t;
static void on_tokens(const dspark_event *ev, void *user) {
    box_t *b = user;
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < ev->n_tokens && b->n < 512; i++) b->t[b->n++] = ev->tokens[i];
    b->events++;
    if (ev->finished) { b->finished_events++; b->reason = ev->finish_reason; }
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

typedef struct { dspark_request r; int finished, status; } waiter_t;
static void *wait_to_end(void *arg) {
    waiter_t *w = arg;
    int32_t out[512];
    size_t n;
    while (!w->finished && w->status == DSPARK_OK)
        w->status = dspark_wait(e, w->r, out, 512, &n, &w->finished, -1);
    return NULL;
}

static void *client(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int k = 0; k < 3; k++) {
        int32_t prompt[3] = {t + 1, k + 2, 7}, out[64];
        dspark_request r;
        dspark_status s = submit(prompt, 3, 16, 0.0, &r), last = s;
        size_t n = s == DSPARK_OK ? collect(r, out, 64, 64, &last) : 0;
        char name[32];
        snprintf(name, sizeof name, "thread_%d_%d", t, k);
        if (last != DSPARK_OK) show(name, last);
        else print_tokens(name, out, n);
        dspark_release(e, r);
    }
    return NULL;
}

/* Two live requests whose ids are 1024 apart (the registry's bucket count: the same bucket) keep their tokens. */
static void far_apart(void) {
    int32_t first[3] = {1, 2, 3}, second[3] = {5, 6, 7}, filler[1] = {9}, out[64];
    dspark_request a, b, batch[8];
    dspark_status last = submit(first, 3, 8, 0.0, &a);
    while (last == DSPARK_OK) { /* fillers, 8 at a time (the engine's slots), up to id a + 1023 */
        int k = 0;
        while (k < 8 && last == DSPARK_OK && (k == 0 || batch[k - 1] + 1 < a + 1024))
            last = submit(filler, 1, 1, 0.0, &batch[k++]);
        for (int j = 0; j < k; j++) {
            collect(batch[j], out, 64, 64, &last);
            dspark_release(e, batch[j]);
        }
        if (batch[k - 1] + 1 == a + 1024) break;
    }
    if (last != DSPARK_OK || submit(second, 3, 8, 0.0, &b) != DSPARK_OK) {
        show("far_apart", DSPARK_ERR_INTERNAL);
        return;
    }
    printf("far_apart_ids %llu %llu\n", (unsigned long long)a, (unsigned long long)b);
    print_tokens("far_apart_first", out, collect(a, out, 64, 64, &last));
    print_tokens("far_apart_second", out, collect(b, out, 64, 64, &last));
    dspark_release(e, a);
    dspark_release(e, b);
}

int main(int argc, char **argv) {
    engine_dir = argv[1];
    dspark_request r;
    int32_t ids[] = {1, 2, 3}, out[512];
    size_t n;
    int finished;
    printf("version %d\n", dspark_version());
    SHOW("cancel_before_open", dspark_cancel(1, 1));
    SHOW("open_null_out", dspark_open(engine_dir, NULL, NULL));
    SHOW("open_missing_dir", dspark_open("/nonexistent/engine", NULL, &e));
    SHOW("open_not_an_engine", dspark_open(argv[2], NULL, &e));
    dspark_options o;
    dspark_options_init(&o);
    o.scheduler = "bogus";
    SHOW("open_bad_scheduler", dspark_open(engine_dir, &o, &e));
    dspark_options_init(&o);
    o.max_requests = -1;
    SHOW("open_negative_slots", dspark_open(engine_dir, &o, &e));
    dspark_options_init(&o);
    o.struct_size = 4;
    SHOW("open_small_struct", dspark_open(engine_dir, &o, &e));
    dspark_options_init(&o);
    o.max_requests = 8; o.max_seq_len = 128;
    SHOW("open", dspark_open(engine_dir, &o, &e));

    int32_t out_of_vocab[] = {1, 99999}, negative[] = {-5};
    SHOW("submit_out_of_vocab", submit(out_of_vocab, 2, 8, 0.0, &r));
    SHOW("submit_negative_id", submit(negative, 1, 8, 0.0, &r));
    SHOW("submit_empty_prompt", submit(ids, 0, 8, 0.0, &r));
    SHOW("submit_zero_max", submit(ids, 3, 0, 0.0, &r));
    SHOW("submit_negative_max", submit(ids, 3, -4, 0.0, &r));
    SHOW("submit_past_positions", submit(ids, 3, 100000, 0.0, &r));
    SHOW("submit_past_slot", submit(ids, 3, 200, 0.0, &r));
    SHOW("submit_bad_temperature", submit(ids, 3, 8, -1.0, &r));
    SHOW("submit_nan_temperature", submit(ids, 3, 8, NAN, &r));
    SHOW("submit_null_params", dspark_submit(e, NULL, &r));
    dspark_request_params p;
    dspark_request_params_init(&p);
    SHOW("submit_no_prompt", dspark_submit(e, &p, &r));
    p.prompt_text = "\xff\xfe not utf-8";
    SHOW("submit_bad_utf8", dspark_submit(e, &p, &r));
    p.prompt_text = "def f(";
    p.n_stop_ids = 2;
    SHOW("submit_null_stop_ids", dspark_submit(e, &p, &r));

    SHOW("submit", submit(ids, 3, 24, 0.0, &r));
    dspark_status last;
    n = collect(r, out, 512, 1, &last); /* one token per call */
    print_tokens("tokens_cap1", out, n);
    SHOW("poll_after_end", dspark_poll(e, r, out, 512, &n, &finished));
    printf("poll_after_end_values %zu %d\n", n, finished);
    dspark_request_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    SHOW("stats", dspark_request_stats_get(e, r, &st));
    printf("stats_values %d %d %d %d %d %d %f %f %f\n", st.finished, st.finish_reason, st.prompt_tokens,
           st.generated_tokens, st.rounds, st.verified_tokens, st.mean_accepted_length, st.time_to_first_token_s,
           st.total_s);
    SHOW("poll_null_out", dspark_poll(e, r, NULL, 0, &n, &finished));
    SHOW("release", dspark_release(e, r));
    SHOW("poll_released", dspark_poll(e, r, out, 512, &n, &finished));
    SHOW("release_twice", dspark_release(e, r));
    SHOW("stats_unknown_request", dspark_request_stats_get(e, 999, &st));
    SHOW("poll_unknown_engine", dspark_poll(12345, 1, out, 512, &n, &finished));

    SHOW("submit_long", submit(ids, 3, 100, 0.0, &r));
    SHOW("cancel", dspark_cancel(e, r));
    n = collect(r, out, 512, 512, &last);
    SHOW("stats_cancelled", dspark_request_stats_get(e, r, &st));
    printf("cancelled_values %d %d %zu\n", st.finished, st.finish_reason, n);
    dspark_release(e, r);

    /* Released while another thread waits on it: that thread comes back (finished), it does not hang. */
    SHOW("submit_to_release", submit(ids, 3, 100, 0.0, &r));
    waiter_t waiter = {r, 0, 0};
    pthread_t waiting;
    pthread_create(&waiting, NULL, wait_to_end, &waiter);
    struct timespec pause = {0, 20 * 1000000L};
    nanosleep(&pause, NULL);
    SHOW("release_under_waiter", dspark_release(e, r));
    pthread_join(waiting, NULL);
    printf("released_waiter %d %d\n", waiter.finished, waiter.status);

    SHOW("tokenize_small", dspark_tokenize(e, "def parse_args(", out, 1, &n));
    printf("tokenize_needed %zu\n", n);
    SHOW("tokenize", dspark_tokenize(e, "def parse_args(", out, 512, &n));
    char text[256];
    size_t len;
    SHOW("detokenize_small", dspark_detokenize(e, out, n, text, 2, &len));
    SHOW("detokenize", dspark_detokenize(e, out, n, text, sizeof text, &len));
    printf("detokenize_text %s\n", text);
    SHOW("detokenize_bad_id", dspark_detokenize(e, out_of_vocab, 2, text, sizeof text, &len));
    dspark_engine_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    SHOW("info", dspark_engine_info_get(e, &info));
    printf("info_values %d %d %d %d %d\n", info.vocab_size, info.max_requests, info.max_seq_len,
           info.n_eos_token_ids, info.eos_token_ids[0]);

    box_t box = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, {0}};
    dspark_request_params_init(&p);
    p.prompt_ids = ids; p.n_prompt_ids = 3; p.max_new_tokens = 24; p.callback = on_tokens; p.user_data = &box;
    SHOW("submit_callback", dspark_submit(e, &p, &r));
    pthread_mutex_lock(&box.mu);
    while (!box.finished_events) pthread_cond_wait(&box.cv, &box.mu);
    pthread_mutex_unlock(&box.mu);
    print_tokens("callback_tokens", box.t, box.n);
    printf("callback_finish %d %d\n", box.finished_events, box.reason);
    dspark_release(e, r);

    pthread_t threads[8];
    for (int t = 0; t < 8; t++) pthread_create(&threads[t], NULL, client, (void *)(intptr_t)t);
    for (int t = 0; t < 8; t++) pthread_join(threads[t], NULL);

    far_apart();

    box_t open_box = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, {0}};
    p.user_data = &open_box;
    p.max_new_tokens = 100;
    SHOW("submit_then_close", dspark_submit(e, &p, &r));
    SHOW("close", dspark_close(e));
    printf("close_finish %d %d\n", open_box.finished_events, open_box.reason); /* delivered before close returned */
    SHOW("submit_after_close", submit(ids, 3, 8, 0.0, &r));
    SHOW("poll_after_close", dspark_poll(e, r, out, 512, &n, &finished));
    SHOW("wait_after_close", dspark_wait(e, r, out, 512, &n, &finished, -1));
    SHOW("cancel_after_close", dspark_cancel(e, r));
    SHOW("stats_after_close", dspark_request_stats_get(e, r, &st));
    SHOW("release_after_close", dspark_release(e, r));
    SHOW("info_after_close", dspark_engine_info_get(e, &info));
    SHOW("tokenize_after_close", dspark_tokenize(e, "x", out, 512, &n));
    SHOW("close_twice", dspark_close(e));
    printf("status_name %s\n", dspark_status_name(DSPARK_ERR_CLOSED));
    printf("empty_waits %d\n", empty_waits);
    printf("cap_violations %d\n", cap_violations);
    printf("done\n");
    return 0;
}
"""

CONSUMER = """cmake_minimum_required(VERSION 3.18)
project(dspark_probe C)
find_package(dspark REQUIRED)
find_package(Threads REQUIRED)
add_executable(probe probe.c)
target_link_libraries(probe PRIVATE dspark::dspark Threads::Threads m)
set_target_properties(probe PROPERTIES C_STANDARD 11 BUILD_RPATH_USE_LINK_PATH ON)
"""

S = bridge.STATUS


def build_probe(tmp: Path, dspark_dir: Path, *flags: str) -> Path:
    """The probe as a find_package(dspark) consumer, with dspark_DIR pointing at `dspark_dir`."""
    (tmp / "probe.c").write_text(PROBE_C)
    (tmp / "CMakeLists.txt").write_text(CONSUMER)
    run_checked(["cmake", "-S", str(tmp), "-B", str(tmp / "build"), f"-Ddspark_DIR={dspark_dir}",
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
    assert accepted * rounds + 1 >= generated - 1e-6  # prefill commits the first token, each round the rest
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
