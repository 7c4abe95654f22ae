// dspark.hpp: a header-only C++17 wrapper over the dspark C API (dspark.h). RAII engine and request handles,
// std::vector (and std::span under C++20) in and out, dspark::Error (the C error text and status) for every
// failure, and tokens by iterator, blocking calls or a callback.
//
//   dspark::Engine engine("build/engine", {.max_requests = 64});        // (C++20 designated initializers)
//   dspark::Request request = engine.submit(std::vector<int32_t>{1, 2, 3}, {.max_new_tokens = 64});
//   for (const dspark::Tokens &chunk : request) print(chunk);      // as each decode step commits them
//   auto stats = request.stats();                                  // accepted length, tokens, times
//
// A Request cancels and releases its request when destroyed; an Engine closes when destroyed. Both may be
// used from any thread (one Request from one thread at a time). Destroy Requests before their Engine or
// after it: either order is safe.
#pragma once

#include "dspark.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#if __cplusplus >= 202002L && __has_include(<span>)
#include <span>
#define DSPARK_HAS_SPAN 1
#endif

namespace dspark {

using Tokens = std::vector<int32_t>;

class Error : public std::runtime_error {
   public:
    Error(dspark_status status, const std::string &message)
        : std::runtime_error(std::string(dspark_status_name(status)) + ": " + message), status_(status) {}
    dspark_status status() const noexcept { return status_; }

   private:
    dspark_status status_;
};

inline void check(dspark_status status) {
    if (status != DSPARK_OK) throw Error(status, dspark_last_error());
}

struct Options {
    int max_requests = 0;   // 0: the C API's defaults (64 slots, 1024 positions each, ...)
    int max_seq_len = 0;
    int max_tokens = 0;
    int max_queue = 0;
    std::string scheduler{};  // "" (dspark), "fixed", "threshold", "off"
};

struct Params {
    int max_new_tokens = 64;
    double temperature = 0.0;
    int64_t seed = 0;
    Tokens stop_ids{};
    std::vector<std::string> stop_strings{};
};

// The tokens one event brought: a view valid during the callback only.
struct Chunk {
    const int32_t *data = nullptr;
    size_t size = 0;
    const int32_t *begin() const { return data; }
    const int32_t *end() const { return data + size; }
    Tokens tokens() const { return Tokens(begin(), end()); }
#ifdef DSPARK_HAS_SPAN
    operator std::span<const int32_t>() const { return {data, size}; }
#endif
};

// Called on the engine's loop thread after each step that committed tokens, then once with finished = true.
// An exception it throws cannot cross into the loop thread: it is dropped.
using Callback = std::function<void(Chunk tokens, bool finished, dspark_finish_reason reason)>;

class Request {
   public:
    Request() = default;
    Request(Request &&other) noexcept { *this = std::move(other); }
    Request &operator=(Request &&other) noexcept {
        if (this != &other) {
            reset();
            engine_ = std::exchange(other.engine_, 0);
            id_ = std::exchange(other.id_, 0);
            finished_ = std::exchange(other.finished_, false);
            callback_ = std::move(other.callback_);
        }
        return *this;
    }
    Request(const Request &) = delete;
    Request &operator=(const Request &) = delete;
    ~Request() { reset(); }

    dspark_request id() const { return id_; }
    bool finished() const { return finished_; }

    // The tokens committed since the last call, waiting up to timeout_ms (-1: until there are some); empty
    // once the request has finished. Throws Error (DSPARK_ERR_REQUEST_FAILED, ...).
    Tokens next(int timeout_ms = -1) {
        Tokens out;
        int32_t buf[256];
        size_t n = 0;
        int done = 0;
        for (int32_t wait = timeout_ms; !finished_; wait = 0) {
            dspark_status status = dspark_wait(engine_, id_, buf, 256, &n, &done, wait);
            finished_ = done != 0 || status == DSPARK_ERR_REQUEST_FAILED;  // a failed request stays failed
            check(status);
            out.insert(out.end(), buf, buf + n);
            if (n < 256) break;  // a full buffer: there may be more already
        }
        return out;
    }
    Tokens poll() { return next(0); }
    // Every remaining token, once the request has finished.
    Tokens collect() {
        Tokens all;
        while (!finished_) {
            Tokens more = next();
            all.insert(all.end(), more.begin(), more.end());
        }
        return all;
    }
    void cancel() { check(dspark_cancel(engine_, id_)); }
    dspark_request_stats stats() const {
        dspark_request_stats s{};
        s.struct_size = sizeof s;
        check(dspark_request_stats_get(engine_, id_, &s));
        return s;
    }
    // Cancel (if running) and forget the request; no callback of it runs after this.
    void reset() noexcept {
        if (id_) dspark_release(engine_, id_);  // CLOSED after the engine closed: nothing left to free there
        id_ = 0;
        callback_.reset();
    }

    class iterator {
       public:
        using value_type = Tokens;
        using difference_type = std::ptrdiff_t;
        iterator() = default;
        explicit iterator(Request *r) : request_(r) { ++*this; }
        const Tokens &operator*() const { return chunk_; }
        iterator &operator++() {
            chunk_ = request_->next();
            if (chunk_.empty()) request_ = nullptr;  // next() blocks until tokens come or the request ends
            return *this;
        }
        bool operator==(const iterator &o) const { return request_ == o.request_; }
        bool operator!=(const iterator &o) const { return request_ != o.request_; }

       private:
        Request *request_ = nullptr;
        Tokens chunk_;
    };
    // for (const Tokens &chunk : request): the tokens of each step, as they come.
    iterator begin() { return iterator(this); }
    iterator end() { return iterator(); }

   private:
    friend class Engine;
    Request(dspark_engine engine, dspark_request id, std::unique_ptr<Callback> callback)
        : engine_(engine), id_(id), callback_(std::move(callback)) {}
    dspark_engine engine_ = 0;
    dspark_request id_ = 0;
    bool finished_ = false;
    std::unique_ptr<Callback> callback_;  // lives until release: the loop thread may be calling it
};

class Engine {
   public:
    explicit Engine(const std::string &path, const Options &options = {}) {
        dspark_options o;
        dspark_options_init(&o);
        o.max_requests = options.max_requests;
        o.max_seq_len = options.max_seq_len;
        o.max_tokens = options.max_tokens;
        o.max_queue = options.max_queue;
        o.scheduler = options.scheduler.empty() ? nullptr : options.scheduler.c_str();
        check(dspark_open(path.c_str(), &o, &handle_));
    }
    Engine(Engine &&other) noexcept : handle_(std::exchange(other.handle_, 0)) {}
    Engine &operator=(Engine &&other) noexcept {
        if (this != &other) {
            if (handle_) dspark_close(handle_);
            handle_ = std::exchange(other.handle_, 0);
        }
        return *this;
    }
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;
    ~Engine() {
        if (handle_) dspark_close(handle_);
    }
    // Stop the loop: unfinished requests end (DSPARK_FINISH_ERROR); later calls throw DSPARK_ERR_CLOSED.
    void close() { check(dspark_close(std::exchange(handle_, 0))); }
    dspark_engine handle() const { return handle_; }

    dspark_engine_info info() const {
        dspark_engine_info i{};
        i.struct_size = sizeof i;
        check(dspark_engine_info_get(handle_, &i));
        return i;
    }

    Request submit(const int32_t *prompt, size_t n, const Params &params = {}, Callback on_tokens = {}) {
        return submit_impl(prompt, n, nullptr, params, std::move(on_tokens));
    }
    Request submit(const Tokens &prompt, const Params &params = {}, Callback on_tokens = {}) {
        return submit(prompt.data(), prompt.size(), params, std::move(on_tokens));
    }
#ifdef DSPARK_HAS_SPAN
    Request submit(std::span<const int32_t> prompt, const Params &params = {}, Callback on_tokens = {}) {
        return submit(prompt.data(), prompt.size(), params, std::move(on_tokens));
    }
#endif
    Request submit(std::string_view text, const Params &params = {}, Callback on_tokens = {}) {
        std::string owned(text);
        return submit_impl(nullptr, 0, owned.c_str(), params, std::move(on_tokens));
    }
    // Blocking: every token of one request.
    Tokens generate(const Tokens &prompt, const Params &params = {}) { return submit(prompt, params).collect(); }

    Tokens tokenize(std::string_view text) const {
        std::string owned(text);
        Tokens ids(owned.size() + 16);
        size_t n = 0;
        dspark_status s = dspark_tokenize(handle_, owned.c_str(), ids.data(), ids.size(), &n);
        if (s == DSPARK_ERR_BUFFER_TOO_SMALL) {
            ids.resize(n);
            s = dspark_tokenize(handle_, owned.c_str(), ids.data(), ids.size(), &n);
        }
        check(s);
        ids.resize(n);
        return ids;
    }
    std::string detokenize(const int32_t *ids, size_t n) const {
        std::string text(n * 8 + 16, '\0');
        size_t len = 0;
        dspark_status s = dspark_detokenize(handle_, ids, n, text.data(), text.size(), &len);
        if (s == DSPARK_ERR_BUFFER_TOO_SMALL) {
            text.resize(len + 1);
            s = dspark_detokenize(handle_, ids, n, text.data(), text.size(), &len);
        }
        check(s);
        text.resize(len);
        return text;
    }
    std::string detokenize(const Tokens &ids) const { return detokenize(ids.data(), ids.size()); }

   private:
    static void trampoline(const dspark_event *event, void *user_data) noexcept {
        try {
            (*static_cast<Callback *>(user_data))(Chunk{event->tokens, event->n_tokens}, event->finished != 0,
                                                  event->finish_reason);
        } catch (...) {
        }
    }
    Request submit_impl(const int32_t *ids, size_t n, const char *text, const Params &params, Callback on_tokens) {
        dspark_request_params p;
        dspark_request_params_init(&p);
        static const int32_t none = 0;
        p.prompt_ids = text ? nullptr : (ids ? ids : &none);
        p.n_prompt_ids = n;
        p.prompt_text = text;
        p.max_new_tokens = params.max_new_tokens;
        p.temperature = params.temperature;
        p.seed = params.seed;
        p.stop_ids = params.stop_ids.data();
        p.n_stop_ids = params.stop_ids.size();
        std::vector<const char *> stops;
        for (const std::string &s : params.stop_strings) stops.push_back(s.c_str());
        p.stop_strings = stops.data();
        p.n_stop_strings = stops.size();
        std::unique_ptr<Callback> callback;
        if (on_tokens) {
            callback = std::make_unique<Callback>(std::move(on_tokens));
            p.callback = &Engine::trampoline;
            p.user_data = callback.get();
        }
        dspark_request id = 0;
        check(dspark_submit(handle_, &p, &id));
        return Request(handle_, id, std::move(callback));
    }

    dspark_engine handle_ = 0;
};

}  // namespace dspark
