/* libdspark's entry points (dspark.h). Each one checks its pointers, makes sure the bridge is up (dspark_open
 * starts it), takes the GIL (enter), calls one bridge function, copies the value out and gives the GIL back;
 * except dspark_poll / dspark_wait on a live request, which read its mailbox (mailbox.c) without the GIL. */
#include "embed.h"

#include <string.h>

#define ENGINE(e) ((unsigned long long)(e))
#define CHECK(cond, ...) \
    do { \
        if (!(cond)) return fail(DSPARK_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)
#define CHECK_SIZE(ptr, type) \
    CHECK((ptr)->struct_size >= sizeof(type), #type ".struct_size is %u, this library needs >= %zu: fill it with " \
          "its _init function", (unsigned)(ptr)->struct_size, sizeof(type))

int dspark_version(void) { return DSPARK_API_VERSION; }

const char *dspark_status_name(dspark_status status) {
    static const char *const names[] = {
        "DSPARK_OK", "DSPARK_ERR_INVALID_ARGUMENT", "DSPARK_ERR_REQUEST", "DSPARK_ERR_CAPACITY",
        "DSPARK_ERR_ARTIFACT", "DSPARK_ERR_QUEUE_FULL", "DSPARK_ERR_CLOSED", "DSPARK_ERR_UNKNOWN_HANDLE",
        "DSPARK_ERR_REQUEST_FAILED", "DSPARK_ERR_BUFFER_TOO_SMALL", "DSPARK_ERR_PYTHON", "DSPARK_ERR_INTERNAL"};
    return (unsigned)status < sizeof names / sizeof *names ? names[status] : "DSPARK_STATUS_UNKNOWN";
}

void dspark_options_init(dspark_options *options) {
    if (!options) return;
    memset(options, 0, sizeof *options);
    options->struct_size = sizeof *options;
}

void dspark_request_params_init(dspark_request_params *params) {
    if (!params) return;
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params;
    params->max_new_tokens = 64;
}

dspark_status dspark_open(const char *path, const dspark_options *options, dspark_engine *engine) {
    CHECK(engine, "engine (the handle out-parameter) is NULL");
    *engine = 0;
    CHECK(path, "path is NULL: give an engine or export directory");
    dspark_options defaults;
    dspark_options_init(&defaults);
    if (!options) options = &defaults;
    CHECK_SIZE(options, dspark_options);
    dspark_status status = start();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *scheduler = options->scheduler ? PyBytes_FromString(options->scheduler) : Py_NewRef(Py_None);
    PyObject *value;
    status = call(F_OPEN, scheduler ? Py_BuildValue("(yiiiiN)", path, options->max_requests, options->max_seq_len,
                                                    options->max_tokens, options->max_queue, scheduler) : NULL,
                  &value);
    if (status == DSPARK_OK) *engine = PyLong_AsUnsignedLongLong(value);
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

/* Calls whose value is None: close, cancel, release. */
static dspark_status call_none(int f, dspark_engine engine, dspark_request request) {
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *value;
    status = call(f, f == F_CLOSE ? Py_BuildValue("(K)", ENGINE(engine))
                                  : Py_BuildValue("(KK)", ENGINE(engine), (unsigned long long)request), &value);
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_close(dspark_engine engine) {
    dspark_status status = call_none(F_CLOSE, engine, 0);
    if (status == DSPARK_OK) mailbox_remove(engine, 0); /* every callback has run: nothing pushes any more */
    return status;
}
dspark_status dspark_cancel(dspark_engine engine, dspark_request request) {
    return call_none(F_CANCEL, engine, request);
}
dspark_status dspark_release(dspark_engine engine, dspark_request request) {
    dspark_status status = call_none(F_RELEASE, engine, request);
    if (status == DSPARK_OK) mailbox_remove(engine, request); /* no callback of it can follow */
    return status;
}

dspark_status dspark_engine_info_get(dspark_engine engine, dspark_engine_info *info) {
    CHECK(info, "info is NULL");
    CHECK_SIZE(info, dspark_engine_info);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *value;
    status = call(F_INFO, Py_BuildValue("(K)", ENGINE(engine)), &value);
    if (status == DSPARK_OK) {
        int32_t *fields[] = {&info->vocab_size, &info->max_positions, &info->block_size, &info->max_requests,
                             &info->max_seq_len, &info->n_eos_token_ids};
        Py_ssize_t size = PyTuple_GET_SIZE(value);
        for (Py_ssize_t i = 0; i < size && i < 6 + 8; i++) {
            int32_t item = (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(value, i));
            *(i < 6 ? fields[i] : &info->eos_token_ids[i - 6]) = item;
        }
    }
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_submit(dspark_engine engine, const dspark_request_params *p, dspark_request *request) {
    CHECK(request, "request (the handle out-parameter) is NULL");
    *request = 0;
    CHECK(p, "params is NULL");
    CHECK_SIZE(p, dspark_request_params);
    CHECK(p->prompt_ids || p->prompt_text, "give params.prompt_ids or params.prompt_text (both are NULL)");
    CHECK(p->stop_ids || !p->n_stop_ids, "params.stop_ids is NULL but n_stop_ids is %zu", p->n_stop_ids);
    CHECK(p->stop_strings || !p->n_stop_strings, "params.stop_strings is NULL but n_stop_strings is %zu",
          p->n_stop_strings);
    for (size_t i = 0; i < p->n_stop_strings; i++) CHECK(p->stop_strings[i], "params.stop_strings[%zu] is NULL", i);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    mailbox *box = mailbox_new(p->callback, p->user_data); /* the request's callback: it calls the user's */
    if (!box) return fail(DSPARK_ERR_INTERNAL, "out of memory");
    PyGILState_STATE gil = enter();
    PyObject *prompt = p->prompt_ids ? ids_list(p->prompt_ids, p->n_prompt_ids) : Py_NewRef(Py_None);
    PyObject *text = p->prompt_ids ? Py_NewRef(Py_None) : PyBytes_FromString(p->prompt_text);
    PyObject *stops = PyList_New((Py_ssize_t)p->n_stop_strings);
    for (size_t i = 0; stops && i < p->n_stop_strings; i++) {
        PyObject *item = PyBytes_FromString(p->stop_strings[i]);
        if (!item) Py_CLEAR(stops);
        else PyList_SET_ITEM(stops, (Py_ssize_t)i, item);
    }
    PyObject *value, *args = NULL;
    PyObject *stop_ids = ids_list(p->stop_ids, p->n_stop_ids);
    if (prompt && text && stops && stop_ids)
        args = Py_BuildValue("(KOOidLOOKK)", ENGINE(engine), prompt, text, (int)p->max_new_tokens, p->temperature,
                             (long long)p->seed, stop_ids, stops, (unsigned long long)(uintptr_t)mailbox_push,
                             (unsigned long long)(uintptr_t)box);
    Py_XDECREF(prompt);
    Py_XDECREF(text);
    Py_XDECREF(stops);
    Py_XDECREF(stop_ids);
    status = call(F_SUBMIT, args, &value);
    if (status == DSPARK_OK) *request = PyLong_AsUnsignedLongLong(value);
    Py_XDECREF(value);
    PyGILState_Release(gil);
    if (status == DSPARK_OK) mailbox_insert(box, engine, *request); /* tokens may have arrived already: fine */
    else mailbox_put(box);
    return status;
}

/* DSPARK_ERR_REQUEST_FAILED with the bridge's account of why a request ended in error. */
static dspark_status request_error(dspark_engine engine, dspark_request request) {
    PyGILState_STATE gil = enter();
    PyObject *value;
    dspark_status status = call(F_ERROR, Py_BuildValue("(KK)", ENGINE(engine), (unsigned long long)request), &value);
    if (status == DSPARK_OK) {
        const char *message = PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : NULL;
        status = fail(DSPARK_ERR_REQUEST_FAILED, "%s", message ? message : "the request's tokens did not fit in "
                      "memory (libdspark): the request was ended");
        PyErr_Clear();
    }
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_wait(dspark_engine engine, dspark_request request, int32_t *tokens, size_t cap,
                          size_t *n_tokens, int *finished, int32_t timeout_ms) {
    CHECK(n_tokens && finished, "n_tokens and finished must not be NULL");
    *n_tokens = 0;
    *finished = 0;
    CHECK(tokens && cap > 0, "tokens must hold at least one token (tokens %s, cap %zu)", tokens ? "set" : "NULL", cap);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    mailbox *box = mailbox_find(engine, request);
    if (box) { /* no GIL */
        dspark_finish_reason reason;
        mailbox_take(box, tokens, cap, n_tokens, finished, timeout_ms, &reason);
        mailbox_put(box);
        return *finished && reason == DSPARK_FINISH_ERROR ? request_error(engine, request) : DSPARK_OK;
    }
    /* Not registered: never submitted, released, or its engine closed; the bridge says which. */
    PyGILState_STATE gil = enter();
    PyObject *value;
    Py_ssize_t room = cap > (size_t)PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : (Py_ssize_t)cap;
    status = call(F_POLL, Py_BuildValue("(KKn)", ENGINE(engine), (unsigned long long)request, room), &value);
    if (status == DSPARK_OK) {
        char error[1024];
        size_t n = 0;
        if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 3) {
            status = fail(DSPARK_ERR_INTERNAL, "bridge.poll answered something other than (tokens, finished, error)");
        } else if (copy_ids(PyTuple_GET_ITEM(value, 0), tokens, cap, &n) < 0) {
            status = fail(DSPARK_ERR_INTERNAL, "poll: %s", python_error(error, sizeof error));
        } else {
            *n_tokens = n < cap ? n : cap;
            *finished = PyObject_IsTrue(PyTuple_GET_ITEM(value, 1));
            PyObject *failure = PyTuple_GET_ITEM(value, 2);
            if (failure != Py_None) {
                const char *message = PyUnicode_AsUTF8(failure);
                status = fail(DSPARK_ERR_REQUEST_FAILED, "%s", message ? message : "the request failed");
                PyErr_Clear();
            }
        }
    }
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_poll(dspark_engine engine, dspark_request request, int32_t *tokens, size_t cap,
                          size_t *n_tokens, int *finished) {
    return dspark_wait(engine, request, tokens, cap, n_tokens, finished, 0);
}

dspark_status dspark_request_stats_get(dspark_engine engine, dspark_request request, dspark_request_stats *stats) {
    CHECK(stats, "stats is NULL");
    CHECK_SIZE(stats, dspark_request_stats);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *value;
    status = call(F_STATS, Py_BuildValue("(KK)", ENGINE(engine), (unsigned long long)request), &value);
    int reason = 0;
    if (status == DSPARK_OK &&
        !PyArg_ParseTuple(value, "iiiiiiddd", &stats->finished, &reason, &stats->prompt_tokens,
                          &stats->generated_tokens, &stats->rounds, &stats->verified_tokens,
                          &stats->mean_accepted_length, &stats->time_to_first_token_s, &stats->total_s)) {
        char error[1024];
        status = fail(DSPARK_ERR_INTERNAL, "stats: %s", python_error(error, sizeof error));
    }
    stats->finish_reason = (dspark_finish_reason)reason;
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_tokenize(dspark_engine engine, const char *text, int32_t *ids, size_t cap, size_t *n) {
    CHECK(text && n, "text and n must not be NULL");
    *n = 0;
    CHECK(ids || !cap, "ids is NULL but cap is %zu", cap);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *value;
    status = call(F_TOKENIZE, Py_BuildValue("(Ky)", ENGINE(engine), text), &value);
    if (status == DSPARK_OK) {
        char error[1024];
        if (copy_ids(value, ids, cap, n) < 0)
            status = fail(DSPARK_ERR_INTERNAL, "tokenize: %s", python_error(error, sizeof error));
        else if (*n > cap)
            status = fail(DSPARK_ERR_BUFFER_TOO_SMALL, "the text is %zu token ids; ids holds %zu", *n, cap);
    }
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}

dspark_status dspark_detokenize(dspark_engine engine, const int32_t *ids, size_t n, char *text, size_t cap,
                                size_t *len) {
    CHECK(len, "len is NULL");
    *len = 0;
    CHECK(ids || !n, "ids is NULL but n is %zu", n);
    CHECK(text || !cap, "text is NULL but cap is %zu", cap);
    dspark_status status = need_bridge();
    if (status != DSPARK_OK) return status;
    PyGILState_STATE gil = enter();
    PyObject *value, *list = ids_list(ids, n);
    status = call(F_DETOKENIZE, list ? Py_BuildValue("(KN)", ENGINE(engine), list) : NULL, &value);
    if (status == DSPARK_OK) {
        *len = (size_t)PyBytes_GET_SIZE(value);
        if (*len + 1 > cap)
            status = fail(DSPARK_ERR_BUFFER_TOO_SMALL, "the text is %zu bytes + NUL; text holds %zu", *len, cap);
        else
            memcpy(text, PyBytes_AS_STRING(value), *len + 1);
    }
    Py_XDECREF(value);
    PyGILState_Release(gil);
    return status;
}
