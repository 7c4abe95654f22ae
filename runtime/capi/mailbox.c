/* Each request's tokens, kept in C so that dspark_poll / dspark_wait never take the GIL.
 *
 * Every request is submitted with mailbox_push as its callback: the engine's loop thread appends each step's
 * tokens here (one GIL release per step for all requests, see invoke in embed.c) and then calls the user's
 * callback, if any. Pollers read under the mailbox's own mutex. A registry maps (engine, request) to its
 * mailbox; a request that is not there (never submitted, released, or its engine closed) goes to the bridge,
 * which names the problem. A mailbox is freed when it has left the registry and no poller holds it. */
#include "embed.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct mailbox {
    dspark_engine engine;
    dspark_request request;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t *tokens;
    size_t len, cap, read;
    int finished;
    dspark_finish_reason reason;
    dspark_callback user_fn;
    void *user_data;
    int refs; /* the registry's + pollers'; under registry_lock */
    mailbox *next;
};

#define BUCKETS 1024
static mailbox *buckets[BUCKETS];
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t bucket(dspark_engine engine, dspark_request request) {
    return (size_t)((engine * 0x9E3779B97F4A7C15ull) ^ request) % BUCKETS;
}

mailbox *mailbox_new(dspark_callback user_fn, void *user_data) {
    mailbox *box = calloc(1, sizeof *box);
    if (!box) return NULL;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&box->cv, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&box->mu, NULL);
    box->user_fn = user_fn;
    box->user_data = user_data;
    box->refs = 1;
    return box;
}

static void destroy(mailbox *box) {
    pthread_cond_destroy(&box->cv);
    pthread_mutex_destroy(&box->mu);
    free(box->tokens);
    free(box);
}

/* Drop one reference (a poller's, or the registry's for a box that never entered it). */
void mailbox_put(mailbox *box) {
    pthread_mutex_lock(&registry_lock);
    int last = --box->refs == 0;
    pthread_mutex_unlock(&registry_lock);
    if (last) destroy(box);
}

void mailbox_insert(mailbox *box, dspark_engine engine, dspark_request request) {
    box->engine = engine;
    box->request = request;
    size_t b = bucket(engine, request);
    pthread_mutex_lock(&registry_lock);
    box->next = buckets[b];
    buckets[b] = box;
    pthread_mutex_unlock(&registry_lock);
}

mailbox *mailbox_find(dspark_engine engine, dspark_request request) {
    pthread_mutex_lock(&registry_lock);
    mailbox *box = buckets[bucket(engine, request)];
    while (box && (box->engine != engine || box->request != request)) box = box->next;
    if (box) box->refs++;
    pthread_mutex_unlock(&registry_lock);
    return box;
}

/* Unlink every mailbox of `engine` (request 0: all of its requests) and drop the registry's references. */
void mailbox_remove(dspark_engine engine, dspark_request request) {
    mailbox *gone = NULL;
    pthread_mutex_lock(&registry_lock);
    for (size_t b = request ? bucket(engine, request) : 0; b < BUCKETS; b++) {
        for (mailbox **at = &buckets[b]; *at;) {
            mailbox *box = *at;
            if (box->engine == engine && (!request || box->request == request)) {
                *at = box->next;
                box->next = gone;
                gone = box;
            } else {
                at = &box->next;
            }
        }
        if (request) break;
    }
    pthread_mutex_unlock(&registry_lock);
    while (gone) {
        mailbox *next = gone->next;
        pthread_mutex_lock(&gone->mu); /* released before its end: whoever still waits on it returns */
        if (!gone->finished) {
            gone->finished = 1;
            gone->reason = DSPARK_FINISH_CANCELLED;
        }
        pthread_cond_broadcast(&gone->cv);
        pthread_mutex_unlock(&gone->mu);
        mailbox_put(gone);
        gone = next;
    }
}

int mailbox_has_callback(const void *box) { return ((const mailbox *)box)->user_fn != NULL; }

/* The dspark_callback of every request (the loop thread; without the GIL when a user callback follows). */
void mailbox_push(const dspark_event *event, void *user_data) {
    mailbox *box = user_data;
    pthread_mutex_lock(&box->mu);
    if (box->len + event->n_tokens > box->cap) {
        size_t cap = box->cap ? box->cap : 64;
        while (cap < box->len + event->n_tokens) cap *= 2;
        int32_t *grown = realloc(box->tokens, cap * sizeof *grown);
        if (grown) {
            box->tokens = grown;
            box->cap = cap;
        }
    }
    size_t n = box->len + event->n_tokens <= box->cap ? event->n_tokens : 0; /* out of memory: lost, and said */
    if (n) memcpy(box->tokens + box->len, event->tokens, n * sizeof *event->tokens);
    box->len += n;
    if (event->finished || n < event->n_tokens) {
        box->finished = 1;
        box->reason = n < event->n_tokens ? DSPARK_FINISH_ERROR : event->finish_reason;
    }
    pthread_cond_broadcast(&box->cv);
    pthread_mutex_unlock(&box->mu);
    if (box->user_fn) box->user_fn(event, box->user_data);
}

/* Up to cap tokens not read yet, first waiting up to timeout_ms (-1: no limit) for some or for the end.
 * *finished once the end came and everything was read; *reason is the finish reason then. */
void mailbox_take(mailbox *box, int32_t *out, size_t cap, size_t *n, int *finished, int32_t timeout_ms,
                  dspark_finish_reason *reason) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&box->mu);
    while (box->read == box->len && !box->finished && timeout_ms != 0) {
        if (timeout_ms < 0) pthread_cond_wait(&box->cv, &box->mu);
        else if (pthread_cond_timedwait(&box->cv, &box->mu, &deadline) == ETIMEDOUT) break;
    }
    *n = box->len - box->read < cap ? box->len - box->read : cap;
    if (*n) memcpy(out, box->tokens + box->read, *n * sizeof *out);
    box->read += *n;
    *finished = box->finished && box->read == box->len;
    *reason = box->reason;
    pthread_mutex_unlock(&box->mu);
}
