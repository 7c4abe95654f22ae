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
