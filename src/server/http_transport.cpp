#include "server/http_transport.h"

#include <fmt/core.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <deque>
#include <mutex>
#include <optional>
#include <strings.h>
#include <thread>
#include <utility>
#include <sys/socket.h>

#include "base/error.h"

namespace serval::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;

std::string Request::header(const std::string& name) const {
  for (const auto& [k, v] : headers)
    if (strcasecmp(k.c_str(), name.c_str()) == 0) return v;
  return "";
}

namespace {

using Seconds = std::chrono::duration<double>;

std::chrono::steady_clock::duration to_duration(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(Seconds(s));
}

// The status line and header fields of a response; the body follows.
std::string response_head(int status, bool http10, const std::string& content_type, const Headers& headers,
                          std::optional<size_t> content_length, bool keep_alive) {
  std::string head = fmt::format("HTTP/1.{} {} {}\r\nServer: serval\r\n", http10 ? 0 : 1, status,
                                 std::string(bhttp::obsolete_reason(bhttp::status(status))));
  if (!content_type.empty()) head += "Content-Type: " + content_type + "\r\n";
  for (const auto& [k, v] : headers) head += k + ": " + v + "\r\n";
  const bool bodyless = status < 200 || status == 204 || status == 304;
  if (content_length && !bodyless) head += fmt::format("Content-Length: {}\r\n", *content_length);
  else if (!http10) head += "Transfer-Encoding: chunked\r\n";
  head += keep_alive ? (http10 ? "Connection: keep-alive\r\n" : "") : "Connection: close\r\n";
  return head + "\r\n";
}

}  // namespace

// What every connection needs from its transport.
struct Shared {
  TransportConfig cfg;
  Handler handler;
  Response (*error_page)(int, const std::string&, const std::string&);
  std::atomic<size_t> open{0}, peak{0};
};

template <class Stream>
class Connection : public std::enable_shared_from_this<Connection<Stream>> {
 public:
  template <class... Args>
  explicit Connection(Shared& shared, Args&&... args) : sh_(shared), stream_(std::forward<Args>(args)...) {
    const size_t now = ++sh_.open;
    size_t peak = sh_.peak.load();
    while (now > peak && !sh_.peak.compare_exchange_weak(peak, now)) {}
  }
  ~Connection() { --sh_.open; }

  void start() {
    if constexpr (kTls) {
      lowest().expires_after(to_duration(sh_.cfg.header_timeout_s));
      stream_.async_handshake(net::ssl::stream_base::server, [self = this->shared_from_this()](beast::error_code ec) {
        if (ec) return self->close();
        self->read_idle();
      });
    } else {
      read_idle();
    }
  }

  // The Exchange calls, already on this connection's strand.
  void respond(uint64_t seq, Response r) {
    if (!current(seq) || replied_) return;
    replied_ = response_done_ = true;
    enqueue(response_head(r.status, http10_, r.content_type, r.headers, r.body.size(), keep_alive_) + r.body);
  }
  void begin_stream(uint64_t seq, int status, const std::string& content_type, const Headers& headers) {
    if (!current(seq) || replied_) return;
    replied_ = streaming_ = true;
    if (http10_) keep_alive_ = false;  // no chunked encoding: the end of the body is the end of the connection
    enqueue(response_head(status, http10_, content_type, headers, std::nullopt, keep_alive_));
  }
  void write_chunk(uint64_t seq, const std::string& data) {
    if (!current(seq) || !streaming_ || response_done_ || data.empty()) return;
    enqueue(http10_ ? data : fmt::format("{:x}\r\n", data.size()) + data + "\r\n");
  }
  void end_stream(uint64_t seq) {
    if (!current(seq) || !streaming_ || response_done_) return;
    response_done_ = true;
    enqueue(http10_ ? std::string() : std::string("0\r\n\r\n"));
  }
  void on_disconnect(uint64_t seq, std::function<void()> fn) {
    if (seq != seq_ || response_done_) return;
    if (closed_) return fn();
    on_gone_ = std::move(fn);
  }
  auto executor() { return stream_.get_executor(); }

 private:
  static constexpr bool kTls = !std::is_same_v<Stream, beast::tcp_stream>;
  Shared& sh_;
  Stream stream_;
  beast::flat_buffer buf_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::deque<std::string> out_;
  size_t out_bytes_ = 0;
  uint64_t seq_ = 0;  // the request being answered
  bool busy_ = false, replied_ = false, streaming_ = false, response_done_ = false;
  bool keep_alive_ = true, http10_ = false, writing_ = false, watching_ = false, want_next_ = false, closed_ = false;
  std::function<void()> on_gone_;
  bool lingering_ = false;
  std::optional<net::steady_timer> linger_;

  beast::tcp_stream& lowest() { return beast::get_lowest_layer(stream_); }
  bool current(uint64_t seq) const { return seq == seq_ && busy_ && !closed_; }

  // Waits for the first byte of the next request (the keep-alive timeout).
  void read_idle() {
    if (closed_) return;
    if (buf_.size() > 0) return read_header();
    lowest().expires_after(to_duration(sh_.cfg.keep_alive_timeout_s));
    stream_.async_read_some(buf_.prepare(4096), [self = this->shared_from_this()](beast::error_code ec, size_t n) {
      self->buf_.commit(n);
      if (ec) return self->close();
      self->read_header();
    });
  }

  void read_header() {
    parser_.emplace();
    parser_->header_limit(uint32_t(sh_.cfg.max_header_bytes));
    parser_->body_limit(sh_.cfg.max_body_bytes);
    lowest().expires_after(to_duration(sh_.cfg.header_timeout_s));
    bhttp::async_read_header(stream_, buf_, *parser_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      self->on_header(ec);
    });
  }

  void on_header(beast::error_code ec) {
    if (ec == bhttp::error::header_limit) return reject(431, "The request headers are too large");
    if (ec == bhttp::error::body_limit) return reject(413, body_limit_message());
    if (ec == beast::error::timeout || ec == net::error::eof || ec == net::error::operation_aborted ||
        ec == net::error::connection_reset || ec == bhttp::error::end_of_stream)
      return close();
    if (ec) return reject(400, "Malformed HTTP request: " + ec.message());
    if (parser_->get().version() == 11 && beast::iequals(parser_->get()[bhttp::field::expect], "100-continue") &&
        !parser_->is_done())
      enqueue_raw("HTTP/1.1 100 Continue\r\n\r\n");
    lowest().expires_after(to_duration(sh_.cfg.body_timeout_s));
    bhttp::async_read(stream_, buf_, *parser_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      self->on_request(ec);
    });
  }

  std::string body_limit_message() const { return fmt::format("The request body exceeds {} bytes", sh_.cfg.max_body_bytes); }

  // Answers a request that could not be read, then closes.
  void reject(int status, const std::string& message) {
    busy_ = true;
    keep_alive_ = false;
    replied_ = streaming_ = response_done_ = false;
    ++seq_;
    std::string path;
    if (parser_) {  // the request line is kept once parsed, even when a header field was refused
      path = std::string(parser_->get().target());
      path = path.substr(0, path.find('?'));
    }
    respond(seq_, sh_.error_page(status, message, path));
  }

  void on_request(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) return reject(413, body_limit_message());
    if (ec == beast::error::timeout) return close();  // the body did not arrive in time (socket already shut)
    if (ec == net::error::eof || ec == net::error::connection_reset || ec == bhttp::error::end_of_stream ||
        ec == bhttp::error::partial_message)
      return close();
    if (ec) return reject(400, "Malformed HTTP request: " + ec.message());
    auto msg = parser_->release();
    Request req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.path = req.target.substr(0, req.target.find('?'));
    for (const auto& f : msg) req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    req.body = std::move(msg.body());
    keep_alive_ = msg.keep_alive();
    http10_ = msg.version() == 10;
    busy_ = true;
    replied_ = streaming_ = response_done_ = false;
    ++seq_;
    watch();
    dispatch(req);
  }

  void dispatch(Request& req);

  // While a request is answered, a read stays pending: its end is the client hanging up. Bytes that
  // arrive (a pipelined request) are kept for later.
  void watch() {
    if (closed_ || watching_ || (!lingering_ && buf_.size() >= sh_.cfg.max_header_bytes)) return;
    lowest().expires_never();
    watching_ = true;
    stream_.async_read_some(buf_.prepare(4096), [self = this->shared_from_this()](beast::error_code ec, size_t n) {
      self->watching_ = false;
      self->buf_.commit(n);
      if (self->lingering_) return self->on_linger_read(ec);
      const bool next = std::exchange(self->want_next_, false);  // cancelled because the reply is out
      if (ec == net::error::operation_aborted && next) return self->read_idle();
      if (ec) return self->gone();
      if (self->busy_) return self->watch();
      self->read_idle();
    });
  }

  void enqueue_raw(std::string data) {
    out_bytes_ += data.size();
    out_.push_back(std::move(data));
    if (!writing_) write_next();
  }

  void enqueue(std::string data) {
    if (closed_) return;
    if (streaming_ && out_bytes_ > sh_.cfg.max_buffered_bytes) return gone();  // the client stopped reading
    if (data.empty()) {
      if (!writing_ && out_.empty()) finish_response();
      return;
    }
    enqueue_raw(std::move(data));
  }

  void write_next() {
    writing_ = true;
    lowest().expires_after(to_duration(sh_.cfg.write_timeout_s));  // a pending watch read keeps its own timer
    net::async_write(stream_, net::buffer(out_.front()), [self = this->shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->out_bytes_ -= self->out_.front().size();
      self->out_.pop_front();
      if (ec) return self->gone();
      if (!self->out_.empty()) return self->write_next();
      if (self->response_done_ && self->busy_) self->finish_response();
    });
  }

  // The last byte of a reply is out: next request, or close.
  void finish_response() {
    busy_ = false;
    on_gone_ = nullptr;
    if (closed_) return;
    if (!keep_alive_) return shutdown();
    if (watching_) {
      want_next_ = true;
      lowest().socket().cancel();
      return;
    }
    read_idle();
  }

  // The client went away (or stopped reading): tell the request's owner, close.
  void gone() {
    if (closed_) return;
    auto fn = std::move(on_gone_);
    on_gone_ = nullptr;
    close();
    if (fn && busy_ && !response_done_) fn();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (linger_) linger_->cancel();
    beast::error_code ec;
    lowest().socket().shutdown(tcp::socket::shutdown_both, ec);
    lowest().close();
  }

  // Ends a connection after its last reply without losing that reply: unread bytes at close() would
  // make the kernel send a reset, so what the client still sends is read and dropped for up to 2 s.
  void shutdown() {
    lingering_ = true;
    linger_.emplace(stream_.get_executor(), std::chrono::seconds(2));
    linger_->async_wait([self = this->shared_from_this()](beast::error_code) { self->close(); });
    if constexpr (kTls) {
      if (watching_) lowest().socket().cancel();  // async_shutdown reads too
      stream_.async_shutdown([self = this->shared_from_this()](beast::error_code) { self->close(); });
    } else {
      beast::error_code ec;
      lowest().socket().shutdown(tcp::socket::shutdown_send, ec);
      buf_.consume(buf_.size());
      watch();
    }
  }

  void on_linger_read(beast::error_code ec) {
    buf_.consume(buf_.size());
    if constexpr (!kTls) {
      if (ec) return close();
      watch();
    }
  }
};

namespace {

// The handle a request's owner holds: each call hops onto the connection's strand.
template <class Conn>
class ConnExchange final : public Exchange {
 public:
  ConnExchange(std::shared_ptr<Conn> conn, uint64_t seq) : conn_(std::move(conn)), seq_(seq) {}
  void respond(Response r) override { post([r = std::move(r)](Conn& c, uint64_t s) mutable { c.respond(s, std::move(r)); }); }
  void begin_stream(int status, std::string content_type, Headers headers) override {
    post([=](Conn& c, uint64_t s) { c.begin_stream(s, status, content_type, headers); });
  }
  void write_chunk(std::string data) override {
    post([d = std::move(data)](Conn& c, uint64_t s) { c.write_chunk(s, d); });
  }
  void end_stream() override { post([](Conn& c, uint64_t s) { c.end_stream(s); }); }
  void on_disconnect(std::function<void()> fn) override {
    post([f = std::move(fn)](Conn& c, uint64_t s) mutable { c.on_disconnect(s, std::move(f)); });
  }

 private:
  std::shared_ptr<Conn> conn_;
  uint64_t seq_;
  template <class F>
  void post(F&& f) {
    net::post(conn_->executor(), [c = conn_, s = seq_, f = std::forward<F>(f)]() mutable { f(*c, s); });
  }
};

}  // namespace

template <class Stream>
void Connection<Stream>::dispatch(Request& req) {
  auto exchange = std::make_shared<ConnExchange<Connection<Stream>>>(this->shared_from_this(), seq_);
  try {
    sh_.handler(req, exchange);
  } catch (const std::exception& e) {
    respond(seq_, sh_.error_page(500, std::string("internal error: ") + e.what(), req.path));
  }
}

struct Transport::Impl {
  Shared shared;
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::optional<net::ssl::context> ssl;
  std::vector<std::thread> threads;
  std::optional<net::steady_timer> retry;

  void accept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      if (ec) {  // out of descriptors, say: try again shortly rather than spin
        retry.emplace(ioc, std::chrono::milliseconds(50));
        retry->async_wait([this](beast::error_code) { accept(); });
        return;
      }
      accept();  // first: nothing below may stop the server from accepting
      try {
        if (shared.open.load() >= shared.cfg.max_connections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else if (ssl) {
          std::make_shared<Connection<beast::ssl_stream<beast::tcp_stream>>>(shared, std::move(socket), *ssl)->start();
        } else {
          std::make_shared<Connection<beast::tcp_stream>>(shared, std::move(socket))->start();
        }
      } catch (const std::exception& e) {
        fmt::print(stderr, "serval: dropped a new connection: {}\n", e.what());
      }
    });
  }
};

Transport::Transport(TransportConfig config, Handler handler,
                     Response (*error_page)(int, const std::string&, const std::string&))
    : impl_(std::make_unique<Impl>()) {
  impl_->shared.cfg = std::move(config);
  impl_->shared.handler = std::move(handler);
  impl_->shared.error_page = error_page;
  const auto& cfg = impl_->shared.cfg;
  check(cfg.ssl_certfile.empty() == cfg.ssl_keyfile.empty(), "--ssl-certfile and --ssl-keyfile go together");
  if (!cfg.ssl_certfile.empty()) {
    auto& ctx = impl_->ssl.emplace(net::ssl::context::tls_server);
    ctx.set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 | net::ssl::context::no_sslv3 |
                    net::ssl::context::no_tlsv1 | net::ssl::context::no_tlsv1_1);
    beast::error_code ec;
    ctx.use_certificate_chain_file(cfg.ssl_certfile, ec);
    check(!ec, "cannot use the certificate {}: {}", cfg.ssl_certfile, ec.message());
    ctx.use_private_key_file(cfg.ssl_keyfile, net::ssl::context::pem, ec);
    check(!ec, "cannot use the private key {}: {}", cfg.ssl_keyfile, ec.message());
  }
}

Transport::~Transport() { stop(); }

int Transport::listen() {
  const auto& cfg = impl_->shared.cfg;
  beast::error_code ec;
  const auto address = net::ip::make_address(cfg.host == "localhost" ? "127.0.0.1" : cfg.host, ec);
  check(!ec, "cannot listen on {}: not an IP address", cfg.host);
  const tcp::endpoint endpoint(address, uint16_t(cfg.port));
  auto& a = impl_->acceptor;
  a.open(endpoint.protocol(), ec);
  check(!ec, "cannot open a socket: {}", ec.message());
  a.set_option(net::socket_base::reuse_address(true), ec);  // restart while old connections sit in TIME_WAIT
  if (cfg.reuse_port) {
    const int one = 1;
    ::setsockopt(a.native_handle(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
  }
  a.bind(endpoint, ec);
  check(!ec, "cannot listen on {}:{}: {}", cfg.host, cfg.port, ec.message());
  a.listen(net::socket_base::max_listen_connections, ec);
  check(!ec, "cannot listen on {}:{}: {}", cfg.host, cfg.port, ec.message());
  return a.local_endpoint().port();
}

void Transport::run() {
  impl_->accept();
  for (int i = 0; i < std::max(1, impl_->shared.cfg.io_threads); ++i)
    impl_->threads.emplace_back([this] {
      while (true) {  // a handler that throws must not take the I/O thread (and the server) down
        try {
          impl_->ioc.run();
          return;
        } catch (const std::exception& e) {
          fmt::print(stderr, "serval: an I/O handler failed: {}\n", e.what());
        }
      }
    });
}

void Transport::stop() {
  impl_->ioc.stop();
  for (auto& t : impl_->threads)
    if (t.joinable()) t.join();
  impl_->threads.clear();
  beast::error_code ec;
  impl_->acceptor.close(ec);  // no I/O thread is left: safe here; new clients are refused from now on
}

boost::asio::any_io_executor Transport::executor() { return impl_->ioc.get_executor(); }
size_t Transport::open_connections() const { return impl_->shared.open.load(); }
size_t Transport::peak_connections() const { return impl_->shared.peak.load(); }

}  // namespace serval::http
