/* libdspark's internals, shared by dspark.c (the entry points) and embed.c (the interpreter and the bridge).
 * The functions of embed.c but fail, start and need_bridge need the GIL; mailbox.c's never take it. */
#ifndef DSPARK_EMBED_H
#define DSPARK_EMBED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define DSPARK_BUILDING
#include "dspark.h"

/* The bridge's functions (bridge.py), in this order. */
enum {
    F_OPEN, F_CLOSE, F_INFO, F_SUBMIT, F_POLL, F_ERROR, F_CANCEL, F_STATS, F_RELEASE, F_TOKENIZE, F_DETOKENIZE,
    F_COUNT
};

/* Set this thread's last error; returns status. */
dspark_status fail(dspark_status status, const char *format, ...);
/* The pending Python exception as "Type: message" in buf, and cleared. */
const char *python_error(char *buf, size_t cap);
/* The interpreter (started here when the process has none) and the bridge (dspark_open). */
dspark_status start(void);
/* DSPARK_OK once the bridge is up, else DSPARK_ERR_UNKNOWN_HANDLE (no engine can exist yet). */
dspark_status need_bridge(void);
/* Take the GIL for one call; give it back with PyGILState_Release. */
PyGILState_STATE enter(void);
/* Call bridge function f with args (a new reference, or NULL when building it failed). DSPARK_OK and the value
 * (a new reference) in *value, or the bridge's status with its message as the last error. */
dspark_status call(int f, PyObject *args, PyObject **value);
/* ids as a new Python list (NULL with a Python error). */
PyObject *ids_list(const int32_t *ids, size_t n);
/* A list of ints into out[0..cap); *n = its length. 0, or -1 with a Python error. */
int copy_ids(PyObject *list, int32_t *out, size_t cap, size_t *n);

/* mailbox.c: each request's tokens on the C side (no GIL). */
typedef struct mailbox mailbox;
mailbox *mailbox_new(dspark_callback user_fn, void *user_data);
void mailbox_push(const dspark_event *event, void *box); /* the dspark_callback every request is given */
int mailbox_has_callback(const void *box);               /* whether pushing runs the user's callback too */
void mailbox_insert(mailbox *box, dspark_engine engine, dspark_request request);
mailbox *mailbox_find(dspark_engine engine, dspark_request request); /* a new reference, or NULL */
void mailbox_put(mailbox *box);
void mailbox_remove(dspark_engine engine, dspark_request request); /* request 0: every request of engine */
void mailbox_take(mailbox *box, int32_t *out, size_t cap, size_t *n, int *finished, int32_t timeout_ms,
                  dspark_finish_reason *reason);

#endif
