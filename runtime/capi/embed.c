/* libdspark's embedding half: the interpreter, the bridge module, the GIL, and calls into the bridge.
 *
 * The interpreter is started at most once, by the first dspark_open of a process that has none; that thread
 * then releases the GIL (PyEval_SaveThread) so that any thread can take it. Inside a Python process the running
 * interpreter is used. A bridge function answers (status, value) and never raises; an exception that escapes
 * anyway (a bug) is caught here and becomes DSPARK_ERR_INTERNAL with its text. */
#include "embed.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef DSPARK_PYTHON_EXECUTABLE
#define DSPARK_PYTHON_EXECUTABLE "python3"
#endif
#define BRIDGE "dspark.runtime.capi.bridge"

static _Thread_local char last_error[2048];
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int ready; /* the bridge is imported and fns[] filled */

static const char *const fn_names[F_COUNT] = {"open_engine", "close", "info", "submit", "poll", "error",
                                              "cancel", "stats", "release", "tokenize", "detokenize"};
static PyObject *fns[F_COUNT];

dspark_status fail(dspark_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

/* The pending Python exception as "Type: message" in buf, and cleared (GIL held). */
const char *python_error(char *buf, size_t cap) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    const char *name = type ? ((PyTypeObject *)type)->tp_name : "unknown error";
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *message = text ? PyUnicode_AsUTF8(text) : NULL;
    snprintf(buf, cap, "%s: %s", name, message ? message : "(no message)");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
    return buf;
}

/* invoke([(fn, user_data, request, tokens, finished, reason), ...]): what the bridge calls on the loop thread
 * to run one step's callbacks, in order: each request's mailbox_push, which then calls the user's callback if
 * it has one. The GIL is dropped once around them when any user code runs (mailboxes alone do not need it). */
static PyObject *invoke(PyObject *self, PyObject *batch) {
    (void)self;
    if (!PyList_Check(batch)) return PyErr_Format(PyExc_TypeError, "invoke takes a list of events");
    Py_ssize_t count = PyList_GET_SIZE(batch), total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(batch, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6 || !PyList_Check(PyTuple_GET_ITEM(item, 3)))
            return PyErr_Format(PyExc_TypeError, "invoke: event %zd is not (fn, user_data, request, tokens, "
                                "finished, reason)", i);
        total += PyList_GET_SIZE(PyTuple_GET_ITEM(item, 3));
    }
    struct call { dspark_callback fn; void *user_data; dspark_event event; } *calls = NULL;
    int32_t *tokens = NULL;
    calls = malloc((size_t)(count ? count : 1) * sizeof *calls);
    tokens = malloc((size_t)(total ? total : 1) * sizeof *tokens);
    if (!calls || !tokens) {
        free(calls);
        free(tokens);
        return PyErr_NoMemory();
    }
    int32_t *at = tokens;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long fn, user_data, request;
        PyObject *list;
        int finished, reason;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(batch, i), "KKKOii", &fn, &user_data, &request, &list, &finished,
                              &reason)) {
            free(calls);
            free(tokens);
            return NULL;
        }
        size_t n = (size_t)PyList_GET_SIZE(list);
        for (size_t k = 0; k < n; k++) at[k] = (int32_t)PyLong_AsLong(PyList_GET_ITEM(list, (Py_ssize_t)k));
        calls[i] = (struct call){(dspark_callback)(uintptr_t)fn, (void *)(uintptr_t)user_data,
                                 {(dspark_request)request, at, n, finished, (dspark_finish_reason)reason}};
        at += n;
    }
    if (PyErr_Occurred()) { /* a token that is not an int */
        free(calls);
        free(tokens);
        return NULL;
    }
    int user_code = 0; /* mailbox_push alone is short and never waits on anything that holds the GIL */
    for (Py_ssize_t i = 0; i < count && !user_code; i++)
        user_code = calls[i].fn != mailbox_push || mailbox_has_callback(calls[i].user_data);
    if (user_code) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) calls[i].fn(&calls[i].event, calls[i].user_data);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++) calls[i].fn(&calls[i].event, calls[i].user_data);
    }
    free(calls);
    free(tokens);
    Py_RETURN_NONE;
}

static PyMethodDef invoke_def = {"invoke", invoke, METH_O, "Run one step's dspark_callbacks (libdspark)."};

/* Import the bridge and keep its functions (GIL held). */
static dspark_status load_bridge(void) {
    char error[1024];
    if (atomic_load(&ready)) return DSPARK_OK;
    PyObject *module = PyImport_ImportModule(BRIDGE);
    if (!module) {
        python_error(error, sizeof error);
        PyObject *exe = PySys_GetObject("executable"); /* borrowed */
        const char *path = exe && PyUnicode_Check(exe) ? PyUnicode_AsUTF8(exe) : "?";
        PyErr_Clear();
        return fail(DSPARK_ERR_PYTHON, "cannot import " BRIDGE " in the Python at %s (%s); set DSPARK_PYTHON to "
                    "the python that has dspark installed", path ? path : "?", error);
    }
    PyObject *invoker = PyCFunction_New(&invoke_def, NULL);
    PyObject *done = invoker ? PyObject_CallMethod(module, "set_invoker", "O", invoker) : NULL;
    Py_XDECREF(invoker);
    int ok = done != NULL;
    Py_XDECREF(done);
    for (int i = 0; ok && i < F_COUNT; i++) {
        Py_XDECREF(fns[i]);
        ok = (fns[i] = PyObject_GetAttrString(module, fn_names[i])) != NULL;
    }
    Py_DECREF(module);
    if (!ok) return fail(DSPARK_ERR_PYTHON, "%s is not the bridge this libdspark needs: %s", BRIDGE,
                         python_error(error, sizeof error));
    atomic_store(&ready, 1);
    return DSPARK_OK;
}

/* The interpreter (started here when the process has none) and the bridge. */
dspark_status start(void) {
    if (atomic_load(&ready)) return DSPARK_OK;
    pthread_mutex_lock(&init_lock);
    if (!Py_IsInitialized()) {
        const char *python = getenv("DSPARK_PYTHON");
        if (!python || !*python) python = DSPARK_PYTHON_EXECUTABLE;
        PyConfig config;
        PyConfig_InitPythonConfig(&config);
        config.parse_argv = 0;
        config.install_signal_handlers = 0; /* the host program keeps its signals */
        /* As if `python` ran: its prefix, its venv (pyvenv.cfg) and site-packages. */
        PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, python);
        if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(status)) {
            pthread_mutex_unlock(&init_lock);
            return fail(DSPARK_ERR_PYTHON, "cannot start the Python interpreter %s: %s", python,
                        status.err_msg ? status.err_msg : "it asked to exit");
        }
        dspark_status loaded = load_bridge();
        PyEval_SaveThread(); /* from now on every call takes the GIL itself */
        pthread_mutex_unlock(&init_lock);
        return loaded;
    }
    pthread_mutex_unlock(&init_lock);
    PyGILState_STATE gil = PyGILState_Ensure(); /* a running interpreter (the host's, or ours) */
    dspark_status loaded = load_bridge();
    PyGILState_Release(gil);
    return loaded;
}

dspark_status need_bridge(void) {
    return atomic_load(&ready) ? DSPARK_OK
                               : fail(DSPARK_ERR_UNKNOWN_HANDLE, "no engine was opened in this process");
}

/* The GIL for one call. A thread that Python does not know keeps the thread state its first call made
 * (PyGILState counts it once more), so later calls only take and give back the GIL; the state is deleted when
 * the thread exits (unpin, a pthread key destructor). Python's own threads (a callback calling in) are left as
 * they are. */
static pthread_key_t pin_key;
static pthread_once_t pin_once = PTHREAD_ONCE_INIT;
static _Thread_local int pinned; /* 0: not seen yet; 1: pin now; 2: pinned; -1: a thread Python knows */

static void unpin(void *state) {
#if PY_VERSION_HEX >= 0x030D0000
    if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
    PyEval_RestoreThread((PyThreadState *)state);
    PyThreadState_Clear((PyThreadState *)state);
    PyThreadState_DeleteCurrent(); /* and drops the GIL */
}
static void make_pin_key(void) { pthread_key_create(&pin_key, unpin); }

PyGILState_STATE enter(void) {
    if (!pinned) pinned = PyGILState_GetThisThreadState() ? -1 : 1;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (pinned == 1) {
        pinned = 2;
        PyGILState_Ensure(); /* the count that keeps the state alive between calls */
        pthread_once(&pin_once, make_pin_key);
        pthread_setspecific(pin_key, PyThreadState_Get());
    }
    return gil;
}

/* Call bridge function f with args (a new reference, NULL when building it failed); GIL held. DSPARK_OK and
 * the value (a new reference) in *value, or the bridge's status with its message in last_error. */
dspark_status call(int f, PyObject *args, PyObject **value) {
    char error[1024];
    *value = NULL;
    PyObject *answer = args ? PyObject_CallObject(fns[f], args) : NULL;
    Py_XDECREF(args);
    if (!answer) return fail(DSPARK_ERR_INTERNAL, "%s: %s", fn_names[f], python_error(error, sizeof error));
    long status = -1;
    if (PyTuple_Check(answer) && PyTuple_GET_SIZE(answer) == 2)
        status = PyLong_AsLong(PyTuple_GET_ITEM(answer, 0));
    if (status < DSPARK_OK || status > DSPARK_ERR_INTERNAL) {
        PyErr_Clear();
        Py_DECREF(answer);
        return fail(DSPARK_ERR_INTERNAL, "bridge.%s answered something other than (status, value)", fn_names[f]);
    }
    PyObject *payload = PyTuple_GET_ITEM(answer, 1);
    if (status != DSPARK_OK) {
        const char *message = PyUnicode_Check(payload) ? PyUnicode_AsUTF8(payload) : NULL;
        fail((dspark_status)status, "%s", message ? message : "(no message)");
        PyErr_Clear();
    } else {
        Py_INCREF(payload);
        *value = payload;
    }
    Py_DECREF(answer);
    return (dspark_status)status;
}

PyObject *ids_list(const int32_t *ids, size_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *item = PyLong_FromLong(ids[i]);
        if (!item) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

/* A list of ints into out[0..cap); *n = its length. 0, or -1 with a Python error (GIL held). */
int copy_ids(PyObject *list, int32_t *out, size_t cap, size_t *n) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of token ids");
        return -1;
    }
    *n = (size_t)PyList_GET_SIZE(list);
    for (size_t i = 0; i < *n && i < cap; i++) {
        long value = PyLong_AsLong(PyList_GET_ITEM(list, (Py_ssize_t)i));
        if (value == -1 && PyErr_Occurred()) return -1;
        out[i] = (int32_t)value;
    }
    return 0;
}

const char *dspark_last_error(void) { return last_error; }
