// dspark_generate: a line-oriented generator over the dspark C++ API. Each stdin line is a prompt (text, or
// token ids with --ids); its continuation streams to stdout as the engine commits it, one output line per
// input line. With --threads N, N client threads share the lines (thread t takes lines t, t+N, ...; each sends
// its next request when the last one ends) and the outputs are printed in input order, with a summary
// (requests, tokens, seconds, time to first token) on stderr; --warmup runs the lines once, untimed, first.
//
//   dspark_generate ENGINE_DIR [--ids] [--max-new-tokens 64] [--temperature 0] [--seed 0] [--stop 0,1]
//                   [--threads 8] [--callback] [--max-requests 64] [--max-seq-len 1024] [--scheduler dspark] < prompts.txt
//
// A refused request prints "error: <status>: <message>" in its place and the exit status is 1.
#include "dspark.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
    std::string engine_dir;
    bool ids = false, callback = false, warmup = false;
    int threads = 0;  // 0: serial (streaming); N: N client threads
    dspark::Params params;
    dspark::Options options;
};

struct Outcome {
    dspark::Tokens tokens;
    std::string error;
    double ttft_s = -1;
};

dspark::Tokens parse_ids(const std::string &line) {
    std::string spaced(line);
    std::replace(spaced.begin(), spaced.end(), ',', ' ');
    std::istringstream in(spaced);
    dspark::Tokens ids;
    long long value;
    while (in >> value) ids.push_back(static_cast<int32_t>(value));
    if (!in.eof()) throw std::invalid_argument("not a list of token ids: " + line);
    return ids;
}

std::string join(const dspark::Tokens &ids) {
    std::string out;
    for (size_t i = 0; i < ids.size(); i++) {
        if (i) out += ' ';
        out += std::to_string(ids[i]);
    }
    return out;
}

dspark::Request submit(dspark::Engine &engine, const Config &cfg, const std::string &line,
                       dspark::Callback on_tokens = {}) {
    if (cfg.ids) return engine.submit(parse_ids(line), cfg.params, std::move(on_tokens));
    return engine.submit(std::string_view(line), cfg.params, std::move(on_tokens));
}

// One request, start to end, by polling (the request's iterator) or by callback; `chunk` sees each step's tokens.
// With a callback and stream = false, this thread sleeps until the end: the loop thread collects the tokens.
template <typename OnChunk>
Outcome run_one(dspark::Engine &engine, const Config &cfg, const std::string &line, OnChunk chunk,
                bool stream = true) {
    Outcome out;
    auto start = Clock::now();
    auto first = [&] {
        if (out.ttft_s < 0) out.ttft_s = std::chrono::duration<double>(Clock::now() - start).count();
    };
    try {
        if (!cfg.callback) {
            dspark::Request request = submit(engine, cfg, line);
            for (const dspark::Tokens &tokens : request) {
                first();
                out.tokens.insert(out.tokens.end(), tokens.begin(), tokens.end());
                chunk(out.tokens, tokens.size());
            }
            return out;
        }
        std::mutex mutex;
        std::condition_variable cv;
        bool done = false;
        dspark_finish_reason reason = DSPARK_FINISH_NONE;
        size_t seen = 0;
        dspark::Request request = submit(engine, cfg, line, [&](dspark::Chunk tokens, bool finished,
                                                                 dspark_finish_reason why) {
            std::lock_guard<std::mutex> lock(mutex);  // on the engine's loop thread
            if (tokens.size) first();
            out.tokens.insert(out.tokens.end(), tokens.begin(), tokens.end());
            done = finished;
            reason = why;
            if (stream || finished) cv.notify_one();
        });
        std::unique_lock<std::mutex> lock(mutex);
        while (true) {
            cv.wait(lock, [&] { return done || out.tokens.size() > seen; });
            if (out.tokens.size() > seen) chunk(out.tokens, out.tokens.size() - seen);
            seen = out.tokens.size();
            if (done) break;
        }
        if (reason == DSPARK_FINISH_ERROR) out.error = "DSPARK_FINISH_ERROR: the request failed";
    } catch (const std::exception &e) {
        out.error = e.what();
    }
    return out;
}

// Text so far, minus a trailing U+FFFD (an incomplete UTF-8 sequence that later tokens complete).
std::string settled(const std::string &text) {
    static const std::string replacement = "\xEF\xBF\xBD";
    if (text.size() >= 3 && text.compare(text.size() - 3, 3, replacement) == 0) return text.substr(0, text.size() - 3);
    return text;
}

int serial(dspark::Engine &engine, const Config &cfg) {
    int failures = 0;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::string printed;
        bool any = false;
        Outcome out = run_one(engine, cfg, line, [&](const dspark::Tokens &all, size_t fresh) {
            if (cfg.ids) {
                for (size_t i = all.size() - fresh; i < all.size(); i++) std::cout << (any ? " " : "") << all[i], any = true;
            } else {
                std::string text = settled(engine.detokenize(all));
                if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
                    std::cout << text.substr(printed.size());
                    printed = text;
                }
            }
            std::cout.flush();
        });
        if (!cfg.ids && out.error.empty()) {
            std::string text = engine.detokenize(out.tokens);
            if (text.compare(0, printed.size(), printed) == 0) std::cout << text.substr(printed.size());
        }
        if (!out.error.empty()) {
            std::cout << (any || !printed.empty() ? " " : "") << "error: " << out.error;
            failures++;
        }
        std::cout << std::endl;
    }
    return failures ? 1 : 0;
}

std::string escaped(const std::string &text) {
    std::string out;
    for (char c : text) out += c == '\n' ? std::string("\\n") : c == '\\' ? std::string("\\\\") : std::string(1, c);
    return out;
}

int threaded(dspark::Engine &engine, const Config &cfg) {
    std::vector<std::string> lines;
    for (std::string line; std::getline(std::cin, line);) lines.push_back(line);
    std::vector<Outcome> outcomes(lines.size());
    auto start = Clock::now();
    for (int pass = cfg.warmup ? 0 : 1; pass < 2; pass++) {  // --warmup: the same work once, untimed
        start = Clock::now();
        std::vector<std::thread> clients;
        for (int t = 0; t < cfg.threads; t++) {
            clients.emplace_back([&, t] {
                for (size_t i = t; i < lines.size(); i += cfg.threads)
                    outcomes[i] = run_one(engine, cfg, lines[i], [](const dspark::Tokens &, size_t) {}, false);
            });
        }
        for (std::thread &client : clients) client.join();
    }
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    int failures = 0;
    size_t tokens = 0;
    std::string ttft;
    for (const Outcome &out : outcomes) {
        if (!out.error.empty()) {
            std::cout << "error: " << out.error << "\n";
            failures++;
            continue;
        }
        std::cout << (cfg.ids ? join(out.tokens) : escaped(engine.detokenize(out.tokens))) << "\n";
        tokens += out.tokens.size();
        if (!ttft.empty()) ttft += ',';
        ttft += std::to_string(out.ttft_s * 1e3);
    }
    std::cout.flush();
    std::fprintf(stderr, "# threads=%d requests=%zu tokens=%zu seconds=%.6f tok_per_s=%.1f ttft_ms=%s\n", cfg.threads,
                 lines.size(), tokens, seconds, tokens / seconds, ttft.c_str());
    return failures ? 1 : 0;
}

[[noreturn]] void usage(const char *problem) {
    std::fprintf(stderr, "dspark_generate: %s\nusage: dspark_generate ENGINE_DIR [--ids] [--max-new-tokens N] "
                 "[--temperature T] [--seed S] [--stop ID,ID] [--threads N] [--callback] [--max-requests N] "
                 "[--max-seq-len N] [--scheduler MODE] [--warmup] < prompts\n", problem);
    std::exit(2);
}

Config parse(int argc, char **argv) {
    Config cfg;
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage((arg + " needs a value").c_str());
            return argv[++i];
        };
        try {
            if (arg == "--ids") cfg.ids = true;
            else if (arg == "--callback") cfg.callback = true;
            else if (arg == "--warmup") cfg.warmup = true;
            else if (arg == "--max-new-tokens") cfg.params.max_new_tokens = std::stoi(value());
            else if (arg == "--temperature") cfg.params.temperature = std::stod(value());
            else if (arg == "--seed") cfg.params.seed = std::stoll(value());
            else if (arg == "--stop") cfg.params.stop_ids = parse_ids(value());
            else if (arg == "--threads") cfg.threads = std::max(1, std::stoi(value()));
            else if (arg == "--max-requests") cfg.options.max_requests = std::stoi(value());
            else if (arg == "--max-seq-len") cfg.options.max_seq_len = std::stoi(value());
            else if (arg == "--scheduler") cfg.options.scheduler = value();
            else if (arg.rfind("--", 0) == 0) usage(("unknown option " + arg).c_str());
            else if (cfg.engine_dir.empty()) cfg.engine_dir = arg;
            else usage("more than one ENGINE_DIR");
        } catch (const std::logic_error &) {
            usage(("bad value for " + arg).c_str());
        }
    }
    if (cfg.engine_dir.empty()) usage("no ENGINE_DIR");
    return cfg;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc == 2 && std::string(argv[1]) == "--version") {
        std::printf("dspark C API %d (header %d)\n", dspark_version(), DSPARK_API_VERSION);
        return 0;
    }
    Config cfg = parse(argc, argv);
    try {
        dspark::Engine engine(cfg.engine_dir, cfg.options);
        return cfg.threads > 0 ? threaded(engine, cfg) : serial(engine, cfg);
    } catch (const dspark::Error &e) {
        std::fprintf(stderr, "dspark_generate: %s\n", e.what());
        return 2;
    }
}
