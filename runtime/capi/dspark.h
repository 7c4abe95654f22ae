/* dspark C API: the dspark runtime (Python) embedded behind a small, stable C ABI.
 *
 * One engine = one model pair (an engine or export directory) with one decode loop running in its own
 * thread (dspark.runtime.serving.EngineService); every client shares its continuous batching.
 *
 *   dspark_engine e;  dspark_request r;  dspark_options o;  dspark_request_params p;
 *   dspark_options_init(&o);  o.max_requests = 64;
 *   if (dspark_open("build/engine", &o, &e) != DSPARK_OK) puts(dspark_last_error());
 *   dspark_request_params_init(&p);  p.prompt_ids = ids;  p.n_prompt_ids = n;  p.max_new_tokens = 64;
 *   dspark_submit(e, &p, &r);
 *   int32_t out[256];  size_t got;  int finished = 0;
 *   while (!finished && dspark_wait(e, r, out, 256, &got, &finished, -1) == DSPARK_OK) use(out, got);
 *   dspark_release(e, r);  dspark_close(e);
 *
 * Rules every function keeps:
 * - It returns a dspark_status; on anything but DSPARK_OK, dspark_last_error() (this thread's) says why
 *   in one line. No Python exception and no C++ exception ever crosses this ABI.
 * - It is safe from any thread, several at once. The first dspark_open starts the interpreter when the
 *   process has none (the Python that dspark was built against, or $DSPARK_PYTHON), and then releases
 *   the GIL; inside a Python process (e.g. loaded with ctypes) it uses the running interpreter. Each
 *   request's tokens are kept on the C side, so dspark_poll and dspark_wait never take the GIL; every
 *   other call takes it for as long as it runs Python and gives it back.
 * - Handles are numbers, never pointers: a closed engine or a released request gives DSPARK_ERR_CLOSED
 *   or DSPARK_ERR_UNKNOWN_HANDLE, never a crash. 0 is never a valid handle.
 * - The interpreter stays up until the process exits. Close every engine before exit(): its loop thread
 *   is running model code.
 */
#ifndef DSPARK_H
#define DSPARK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change. Structs start with struct_size so that later versions can grow them:
 * fill them with the *_init functions below. */
#define DSPARK_API_VERSION 1

#if defined(_WIN32) && defined(DSPARK_BUILDING)
#define DSPARK_API __declspec(dllexport)
#elif defined(_WIN32)
#define DSPARK_API __declspec(dllimport)
#elif defined(DSPARK_BUILDING)
#define DSPARK_API __attribute__((visibility("default")))
#else
#define DSPARK_API
#endif

typedef uint64_t dspark_engine;  /* an open engine; 0 is never one */
typedef uint64_t dspark_request; /* a request of one engine; 0 is never one */

typedef enum dspark_status {
    DSPARK_OK = 0,
    DSPARK_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, a struct_size too small, an unknown option value */
    DSPARK_ERR_REQUEST = 2,          /* bad token ids, max_new_tokens, temperature, seed, stop, or no tokenizer */
    DSPARK_ERR_CAPACITY = 3,         /* the request can never fit this engine's KV capacity */
    DSPARK_ERR_ARTIFACT = 4,         /* the engine/export directory is missing, truncated or malformed */
    DSPARK_ERR_QUEUE_FULL = 5,       /* more requests are waiting than max_queue; retry later */
    DSPARK_ERR_CLOSED = 6,           /* the engine was closed (by dspark_close) */
    DSPARK_ERR_UNKNOWN_HANDLE = 7,   /* no such engine or request (never opened, or released) */
    DSPARK_ERR_REQUEST_FAILED = 8,   /* the decode step holding this request raised; the request ended */
    DSPARK_ERR_BUFFER_TOO_SMALL = 9, /* the output does not fit; the size needed is in the size out-parameter */
    DSPARK_ERR_PYTHON = 10,          /* the interpreter could not start, or dspark could not be imported */
    DSPARK_ERR_INTERNAL = 11         /* a bug in dspark: an unexpected exception (its text is in last_error) */
} dspark_status;

typedef enum dspark_finish_reason {
    DSPARK_FINISH_NONE = 0, /* still running */
    DSPARK_FINISH_LENGTH = 1,
    DSPARK_FINISH_STOP = 2,
    DSPARK_FINISH_CANCELLED = 3,
    DSPARK_FINISH_ERROR = 4 /* the engine failed it, or the engine was closed under it */
} dspark_finish_reason;

typedef struct dspark_options {
    uint32_t struct_size;
    int32_t max_requests;   /* KV slots: requests decoded together (0: 64) */
    int32_t max_seq_len;    /* positions per slot, prompt + new tokens (0: 1024) */
    int32_t max_tokens;     /* KV positions across slots (0: max_requests * max_seq_len) */
    int32_t max_queue;      /* requests waiting beyond that before DSPARK_ERR_QUEUE_FULL (0: 1024) */
    const char *scheduler;  /* "dspark" (NULL), "fixed", "threshold" or "off" (autoregressive) */
} dspark_options;

typedef struct dspark_event {
    dspark_request request;
    const int32_t *tokens;  /* the tokens committed since the last event; valid during the call only */
    size_t n_tokens;
    int finished;           /* 1 on the last event of the request (n_tokens may be 0), else 0 */
    dspark_finish_reason finish_reason;
} dspark_event;

/* Called on the engine's loop thread (never the submitting thread), without the GIL: once after every
 * decode step that committed tokens for the request, and exactly once with finished = 1. Keep it short
 * (it delays the next step). It may call dspark_* functions except dspark_close of this engine and a
 * dspark_wait on it that could block (the loop it would wait for is the one running the callback); it must
 * not wait for a lock that a thread holds while calling dspark_release or dspark_close. */
typedef void (*dspark_callback)(const dspark_event *event, void *user_data);

typedef struct dspark_request_params {
    uint32_t struct_size;
    const int32_t *prompt_ids; /* the prompt as token ids, or NULL to use prompt_text */
    size_t n_prompt_ids;
    const char *prompt_text;   /* UTF-8, encoded with the pair's tokenizer.json (when prompt_ids is NULL) */
    int32_t max_new_tokens;
    double temperature;        /* 0: greedy (the target's own greedy output, token for token) */
    int64_t seed;              /* the request's own random stream: same seed, same output as the Python API */
    const int32_t *stop_ids;   /* generation ends at (and includes) the first of these */
    size_t n_stop_ids;
    const char *const *stop_strings; /* generation ends at the token completing one of these (UTF-8) */
    size_t n_stop_strings;
    dspark_callback callback;  /* optional: tokens pushed from the loop thread; polling works either way */
    void *user_data;
} dspark_request_params;

typedef struct dspark_request_stats {
    uint32_t struct_size;
    int32_t finished;
    dspark_finish_reason finish_reason;
    int32_t prompt_tokens;
    int32_t generated_tokens;      /* committed so far (all of them once finished) */
    int32_t rounds;                /* verification rounds; with the two below, filled once finished */
    int32_t verified_tokens;       /* positions the target verified (anchor + drafts, every round) */
    double mean_accepted_length;   /* tokens committed per round, the bonus token counted */
    double time_to_first_token_s;  /* from submit; -1 before the first token */
    double total_s;                /* from submit to the end (or to now while running) */
} dspark_request_stats;

typedef struct dspark_engine_info {
    uint32_t struct_size;
    int32_t vocab_size;
    int32_t max_positions;   /* the target's position limit: prompt + new tokens */
    int32_t block_size;      /* drafts per round (γ) */
    int32_t max_requests;
    int32_t max_seq_len;
    int32_t n_eos_token_ids;
    int32_t eos_token_ids[8];
} dspark_engine_info;

DSPARK_API int dspark_version(void); /* the library's DSPARK_API_VERSION */
DSPARK_API const char *dspark_status_name(dspark_status status); /* "DSPARK_ERR_REQUEST", ... */
/* This thread's message for the last call that failed ("" if none); valid until its next failing call. */
DSPARK_API const char *dspark_last_error(void);

DSPARK_API void dspark_options_init(dspark_options *options);
DSPARK_API void dspark_request_params_init(dspark_request_params *params);

/* Load an engine or export directory and start its loop thread. options may be NULL (defaults). */
DSPARK_API dspark_status dspark_open(const char *path, const dspark_options *options, dspark_engine *engine);
/* Stop the loop (unfinished requests end with DSPARK_FINISH_ERROR, callbacks get their last event before
 * this returns) and release the model. Any later use of the engine gives DSPARK_ERR_CLOSED. */
DSPARK_API dspark_status dspark_close(dspark_engine engine);
DSPARK_API dspark_status dspark_engine_info_get(dspark_engine engine, dspark_engine_info *info);

/* Validate and queue one request; a bad one is refused here (DSPARK_ERR_REQUEST, _CAPACITY), never later. */
DSPARK_API dspark_status dspark_submit(dspark_engine engine, const dspark_request_params *params,
                                       dspark_request *request);
/* The tokens committed since the last poll/wait of this request (at most cap; the rest stay for the next
 * call) without waiting. *finished = 1 once the request ended and every token was handed out; a request
 * that failed returns DSPARK_ERR_REQUEST_FAILED on that call (with its tokens and *finished set). */
DSPARK_API dspark_status dspark_poll(dspark_engine engine, dspark_request request, int32_t *tokens, size_t cap,
                                     size_t *n_tokens, int *finished);
/* dspark_poll that first waits up to timeout_ms (-1: no limit) for a token or the end. */
DSPARK_API dspark_status dspark_wait(dspark_engine engine, dspark_request request, int32_t *tokens, size_t cap,
                                     size_t *n_tokens, int *finished, int32_t timeout_ms);
/* End the request at the next step boundary (DSPARK_FINISH_CANCELLED); its KV slot is freed there. */
DSPARK_API dspark_status dspark_cancel(dspark_engine engine, dspark_request request);
DSPARK_API dspark_status dspark_request_stats_get(dspark_engine engine, dspark_request request,
                                                  dspark_request_stats *stats);
/* Cancel the request if it runs and forget it. Once this returns its callback is never called again, and a
 * thread waiting on it in dspark_wait returns (finished). */
DSPARK_API dspark_status dspark_release(dspark_engine engine, dspark_request request);

/* Text <-> ids with the pair's tokenizer.json. DSPARK_ERR_BUFFER_TOO_SMALL sets *n / *len to the size
 * needed; text is NUL-terminated, *len excludes the NUL (cap must leave room for it). */
DSPARK_API dspark_status dspark_tokenize(dspark_engine engine, const char *text, int32_t *ids, size_t cap,
                                         size_t *n);
DSPARK_API dspark_status dspark_detokenize(dspark_engine engine, const int32_t *ids, size_t n, char *text,
                                           size_t cap, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* DSPARK_H */
