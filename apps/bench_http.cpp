// `serval bench-serving --url`: an async HTTP load generator on Boost.Beast. One io_context thread
// runs every connection; each request is an `Exchange` (connect or reuse a keep-alive connection,
// send, read the SSE stream chunk by chunk, time each chunk with text). A `LevelRun` drives one
// concurrency (or request rate) of a sweep; `summarize` turns its outcomes into the reported figures.
#include <atomic>
#include "apps/bench_http.h"

#include <fmt/core.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cctype>
#include <climits>
#include <cmath>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "base/error.h"

extern char** environ;

namespace serval::cli {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace fs = std::filesystem;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using Stream = beast::tcp_stream;

constexpr size_t kMaxKeptBody = 64 * 1024;  // of an error reply or a non-streaming one

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// ---------------------------------------------------------------------------------------------
// Options and the target URL

// The server: where to connect and the path prefix before /v1.
struct Target {
  std::string url, host, port, prefix, api_key;
  tcp::resolver::results_type endpoints;
  double timeout_s = 600;
};

std::pair<std::string, std::string> split_host_port(const std::string& authority, const std::string& url) {
  std::string host = authority, port = "80";
  const size_t colon = authority.rfind(':');
  const size_t bracket = authority.rfind(']');
  if (colon != std::string::npos && (bracket == std::string::npos || colon > bracket)) {
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
    const auto digit = [](unsigned char c) { return std::isdigit(c) != 0; };
    const bool digits = !port.empty() && port.size() <= 5 && std::all_of(port.begin(), port.end(), digit);
    check(digits && std::stoi(port) >= 1 && std::stoi(port) <= 65535, "--url '{}': bad port '{}'", url, port);
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  check(!host.empty(), "--url '{}': no host (expected http://HOST[:PORT])", url);
  return {host, port};
}

// http://HOST[:PORT][/PREFIX][/v1] -> Target (not yet resolved).
Target parse_url(const std::string& url) {
  check(url.rfind("https://", 0) != 0, "--url '{}': https is not supported by the benchmark client; use http://", url);
  const std::string scheme = "http://";
  check(url.rfind(scheme, 0) == 0, "--url '{}': expected http://HOST[:PORT][/PATH]", url);
  const std::string rest = url.substr(scheme.size());
  check(rest.find_first_of("?# \t") == std::string::npos, "--url '{}': no query, fragment or spaces allowed", url);
  const size_t slash = rest.find('/');
  Target t;
  t.url = url;
  std::tie(t.host, t.port) = split_host_port(rest.substr(0, slash), url);
  t.prefix = slash == std::string::npos ? "" : rest.substr(slash);
  while (!t.prefix.empty() && t.prefix.back() == '/') t.prefix.pop_back();
  const size_t n = t.prefix.size();
  if (n >= 3 && t.prefix.compare(n - 3, 3, "/v1") == 0) t.prefix.resize(n - 3);
  return t;
}

Target make_target(net::io_context& io, const HttpBenchOptions& o) {
  Target t = parse_url(o.url);
  t.api_key = o.api_key;
  t.timeout_s = o.timeout_s;
  beast::error_code ec;
  t.endpoints = tcp::resolver(io).resolve(t.host, t.port, ec);
  check(!ec, "--url '{}': cannot resolve host '{}': {}", o.url, t.host, ec.message());
  return t;
}

void validate(const HttpBenchOptions& o) {
  check(o.requests > 0, "--requests must be positive");
  check(o.output_len > 0, "--output-len must be a positive number of tokens with --url");
  check(o.prompt_words >= 0 && o.shared_prefix_words >= 0, "--prompt-words and --shared-prefix-words must be >= 0");
  check(!o.prompt_file.empty() || o.prompt_words + o.shared_prefix_words > 0, "the prompts would be empty");
  check(o.endpoint == "completions" || o.endpoint == "chat", "--endpoint is completions or chat, not '{}'", o.endpoint);
  check(o.slo_ttft_ms >= 0 && o.slo_tpot_ms >= 0, "--slo-ttft-ms and --slo-tpot-ms must be >= 0");
  check(o.timeout_s > 0, "--timeout must be positive");
  check(!o.concurrency.empty() || !o.request_rate.empty(), "no --concurrency and no --request-rate");
  check(o.request_rate.empty() || o.concurrency.size() <= 1,
        "with --request-rate, --concurrency is one value (the most requests in flight)");
  for (const std::string& path : {o.json_path, o.plot_path}) {
    const fs::path dir = fs::path(path).parent_path();
    check(path.empty() || dir.empty() || fs::is_directory(dir), "{}: no such directory '{}'", path, dir.string());
  }
}

// ---------------------------------------------------------------------------------------------
// Prompts

// Common English words: synthetic prompts are random draws from these (seeded).
constexpr const char* kWords[] = {
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what",
    "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do",
    "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some",
    "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see",
    "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil",
    "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over", "new",
    "sound", "take", "only", "little", "work", "know", "place", "year", "live", "me", "back", "give", "most",
    "very", "after", "thing", "our", "just", "name", "good", "sentence", "man", "think", "say", "great",
    "where", "help", "through", "much", "before", "line", "right", "too", "mean", "old", "any", "same", "tell",
    "boy", "follow", "came", "want", "show", "also", "around", "form", "three", "small", "set", "put", "end",
    "does", "another", "well", "large", "must", "big", "even", "such", "because", "turn", "here", "why", "ask",
    "went", "men", "read", "need", "land", "different", "home", "us", "move", "try", "kind", "hand", "picture",
    "again", "change", "off", "play", "spell", "air", "away", "animal", "house", "point", "page", "letter",
    "mother", "answer", "found", "study", "still", "learn", "should", "America", "world", "high", "every",
    "near", "add", "food", "between", "own", "below", "country", "plant", "last", "school", "father", "keep",
    "tree", "never", "start", "city", "earth", "eye", "light", "thought", "head", "under", "story", "saw"};

std::string random_words(std::mt19937_64& rng, int n) {
  constexpr size_t count = sizeof(kWords) / sizeof(kWords[0]);
  std::string s;
  for (int i = 0; i < n; ++i) {
    if (i) s += ' ';
    s += kWords[rng() % count];
  }
  return s;
}

// The prompts, in order: the shared prefix, then random words or the next line of --prompt-file.
class Prompts {
 public:
  explicit Prompts(const HttpBenchOptions& o) : rng_(o.seed), words_(o.prompt_words) {
    if (!o.prompt_file.empty()) read_file(o.prompt_file);
    prefix_ = random_words(rng_, o.shared_prefix_words);
  }

  std::string next() {
    const std::string body = lines_.empty() ? random_words(rng_, words_) : lines_[line_++ % lines_.size()];
    return prefix_.empty() ? body : body.empty() ? prefix_ : prefix_ + " " + body;
  }

 private:
  void read_file(const std::string& path) {
    std::ifstream in(path);
    check(in.good(), "--prompt-file {}: cannot open it", path);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") != std::string::npos) lines_.push_back(line);
    }
    check(!lines_.empty(), "--prompt-file {}: no prompts in it (one a line)", path);
  }

  std::mt19937_64 rng_;
  int words_;
  std::string prefix_;
  std::vector<std::string> lines_;
  size_t line_ = 0;
};

// ---------------------------------------------------------------------------------------------
// One HTTP call and what came back

struct Call {
  bhttp::verb verb = bhttp::verb::post;
  std::string target, body;
  bool stream = true, chat = false;
};

// --extra-body with %REQ% replaced by the next request number.
json extra_body(const std::string& text) {
  static std::atomic<int64_t> serial{0};
  std::string t = text;
  const std::string n = std::to_string(serial++);
  for (size_t at = t.find("%REQ%"); at != std::string::npos; at = t.find("%REQ%", at + n.size())) t.replace(at, 5, n);
  json j = json::parse(t, nullptr, false);
  check(j.is_object(), "--extra-body must be a JSON object");
  return j;
}

Call generation_call(const HttpBenchOptions& o, const Target& t, const std::string& model, const std::string& prompt,
                     int max_tokens) {
  json b = {{"model", model},  {"max_tokens", max_tokens}, {"temperature", 0},
            {"stream", true},  {"ignore_eos", true},       {"stream_options", {{"include_usage", true}}}};
  const bool chat = o.endpoint == "chat";
  if (chat) b["messages"] = json::array({json{{"role", "user"}, {"content", prompt}}});
  else b["prompt"] = prompt;
  if (!o.extra_body.empty()) b.update(extra_body(o.extra_body));
  Call c;
  c.target = t.prefix + (chat ? "/v1/chat/completions" : "/v1/completions");
  c.body = b.dump(-1, ' ', false, json::error_handler_t::replace);
  c.chat = chat;
  return c;
}

struct Outcome {
  int status = 0;                  // 0: no reply
  std::string error;               // empty: succeeded
  double start = 0, end = 0;       // seconds since the run began
  std::vector<double> chunks;      // arrival time of each streamed chunk with text
  int64_t completion_tokens = -1;  // from `usage`, when the server sends it
  int64_t prompt_tokens = -1;
  std::string body;                // non-streaming and error replies (the first 64 KiB)

  int64_t tokens() const { return completion_tokens >= 0 ? completion_tokens : int64_t(chunks.size()); }
};

std::string clip(std::string_view s, size_t n = 300) {
  return s.size() <= n ? std::string(s) : std::string(s.substr(0, n)) + "...";
}

// The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body itself.
std::string error_message(const json& j) {
  const json* e = j.contains("error") ? &j["error"] : &j;
  if (e->is_string()) return e->get<std::string>();
  if (e->is_object() && e->contains("message") && (*e)["message"].is_string()) return (*e)["message"];
  return clip(j.dump());
}

std::string http_error(int status, const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  const std::string msg = j.is_object() ? error_message(j) : clip(body);
  return fmt::format("HTTP {} {}{}{}", status, std::string(bhttp::obsolete_reason(bhttp::status(status))),
                     msg.empty() ? "" : ": ", msg);
}

int64_t int_field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it != obj.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
}

// Splits a text/event-stream body into `data:` lines and reads the OpenAI chunks in them.
class SseReader {
 public:
  explicit SseReader(bool chat) : chat_(chat) {}

  void feed(std::string_view bytes, double now, Outcome& out) {
    for (const char c : bytes) {
      if (c != '\n') {
        line_ += c;
        continue;
      }
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (line_.rfind("data:", 0) == 0) {
        std::string_view payload(line_);
        payload.remove_prefix(payload.size() > 5 && payload[5] == ' ' ? 6 : 5);
        on_data(payload, now, out);
      }
      line_.clear();
    }
  }

 private:
  static bool nonempty_string(const json& obj, const char* key) {
    const auto it = obj.find(key);
    return it != obj.end() && it->is_string() && !it->get_ref<const std::string&>().empty();
  }

  // Whether a choice of a chunk carries text (the chat role-only first chunk does not).
  bool has_text(const json& choice) const {
    if (!choice.is_object()) return false;
    if (!chat_) return nonempty_string(choice, "text");
    const auto d = choice.find("delta");
    return d != choice.end() && d->is_object() &&
           (nonempty_string(*d, "content") || nonempty_string(*d, "reasoning_content"));
  }

  void on_data(std::string_view payload, double now, Outcome& out) {
    if (payload == "[DONE]") return;
    const json j = json::parse(payload, nullptr, false);
    if (!j.is_object()) {
      if (out.error.empty()) out.error = "unreadable stream chunk: " + clip(payload);
      return;
    }
    if (j.contains("error") && out.error.empty()) out.error = "error in the stream: " + error_message(j);
    if (const auto u = j.find("usage"); u != j.end() && u->is_object()) {
      out.completion_tokens = int_field(*u, "completion_tokens");
      out.prompt_tokens = int_field(*u, "prompt_tokens");
    }
    const auto c = j.find("choices");
    if (c != j.end() && c->is_array() && !c->empty() && has_text(c->front())) out.chunks.push_back(now);
  }

  bool chat_;
  std::string line_;
};

// ---------------------------------------------------------------------------------------------
// Exchange: one request on a new or reused keep-alive connection

// Called with the outcome and, when the connection can serve another request, the connection.
using Finished = std::function<void(Outcome, std::optional<Stream>)>;

class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(net::io_context& io, const Target& t, const Call& call, Clock::time_point t0, std::optional<Stream> idle,
           Finished done)
      : t_(t), call_(call), t0_(t0), stream_(idle ? std::move(*idle) : Stream(io)), reused_(idle.has_value()),
        sse_(call.chat), done_(std::move(done)) {
    req_ = bhttp::request<bhttp::string_body>(call.verb, call.target, 11);
    req_.set(bhttp::field::host, t.host + ":" + t.port);
    req_.set(bhttp::field::user_agent, "serval-bench-serving");
    req_.set(bhttp::field::accept, call.stream ? "text/event-stream" : "application/json");
    if (!t.api_key.empty()) req_.set(bhttp::field::authorization, "Bearer " + t.api_key);
    if (call.verb == bhttp::verb::post) req_.set(bhttp::field::content_type, "application/json");
    req_.body() = call.body;
    req_.keep_alive(true);
    req_.prepare_payload();
  }

  void start() {
    out_.start = now();
    if (reused_) send();
    else connect();
  }

 private:
  double now() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }
  void arm() { stream_.expires_after(to_duration(t_.timeout_s)); }

  void connect() {
    arm();
    stream_.async_connect(t_.endpoints, [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
      if (ec) return self->failed(ec, "connect");
      self->stream_.socket().set_option(tcp::no_delay(true), ec);
      self->send();
    });
  }

  void send() {
    parser_.emplace();
    parser_->body_limit(boost::none);
    buf_.clear();
    arm();
    bhttp::async_write(stream_, req_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->failed(ec, "send");
      self->arm();
      bhttp::async_read_header(self->stream_, self->buf_, *self->parser_, [self](beast::error_code ec, size_t) {
        if (ec) return self->failed(ec, "read");
        self->out_.status = self->parser_->get().result_int();
        self->read_body();
      });
    });
  }

  void read_body() {
    if (parser_->is_done()) return finish();
    arm();
    bhttp::async_read_some(stream_, buf_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      self->take_body();
      if (ec) return self->failed(ec, "read");
      self->read_body();
    });
  }

  // Moves what the parser has of the body into the outcome (the stream reader, or the kept body).
  void take_body() {
    std::string& body = parser_->get().body();
    if (out_.status == 200 && call_.stream) sse_.feed(body, now(), out_);
    else if (out_.body.size() < kMaxKeptBody) out_.body.append(body, 0, kMaxKeptBody - out_.body.size());
    body.clear();
  }

  void failed(beast::error_code ec, const char* what) {
    beast::error_code ignored;
    stream_.socket().close(ignored);
    const bool timeout = ec == beast::error::timeout;
    if (reused_ && out_.status == 0 && !timeout) {  // the server had closed the idle keep-alive connection: anew
      reused_ = false;
      return connect();
    }
    out_.error = fmt::format("{} failed: {}", what,
                             timeout ? fmt::format("no data for {:g} s (--timeout)", t_.timeout_s) : ec.message());
    finish();
  }

  void finish() {
    out_.end = now();
    if (out_.error.empty() && out_.status != 200) out_.error = http_error(out_.status, out_.body);
    if (out_.error.empty() && call_.stream && out_.chunks.empty()) out_.error = "the stream ended without any text";
    std::optional<Stream> keep;
    if (stream_.socket().is_open() && parser_ && parser_->is_done() && parser_->get().keep_alive())
      keep.emplace(std::move(stream_));
    done_(std::move(out_), std::move(keep));
  }

  const Target& t_;
  const Call& call_;
  Clock::time_point t0_;
  Stream stream_;
  bool reused_;
  bhttp::request<bhttp::string_body> req_;
  beast::flat_buffer buf_;
  std::optional<bhttp::response_parser<bhttp::string_body>> parser_;
  SseReader sse_;
  Outcome out_;
  Finished done_;
};

// Runs one call to its end on `io` (nothing else running) and returns its outcome.
Outcome run_one(net::io_context& io, const Target& t, const Call& call) {
  Outcome result;
  std::make_shared<Exchange>(io, t, call, Clock::now(), std::nullopt,
                             [&](Outcome o, std::optional<Stream>) { result = std::move(o); })
      ->start();
  io.restart();
  io.run();
  return result;
}

// ---------------------------------------------------------------------------------------------
// One level of a sweep: a concurrency (closed loop) or a request rate (open loop, Poisson)

struct Level {
  int concurrency = 0;  // closed loop: requests in flight; open loop: the cap (0: none)
  double rate = 0;      // requests/s; 0: closed loop
};

std::string label(const Level& l) {
  if (l.rate <= 0) return std::to_string(l.concurrency);
  return fmt::format("{:g} req/s{}", l.rate, l.concurrency > 0 ? fmt::format(" (max {})", l.concurrency) : "");
}

class LevelRun {
 public:
  LevelRun(net::io_context& io, const Target& t, const std::vector<Call>& calls, Level level, uint64_t seed)
      : io_(io), t_(t), calls_(calls), outcomes_(calls.size()), timer_(io),
        cap_(level.concurrency > 0 ? level.concurrency : INT_MAX), rate_(level.rate) {
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(rate_ > 0 ? rate_ : 1.0);
    for (size_t i = 0; i < calls.size(); ++i)
      arrivals_.push_back(i == 0 || rate_ <= 0 ? 0.0 : arrivals_.back() + gap(rng));
  }

  // Runs every call; returns the outcomes in call order.
  std::vector<Outcome> run() {
    t0_ = Clock::now();
    schedule();
    io_.restart();
    io_.run();
    return std::move(outcomes_);
  }

 private:
  // Requests arrive at their times (all at once in a closed loop) and wait for a free slot.
  void schedule() {
    while (arrived_ < calls_.size() && arrivals_[arrived_] <= 0) pending_.push_back(arrived_++);
    pump();
    if (arrived_ == calls_.size()) return;
    timer_.expires_at(t0_ + to_duration(arrivals_[arrived_]));
    timer_.async_wait([this](beast::error_code ec) {
      if (ec) return;
      pending_.push_back(arrived_++);
      schedule();
    });
  }

  void pump() {
    while (!pending_.empty() && in_flight_ < cap_) {
      const size_t i = pending_.front();
      pending_.pop_front();
      launch(i);
    }
  }

  void launch(size_t i) {
    ++in_flight_;
    std::optional<Stream> conn;
    if (!idle_.empty()) {
      conn.emplace(std::move(idle_.back()));
      idle_.pop_back();
    }
    std::make_shared<Exchange>(io_, t_, calls_[i], t0_, std::move(conn), [this, i](Outcome o, std::optional<Stream> s) {
      outcomes_[i] = std::move(o);
      --in_flight_;
      if (s) idle_.push_back(std::move(*s));
      pump();
    })->start();
  }

  net::io_context& io_;
  const Target& t_;
  const std::vector<Call>& calls_;
  std::vector<Outcome> outcomes_;
  std::vector<double> arrivals_;  // seconds after the start
  std::deque<size_t> pending_;    // arrived, not yet sent
  std::vector<Stream> idle_;      // keep-alive connections free for the next request
  net::steady_timer timer_;
  Clock::time_point t0_;
  size_t arrived_ = 0;
  int in_flight_ = 0, cap_;
  double rate_;
};

// ---------------------------------------------------------------------------------------------
// Figures

struct Dist {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
  size_t n = 0;
};

// Linear interpolation between closest ranks (numpy's default), on a sorted sample.
double percentile(const std::vector<double>& sorted, double p) {
  const double pos = p / 100.0 * double(sorted.size() - 1);
  const size_t lo = size_t(pos), hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - double(lo));
}

// Of a sample in seconds, in milliseconds.
Dist distribution(std::vector<double> v) {
  Dist d;
  d.n = v.size();
  if (v.empty()) return d;
  for (double& x : v) x *= 1e3;
  std::sort(v.begin(), v.end());
  for (double x : v) d.mean += x / double(v.size());
  d.p50 = percentile(v, 50), d.p90 = percentile(v, 90), d.p99 = percentile(v, 99);
  return d;
}

struct LevelResult {
  Level level;
  int completed = 0, failed = 0, good = 0;
  double seconds = 0;
  int64_t output_tokens = 0, input_tokens = 0;
  bool input_known = true;  // every request's usage gave its prompt tokens
  Dist ttft, tpot, itl, e2e;
  std::map<std::string, int> errors;  // message -> requests
};

bool meets_slo(const Outcome& r, const HttpBenchOptions& o) {
  const double ttft_ms = (r.chunks.front() - r.start) * 1e3;
  const double tpot_ms = r.tokens() > 1 ? (r.end - r.chunks.front()) * 1e3 / double(r.tokens() - 1) : 0;
  return (o.slo_ttft_ms <= 0 || ttft_ms <= o.slo_ttft_ms) && (o.slo_tpot_ms <= 0 || tpot_ms <= o.slo_tpot_ms);
}

LevelResult summarize(Level level, const std::vector<Outcome>& outcomes, const HttpBenchOptions& o) {
  LevelResult r;
  r.level = level;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const Outcome& x : outcomes) {
    r.seconds = std::max(r.seconds, x.end);
    if (!x.error.empty()) {
      ++r.failed, ++r.errors[x.error];
      continue;
    }
    ++r.completed;
    r.output_tokens += x.tokens();
    r.input_known = r.input_known && x.prompt_tokens >= 0;
    r.input_tokens += std::max<int64_t>(x.prompt_tokens, 0);
    r.good += meets_slo(x, o);
    ttft.push_back(x.chunks.front() - x.start);
    e2e.push_back(x.end - x.start);
    if (x.tokens() > 1) tpot.push_back((x.end - x.chunks.front()) / double(x.tokens() - 1));
    for (size_t k = 1; k < x.chunks.size(); ++k) itl.push_back(x.chunks[k] - x.chunks[k - 1]);
  }
  r.ttft = distribution(ttft), r.tpot = distribution(tpot), r.itl = distribution(itl), r.e2e = distribution(e2e);
  return r;
}

double per_second(double n, double seconds) { return seconds > 0 ? n / seconds : 0; }

// ---------------------------------------------------------------------------------------------
// Reports

std::string prompt_description(const HttpBenchOptions& o) {
  const std::string body = o.prompt_file.empty() ? fmt::format("{} random words", o.prompt_words)
                                                 : fmt::format("lines of {}", o.prompt_file);
  return o.shared_prefix_words > 0 ? fmt::format("{} shared words + {}", o.shared_prefix_words, body) : body;
}

std::string slo_text(double ms) { return ms > 0 ? fmt::format("{:g}", ms) : "any"; }

void print_header(const HttpBenchOptions& o, const std::string& model) {
  fmt::print("bench-serving {} ({} endpoint), model {}\n", o.url, o.endpoint, model);
  fmt::print("{} requests per run, prompts: {}, output {} tokens (ignore_eos), seed {}\n", o.requests,
             prompt_description(o), o.output_len, o.seed);
  if (o.slo_ttft_ms > 0 || o.slo_tpot_ms > 0)
    fmt::print("goodput SLO: TTFT <= {} ms, TPOT <= {} ms\n", slo_text(o.slo_ttft_ms), slo_text(o.slo_tpot_ms));
  fmt::print("\n");
}

void print_results(const std::vector<LevelResult>& results, bool by_rate) {
  const char* head = by_rate ? "request rate" : "concurrency";
  fmt::print("| {} | completed | failed | seconds | req/s | output tok/s | goodput req/s |\n", head);
  fmt::print("|---|---|---|---|---|---|---|\n");
  for (const LevelResult& r : results)
    fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.1f} | {:.2f} |\n", label(r.level), r.completed, r.failed,
               r.seconds, per_second(r.completed, r.seconds), per_second(double(r.output_tokens), r.seconds),
               per_second(r.good, r.seconds));
  fmt::print("\n| {} | metric (ms) | mean | p50 | p90 | p99 |\n|---|---|---|---|---|---|\n", head);
  for (const LevelResult& r : results) {
    const std::pair<const char*, Dist> rows[] = {{"TTFT", r.ttft}, {"TPOT", r.tpot}, {"ITL", r.itl}, {"E2E", r.e2e}};
    for (const auto& [name, d] : rows)
      fmt::print("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |\n", label(r.level), name, d.mean, d.p50, d.p90,
                 d.p99);
  }
}

json dist_json(const Dist& d) { return {{"mean", d.mean}, {"p50", d.p50}, {"p90", d.p90}, {"p99", d.p99}, {"n", d.n}}; }

json level_json(const LevelResult& r) {
  const bool open = r.level.rate > 0;
  json errors = json::object();
  for (const auto& [msg, n] : r.errors) errors[msg] = n;
  return {{"concurrency", open ? json(nullptr) : json(r.level.concurrency)},
          {"request_rate", open ? json(r.level.rate) : json(nullptr)},
          {"max_concurrency", open && r.level.concurrency > 0 ? json(r.level.concurrency) : json(nullptr)},
          {"completed", r.completed}, {"failed", r.failed}, {"errors", errors}, {"duration_s", r.seconds},
          {"total_output_tokens", r.output_tokens},
          {"total_input_tokens", r.input_known ? json(r.input_tokens) : json(nullptr)},
          {"request_throughput", per_second(r.completed, r.seconds)},
          {"output_throughput", per_second(double(r.output_tokens), r.seconds)},
          {"goodput", per_second(r.good, r.seconds)}, {"good_requests", r.good},
          {"ttft_ms", dist_json(r.ttft)}, {"tpot_ms", dist_json(r.tpot)}, {"itl_ms", dist_json(r.itl)},
          {"e2e_ms", dist_json(r.e2e)}};
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

json report_json(const HttpBenchOptions& o, const std::string& model, const std::vector<LevelResult>& results) {
  auto slo = [](double v) { return v > 0 ? json(v) : json(nullptr); };
  json meta = {{"url", o.url}, {"model", model}, {"endpoint", o.endpoint}, {"date", utc_now()},
               {"requests", o.requests}, {"output_len", o.output_len}, {"ignore_eos", true}, {"temperature", 0},
               {"mode", o.request_rate.empty() ? "concurrency" : "request-rate"}, {"seed", o.seed},
               {"prompts", {{"source", o.prompt_file.empty() ? "synthetic" : "file"},
                            {"prompt_words", o.prompt_file.empty() ? json(o.prompt_words) : json(nullptr)},
                            {"prompt_file", o.prompt_file.empty() ? json(nullptr) : json(o.prompt_file)},
                            {"shared_prefix_words", o.shared_prefix_words}}},
               {"slo", {{"ttft_ms", slo(o.slo_ttft_ms)}, {"tpot_ms", slo(o.slo_tpot_ms)}}}};
  json levels = json::array();
  for (const LevelResult& r : results) levels.push_back(level_json(r));
  return {{"metadata", meta}, {"results", levels}};
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  check(out.good(), "{}: cannot write it", path);
}

// scripts/plot_bench.py: $SERVAL_PLOT_SCRIPT, next to the build directory's parent, or in the source tree.
std::string plot_script() {
  if (const char* env = std::getenv("SERVAL_PLOT_SCRIPT"); env && *env) return env;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  const fs::path build_parent = ec ? fs::path() : exe.parent_path().parent_path();
  for (const fs::path& root : {build_parent, fs::path(__FILE__).parent_path().parent_path()}) {
    const fs::path script = root / "scripts" / "plot_bench.py";
    if (!root.empty() && fs::exists(script, ec)) return script.string();
  }
  fail("--plot: scripts/plot_bench.py not found (set SERVAL_PLOT_SCRIPT to its path)");
}

void run_plot(const std::string& script, const std::string& json_path, const std::string& png_path) {
  std::vector<std::string> args = {"python3", script, json_path, png_path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int status = 0;
  check(posix_spawnp(&pid, "python3", nullptr, nullptr, argv.data(), environ) == 0, "--plot: cannot run python3");
  check(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "--plot: {} failed (matplotlib missing? scripts/setup installs it)", script);
}

void plot(const std::string& script, const json& report, const HttpBenchOptions& o) {
  std::string json_path = o.json_path;
  if (json_path.empty()) {
    json_path = o.plot_path + ".json";
    write_file(json_path, report.dump(2) + "\n");
  }
  try {
    run_plot(script, json_path, o.plot_path);
  } catch (...) {
    if (o.json_path.empty()) fs::remove(json_path);
    throw;
  }
  if (o.json_path.empty()) fs::remove(json_path);
  fmt::print(stderr, "wrote {}\n", o.plot_path);
}

// ---------------------------------------------------------------------------------------------
// The run

// The model to name in requests: --served-model, else the first of GET /v1/models. Fails clearly
// when the server cannot be reached.
std::string pick_model(net::io_context& io, const Target& t, const HttpBenchOptions& o) {
  Call call;
  call.verb = bhttp::verb::get;
  call.target = t.prefix + "/v1/models";
  call.stream = false;
  const Outcome r = run_one(io, t, call);
  check(r.status != 0, "cannot reach {}: {}", o.url, r.error);
  if (!o.served_model.empty()) return o.served_model;
  check(r.error.empty(), "GET {}: {} (name the model with --served-model)", call.target, r.error);
  const json j = json::parse(r.body, nullptr, false);
  const bool listed = j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
                      j["data"][0].is_object() && j["data"][0].contains("id") && j["data"][0]["id"].is_string();
  check(listed, "GET {}: no model listed (name it with --served-model): {}", call.target, clip(r.body));
  return j["data"][0]["id"];
}

std::vector<Level> levels(const HttpBenchOptions& o) {
  std::vector<Level> out;
  if (o.request_rate.empty())
    for (int c : o.concurrency) out.push_back({c, 0});
  for (double rate : o.request_rate) out.push_back({o.concurrency.empty() ? 0 : o.concurrency.front(), rate});
  return out;
}

LevelResult run_level(net::io_context& io, const Target& t, const HttpBenchOptions& o, const std::string& model,
                      Prompts& prompts, Level level) {
  std::vector<Call> calls;
  for (int i = 0; i < o.requests; ++i) calls.push_back(generation_call(o, t, model, prompts.next(), o.output_len));
  fmt::print(stderr, "{} {}: {} requests...\n", level.rate > 0 ? "request rate" : "concurrency", label(level),
             o.requests);
  const LevelResult r = summarize(level, LevelRun(io, t, calls, level, o.seed).run(), o);
  fmt::print(stderr, "  {} completed, {} failed in {:.2f} s\n", r.completed, r.failed, r.seconds);
  return r;
}

void report_failures(const std::vector<LevelResult>& results) {
  int failed = 0, total = 0;
  std::string first;
  for (const LevelResult& r : results) {
    failed += r.failed, total += r.failed + r.completed;
    if (first.empty() && !r.errors.empty()) first = r.errors.begin()->first;
  }
  check(failed == 0, "{} of {} requests failed (first: {})", failed, total, first);
}

}  // namespace

std::vector<int> parse_int_list(const std::string& s, const char* flag) {
  std::vector<int> out;
  for (const double v : parse_rate_list(s, flag)) {
    check(v == std::floor(v) && v <= 1e6, "{} '{}': whole numbers up to 1000000 only", flag, s);
    out.push_back(int(v));
  }
  return out;
}

std::vector<double> parse_rate_list(const std::string& s, const char* flag) {
  std::vector<double> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    check(used > 0 && used == item.size() && std::isfinite(v) && v > 0,
          "{} '{}': expected positive numbers, comma-separated", flag, s);
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

void run_http_bench(const HttpBenchOptions& o) {
  validate(o);
  const std::string script = o.plot_path.empty() ? "" : plot_script();  // before the run, not after it
  net::io_context io;
  const Target t = make_target(io, o);
  const std::string model = pick_model(io, t, o);
  Prompts prompts(o);
  const Outcome test = run_one(io, t, generation_call(o, t, model, prompts.next(), std::min(o.output_len, 2)));
  check(test.error.empty(), "the test request to {} failed: {}", o.url, test.error);
  print_header(o, model);
  std::vector<LevelResult> results;
  for (const Level& level : levels(o)) results.push_back(run_level(io, t, o, model, prompts, level));
  print_results(results, !o.request_rate.empty());
  const json report = report_json(o, model, results);
  if (!o.json_path.empty()) write_file(o.json_path, report.dump(2) + "\n");
  if (!script.empty()) plot(script, report, o);
  report_failures(results);
}

}  // namespace serval::cli
