// The HTTP/1.1 transport under the API: Boost.Beast over Asio, event-driven on a few I/O threads.
// Keep-alive, optional TLS, a normal listen backlog, bounded header/body sizes, timeouts for idle
// keep-alive connections, slow headers and slow bodies, and a read kept pending while a request is
// answered so that a client that hangs up is noticed at once (streaming or not).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/any_io_executor.hpp>

namespace serval::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // target without the query
  Headers headers;
  std::string body;
  // The first header of that name (case-insensitive), or "".
  std::string header(const std::string& name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  Headers headers;
};

// One request's reply. Every member may be called from any thread; calls are applied in order.
// Either respond() once, or begin_stream(), any number of write_chunk(), then end_stream().
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void respond(Response response) = 0;
  virtual void begin_stream(int status, std::string content_type, Headers headers) = 0;
  virtual void write_chunk(std::string data) = 0;
  virtual void end_stream() = 0;
  // `fn` runs once (on an I/O thread) if the client goes away before the reply is complete;
  // at once if it already has.
  virtual void on_disconnect(std::function<void()> fn) = 0;
};

// Runs on an I/O thread: answer cheap requests inline, hand the rest to other threads.
using Handler = std::function<void(Request&, std::shared_ptr<Exchange>)>;

struct TransportConfig {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: any free port
  int io_threads = 2;
  bool reuse_port = false;         // SO_REUSEPORT: only when asked
  size_t max_body_bytes = 4u << 20;
  size_t max_header_bytes = 64u << 10;
  size_t max_connections = 16384;  // more are accepted and closed at once
  size_t max_buffered_bytes = 16u << 20;  // a reader this far behind is treated as gone
  double keep_alive_timeout_s = 5;  // idle keep-alive connection (and a new one before its first byte)
  double header_timeout_s = 10;     // from the first byte to the end of the headers
  double body_timeout_s = 60;       // for the body
  double write_timeout_s = 60;      // one write (a client that stops reading is dropped after this)
  std::string ssl_certfile, ssl_keyfile;  // both set: HTTPS
};

class Transport {
 public:
  // error_page: the response for a request the transport refuses (status, message, and the request's
  // path when its headers were read, else "").
  Transport(TransportConfig config, Handler handler,
            Response (*error_page)(int status, const std::string& message, const std::string& path));
  ~Transport();
  // Binds and listens; throws Error with the reason (e.g. the port is in use). Returns the port.
  int listen();
  // Starts the I/O threads.
  void run();
  // Stops accepting, closes every connection and joins the I/O threads.
  void stop();
  // An executor of the transport's I/O context, for timers and strands of the layers above.
  boost::asio::any_io_executor executor();
  size_t open_connections() const;
  size_t peak_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace serval::http
