#include "server/jinja.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string_view>
#include <vector>

#include "base/error.h"

namespace serval::jinja {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------- limits and accounting
//
// Every parse and render runs with a State naming its Limits: the counters below are charged as the
// template works, and any limit exceeded throws serval::Error. Thread-local, so renders on different
// threads (HTTP workers) do not share counters.

struct State {
  const Limits* lim;
  uint64_t work = 0;
  int64_t iterations = 0;
  int depth = 0;  // calls (filters, blocks) in progress
};
thread_local State* g_state = nullptr;

const Limits& limits() {
  static const Limits defaults;
  return g_state ? *g_state->lim : defaults;
}

// Installs a State for the current thread for the lifetime of the scope.
class StateScope {
 public:
  explicit StateScope(const Limits& lim) : saved_(g_state) {
    state_.lim = &lim;
    g_state = &state_;
  }
  ~StateScope() { g_state = saved_; }
  StateScope(const StateScope&) = delete;
  StateScope& operator=(const StateScope&) = delete;

 private:
  State state_;
  State* saved_;
};

// Work units (about one byte copied each): a value element built or copied (an allocation, a copy,
// a destruction: far dearer than a byte), and one expression evaluated or statement run.
constexpr uint64_t kNodeCost = 64;
constexpr uint64_t kEvalCost = 16;

uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t sat_mul(uint64_t a, uint64_t b) { return b && a > UINT64_MAX / b ? UINT64_MAX : a * b; }

void charge(uint64_t units) {
  if (!g_state) return;
  g_state->work = sat_add(g_state->work, units);
  check(g_state->work <= g_state->lim->max_work,
        "chat template: work limit exceeded (the render does more than max_work = {} units of work)", g_state->lim->max_work);
}

// Charges a substring search of `needle` in `hay` at its worst case.
void charge_search(size_t hay, size_t needle) {
  if (needle == 0 || needle > hay) return charge(hay + 1);
  charge(sat_mul(hay - needle + 1, needle));
}

void tick_iteration() {
  if (!g_state) return;
  check(++g_state->iterations <= g_state->lim->max_loop_iterations,
        "chat template: loop iteration limit exceeded (more than {} iterations in one render)", g_state->lim->max_loop_iterations);
}

void check_string_size(size_t n) {
  check(n <= limits().max_string_bytes, "chat template: string size limit exceeded ({} bytes; the limit is {})", n,
        limits().max_string_bytes);
}
void check_list_size(size_t n) {
  check(n <= limits().max_list_items, "chat template: list size limit exceeded ({} items; the limit is {})", n,
        limits().max_list_items);
}

// Nesting of calls during a render: filters that apply filters (`map('map')`), nested blocks.
class DepthGuard {
 public:
  DepthGuard() {
    if (!g_state) return;
    if (g_state->depth >= g_state->lim->max_depth)
      fail("chat template: recursion depth limit exceeded (nesting deeper than {})", g_state->lim->max_depth);
    ++g_state->depth;
    active_ = true;
  }
  ~DepthGuard() {
    if (active_) --g_state->depth;
  }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  bool active_ = false;
};

// Checks a value's nesting and sizes against the limits and returns its work cost; never recurses
// deeper than max_depth, so it is safe on any input.
uint64_t measure(const json& j, int depth) {
  const Limits& lim = limits();
  check(depth <= lim.max_depth, "chat template: value nesting depth limit exceeded (deeper than {})", lim.max_depth);
  uint64_t cost = kNodeCost;
  if (j.is_string()) {
    const size_t n = j.get_ref<const std::string&>().size();
    check_string_size(n);
    cost += n;
  } else if (j.is_array()) {
    check_list_size(j.size());
    for (const auto& x : j) cost = sat_add(cost, measure(x, depth + 1));
  } else if (j.is_object()) {
    check_list_size(j.size());
    for (const auto& [k, v] : j.items()) cost = sat_add(cost, sat_add(k.size(), measure(v, depth + 1)));
  }
  return cost;
}

// ---------------------------------------------------------------- values

struct Value;
using Args = std::vector<Value>;
using Kwargs = std::map<std::string, Value>;
using Fn = std::function<Value(Args&, Kwargs&)>;

struct Value {
  enum class Kind { Undefined, Data, Namespace, Function } kind = Kind::Undefined;
  std::shared_ptr<const json> data;  // immutable and shared: copying a Value is cheap
  std::shared_ptr<json> ns;  // namespace(): an object shared by reference
  std::shared_ptr<Fn> fn;
  uint64_t cost = 0;  // work units of `data` (see measure)
  // A string marked safe (|safe, |escape): as markupsafe's Markup, adding a plain string to it with +
  // escapes the plain one (Jinja2 renders "x"|safe + y so without autoescape; ~ joins plainly).
  bool markup = false;

  static Value undefined() { return {}; }
  // Every value a template builds comes through here: checked against the limits and charged.
  static Value of(json j) {
    Value v;
    v.kind = Kind::Data;
    v.cost = measure(j, 0);
    charge(v.cost);
    v.data = std::make_shared<const json>(std::move(j));
    return v;
  }
  // A value from the render's input, measured before it is copied (the copy recurses).
  static Value input(const json& j) {
    Value v;
    v.kind = Kind::Data;
    v.cost = measure(j, 0);
    charge(v.cost);
    v.data = std::make_shared<const json>(j);
    return v;
  }
  static Value function(Fn f) { Value v; v.kind = Kind::Function; v.fn = std::make_shared<Fn>(std::move(f)); return v; }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_data() const { return kind == Kind::Data; }
  const json& j() const {
    static const json null_json;
    return kind == Kind::Data ? *data : kind == Kind::Namespace ? *ns : null_json;
  }
};

bool truthy(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return false;
  if (v.kind != Value::Kind::Data) return true;
  const json& j = v.j();
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_unsigned()) return j.get<uint64_t>() != 0;
  if (j.is_number_integer()) return j.get<int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0.0;
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();  // json::empty() is false for any string
  if (j.is_array() || j.is_object()) return !j.empty();
  return true;
}

// An integer operand; unsigned JSON numbers above INT64_MAX are out of range.
int64_t int_of(const json& j, const char* what) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    check(u <= uint64_t(INT64_MAX), "chat template: integer overflow ({} is out of range in {})", u, what);
    return int64_t(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
  fail("chat template: {} needs an integer, not {}", what, j.type_name());
}

// A double converted to int64 (truncating, as Python's int()); out of range or NaN is an error.
int64_t int_from_double(double d) {
  check(std::isfinite(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0,
        "chat template: integer overflow (cannot convert {} to a 64-bit integer)", d);
  return int64_t(d);
}

std::string py_float(double d) {
  if (std::floor(d) == d && std::abs(d) < 1e16) return fmt::format("{:.1f}", d);
  return fmt::format("{}", d);
}

// Python's str()/repr() of a value, appended to `out`; bounded by max_string_bytes (value depth is
// bounded by measure(), so the recursion is too).
void py_repr(const json& j, bool top, std::string& out) {
  charge(kNodeCost);
  auto grow = [&](std::string_view s) {
    check_string_size(out.size() + s.size());
    out += s;
  };
  if (j.is_null()) return grow("None");
  if (j.is_boolean()) return grow(j.get<bool>() ? "True" : "False");
  if (j.is_number_unsigned()) return grow(std::to_string(j.get<uint64_t>()));
  if (j.is_number_integer()) return grow(std::to_string(j.get<int64_t>()));
  if (j.is_number()) return grow(py_float(j.get<double>()));
  if (j.is_string()) {
    if (top) return grow(j.get_ref<const std::string&>());
    grow("'");
    grow(j.get_ref<const std::string&>());
    return grow("'");
  }
  if (j.is_array()) {
    grow("[");
    for (size_t i = 0; i < j.size(); ++i) {
      if (i) grow(", ");
      py_repr(j[i], false, out);
    }
    return grow("]");
  }
  grow("{");
  bool first = true;
  for (auto& [k, v] : j.items()) {
    if (!first) grow(", ");
    first = false;
    grow("'");
    grow(k);
    grow("': ");
    py_repr(v, false, out);
  }
  grow("}");
}

std::string py_repr(const json& j, bool top) {
  std::string out;
  py_repr(j, top, out);
  return out;
}

std::string to_string(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return "";
  if (v.kind == Value::Kind::Function) return "<function>";
  return py_repr(v.j(), true);
}

// json.dumps as Python writes it: ", " and ": " separators, optional indent, no ASCII escaping.
// Bounded by max_string_bytes; `indent` is at most max_string_bytes (checked by the caller) and
// `depth` at most max_depth, so indent * depth cannot overflow.
void py_json(const json& j, int64_t indent, int depth, std::string& out) {
  charge(kNodeCost);
  auto grow_by = [&](size_t n) { check_string_size(out.size() + n); };
  auto newline = [&](int d) {
    if (indent < 0) return;
    const size_t n = size_t(indent) * size_t(d);
    grow_by(n + 1);
    out += '\n';
    out.append(n, ' ');
  };
  auto put = [&](std::string_view s) {
    grow_by(s.size());
    out += s;
  };
  if (j.is_array() && !j.empty()) {
    put("[");
    for (size_t i = 0; i < j.size(); ++i) {
      if (i) put(indent < 0 ? ", " : ",");
      newline(depth + 1);
      py_json(j[i], indent, depth + 1, out);
    }
    newline(depth);
    put("]");
  } else if (j.is_object() && !j.empty()) {
    put("{");
    bool first = true;
    for (auto& [k, v] : j.items()) {
      if (!first) put(indent < 0 ? ", " : ",");
      first = false;
      newline(depth + 1);
      put(json(k).dump(-1, ' ', false, json::error_handler_t::replace) + ": ");
      py_json(v, indent, depth + 1, out);
    }
    newline(depth);
    put("}");
  } else {
    put(j.dump(-1, ' ', false, json::error_handler_t::replace));
  }
}

// ---------------------------------------------------------------- lexer

enum class Tok { Text, Expr, Stmt };
struct Piece {
  Tok kind;
  std::string text;
};

// Where the tag opened before `from` closes: the first `close` outside string literals (Jinja lexes a
// tag's tokens, so `{{ "}}" }}` is one expression); comments have no strings. npos if none.
size_t tag_end(const std::string& src, size_t from, const std::string& close, bool strings) {
  for (size_t i = from; i + 1 < src.size(); ++i) {
    if (src.compare(i, close.size(), close) == 0) return i;
    if (!strings || (src[i] != '"' && src[i] != '\'')) continue;
    const char quote = src[i];
    for (++i; i < src.size() && src[i] != quote; ++i)
      if (src[i] == '\\') ++i;  // an escaped character, the quote included
  }
  return std::string::npos;
}

std::vector<Piece> lex(const std::string& src) {
  std::vector<Piece> out;
  size_t pos = 0;
  bool strip_next = false;  // a '-' closed the previous tag
  bool after_block = false;  // trim_blocks: drop one newline after a block tag
  while (pos <= src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open + 1 >= src.size()) open = std::string::npos;
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    bool at_line_start = pos == 0;
    if (after_block && !text.empty() && text[0] == '\n') text.erase(0, 1), at_line_start = true;
    if (strip_next) text.erase(0, text.find_first_not_of(" \t\r\n") == std::string::npos ? text.size() : text.find_first_not_of(" \t\r\n"));
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Tok::Text, text});
      break;
    }
    const char kind = src[open + 1];
    const bool strip_before = open + 2 < src.size() && src[open + 2] == '-';
    const bool keep_before = open + 2 < src.size() && src[open + 2] == '+';
    if (strip_before) {
      text.erase(text.find_last_not_of(" \t\r\n") == std::string::npos ? 0 : text.find_last_not_of(" \t\r\n") + 1);
    } else if (kind != '{' && !keep_before) {  // lstrip_blocks: whitespace before a block tag at a line start
      const size_t newline = text.find_last_of('\n');
      const size_t from = newline == std::string::npos ? 0 : newline + 1;
      if ((newline != std::string::npos || at_line_start) && text.find_first_not_of(" \t", from) == std::string::npos)
        text.erase(from);
    }
    if (!text.empty()) out.push_back({Tok::Text, text});
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t end = tag_end(src, open + 2, close, kind != '#');
    check(end != std::string::npos, "chat template: unclosed '{{{}' tag", kind);
    size_t body_begin = open + 2 + (strip_before || keep_before ? 1 : 0);
    size_t body_end = end;
    strip_next = body_end > body_begin && src[body_end - 1] == '-';
    if (strip_next) --body_end;
    const std::string body = src.substr(body_begin, body_end - body_begin);
    if (kind == '{') out.push_back({Tok::Expr, body});
    else if (kind == '%') out.push_back({Tok::Stmt, body});
    after_block = kind != '{';
    pos = end + 2;
  }
  return out;
}

// ---------------------------------------------------------------- expression tokens

struct ETok {
  enum Kind { Name, Number, String, Op, End } kind;
  std::string text;
  json number;
};

std::vector<ETok> tokenize_expr(const std::string& s) {
  std::vector<ETok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) { ++i; continue; }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({ETok::Name, s.substr(i, j - i), {}});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || (s[j] == '.' && !is_float && j + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[j + 1]))))) {
        if (s[j] == '.') is_float = true;
        ++j;
      }
      const std::string num = s.substr(i, j - i);
      json value;
      errno = 0;
      if (is_float) {
        value = std::strtod(num.c_str(), nullptr);
      } else {
        const long long v = std::strtoll(num.c_str(), nullptr, 10);
        value = int64_t(v);
      }
      check(errno != ERANGE, "chat template: integer overflow (number literal {} is out of range)", num.substr(0, 40));
      out.push_back({ETok::Number, num, std::move(value)});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string val;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          val += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
        } else {
          val += s[j];
        }
      }
      check(j < s.size(), "chat template: unterminated string");
      out.push_back({ETok::String, val, {}});
      i = j + 1;
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      check(std::string("+-*/%~<>=!()[]{}.,:|").find(c) != std::string::npos, "chat template: unexpected character '{}'", c);
      out.push_back({ETok::Op, op, {}});
      i += op.size();
    }
  }
  out.push_back({ETok::End, "", {}});
  return out;
}

// ---------------------------------------------------------------- AST

struct Context;
struct Expr {
  int height = 1;  // of the tree under this node; at most max_depth (checked by the parser)
  virtual ~Expr() = default;
  Value eval(Context& ctx) const {
    charge(kEvalCost);
    return do_eval(ctx);
  }
  virtual Value do_eval(Context& ctx) const = 0;
};
using ExprP = std::shared_ptr<Expr>;

}  // namespace serval::jinja

namespace serval::jinja {

struct Context {
  std::vector<std::map<std::string, Value>> scopes;
  Value lookup(const std::string& name) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined();
  }
  void set(const std::string& name, Value v) { scopes.back()[name] = std::move(v); }
};

Value call_filter(const std::string& name, Value v, Args& args, Kwargs& kw);
bool call_test(const std::string& name, const Value& v, Args& args);
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);

struct Literal : Expr {
  Value v;
  explicit Literal(Value x) : v(std::move(x)) {}
  Value do_eval(Context&) const override { return v; }
};
struct Var : Expr {
  std::string name;
  explicit Var(std::string n) : name(std::move(n)) {}
  Value do_eval(Context& c) const override { return c.lookup(name); }
};
struct Attr : Expr {
  ExprP obj;
  std::string name;
  Value do_eval(Context& c) const override { return get_attr(obj->eval(c), name); }
};
struct Item : Expr {
  ExprP obj, key;
  Value do_eval(Context& c) const override { return get_item(obj->eval(c), key->eval(c)); }
};
struct Slice : Expr {
  ExprP obj, start, stop, step;
  // Python's slice: x[a:b:k] (k may be negative: messages[::-1]), indices clamped as Python clamps them.
  Value do_eval(Context& c) const override {
    const Value o = obj->eval(c);
    const json& j = o.j();
    check(j.is_array() || j.is_string(), "chat template: slicing needs a list or a string");
    const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get_ref<const std::string&>().size());
    auto given = [&](const ExprP& e, int64_t* x) {
      if (!e) return false;
      const Value v = e->eval(c);
      if (v.is_undefined() || v.j().is_null()) return false;
      *x = int_of(v.j(), "a slice index");
      return true;
    };
    int64_t k = 1;
    given(step, &k);
    check(k != 0, "chat template: slice step cannot be zero");
    // Bounds: [0, n] going forward, [-1, n - 1] going backward (-1: before the first element).
    const int64_t lo = k > 0 ? 0 : -1, hi = k > 0 ? n : n - 1;
    auto bound = [&](const ExprP& e, int64_t dflt) {
      int64_t x;
      if (!given(e, &x)) return dflt;
      if (x < 0) x += n;  // x >= INT64_MIN and n >= 0: cannot overflow
      return std::clamp<int64_t>(x, lo, hi);
    };
    const int64_t a = bound(start, k > 0 ? 0 : n - 1), b = bound(stop, k > 0 ? n : -1);
    std::vector<int64_t> at;
    for (int64_t i = a; k > 0 ? i < b : i > b; i += k) {
      at.push_back(i);
      if (k > 0 ? i > b - k : i < b - k) break;  // the next step would pass b (or overflow)
    }
    charge(at.size() * kEvalCost);
    if (j.is_string()) {
      const std::string& str = j.get_ref<const std::string&>();
      std::string out;
      for (int64_t i : at) out += str[size_t(i)];
      return Value::of(std::move(out));
    }
    json out = json::array();
    for (int64_t i : at) out.push_back(j[size_t(i)]);
    return Value::of(std::move(out));
  }
};
struct Call : Expr {
  ExprP callee;
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  Value do_eval(Context& c) const override {
    const Value f = callee->eval(c);
    check(f.kind == Value::Kind::Function, "chat template: calling something that is not a function");
    Args a;
    Kwargs k;
    for (auto& e : args) a.push_back(e->eval(c));
    for (auto& [n, e] : kwargs) k[n] = e->eval(c);
    DepthGuard guard;
    return (*f.fn)(a, k);
  }
};
struct FilterExpr : Expr {
  ExprP value;
  std::string name;
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  Value do_eval(Context& c) const override {
    Args a;
    Kwargs k;
    for (auto& e : args) a.push_back(e->eval(c));
    for (auto& [n, e] : kwargs) k[n] = e->eval(c);
    return call_filter(name, value->eval(c), a, k);
  }
};
struct TestExpr : Expr {
  ExprP value;
  std::string name;
  std::vector<ExprP> args;
  bool negated = false;
  Value do_eval(Context& c) const override {
    Args a;
    for (auto& e : args) a.push_back(e->eval(c));
    return Value::of(call_test(name, value->eval(c), a) != negated);
  }
};

[[noreturn]] void overflow(const char* op) { fail("chat template: integer overflow in '{}'", op); }

int64_t checked_neg(int64_t x) {
  int64_t r;
  if (__builtin_sub_overflow(int64_t(0), x, &r)) overflow("-");
  return r;
}

struct Unary : Expr {
  std::string op;
  ExprP e;
  Value do_eval(Context& c) const override {
    const Value v = e->eval(c);
    if (op == "not") return Value::of(!truthy(v));
    const json& j = v.j();
    check(j.is_number(), "chat template: unary minus needs a number");
    return Value::of(j.is_number_integer() ? json(checked_neg(int_of(j, "unary minus"))) : json(-j.get<double>()));
  }
};

// Python's floor division and modulo on int64 (the result takes the divisor's sign).
int64_t floor_div(int64_t x, int64_t y) {
  check(y != 0, "chat template: division by zero");
  if (x == INT64_MIN && y == -1) overflow("//");
  int64_t q = x / y;
  if (x % y != 0 && ((x % y < 0) != (y < 0))) --q;
  return q;
}
int64_t floor_mod(int64_t x, int64_t y) {
  check(y != 0, "chat template: modulo by zero");
  if (y == -1) return 0;  // also INT64_MIN % -1, which is 0 in Python (and SIGFPE in C++)
  int64_t r = x % y;
  if (r != 0 && ((r < 0) != (y < 0))) r += y;  // opposite signs: cannot overflow
  return r;
}
int64_t checked_pow(int64_t base, int64_t e) {
  int64_t result = 1;
  while (e > 0) {
    if (e & 1)
      if (__builtin_mul_overflow(result, base, &result)) overflow("**");
    e >>= 1;
    // A further bit is set, so base squared is a factor of the result: its overflow is the result's.
    if (e > 0 && __builtin_mul_overflow(base, base, &base)) overflow("**");
  }
  return result;
}

// `s * n` (Python: n <= 0 gives "").
Value repeat_string(const std::string& s, int64_t n) {
  if (n <= 0 || s.empty()) return Value::of("");
  check(uint64_t(n) <= limits().max_string_bytes / s.size(),
        "chat template: string size limit exceeded (repeating {} bytes {} times; the limit is {} bytes)", s.size(), n,
        limits().max_string_bytes);
  charge(s.size() * size_t(n));
  std::string out;
  out.reserve(s.size() * size_t(n));
  for (int64_t i = 0; i < n; ++i) out += s;
  return Value::of(std::move(out));
}
// `list * n`
Value repeat_list(const Value& l, int64_t n) {
  const json& a = l.j();
  if (n <= 0 || a.empty()) return Value::of(json::array());
  check(uint64_t(n) <= limits().max_list_items / a.size(),
        "chat template: list size limit exceeded (repeating {} items {} times; the limit is {} items)", a.size(), n,
        limits().max_list_items);
  charge(sat_mul(l.cost, uint64_t(n)));
  json out = json::array();
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), a.begin(), a.end());
  return Value::of(std::move(out));
}

// markupsafe's escape: & < > " ' as entities.
std::string html_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += ch;
    }
  }
  check_string_size(out.size());
  return out;
}

Value markup_of(std::string s) {
  Value v = Value::of(std::move(s));
  v.markup = true;
  return v;
}

Value arithmetic(const std::string& op, const Value& l, const Value& r) {
  const json &a = l.j(), &b = r.j();
  if (op == "+" && a.is_string() && b.is_string() && (l.markup || r.markup)) {  // Markup.__add__ (~ joins plainly)
    const std::string x = l.markup ? to_string(l) : html_escape(to_string(l));
    const std::string y = r.markup ? to_string(r) : html_escape(to_string(r));
    check_string_size(x.size() + y.size());
    return markup_of(x + y);
  }
  if (op == "~") {
    const std::string x = to_string(l), y = to_string(r);
    check_string_size(x.size() + y.size());
    return Value::of(x + y);
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    check_string_size(a.get_ref<const std::string&>().size() + b.get_ref<const std::string&>().size());
    return Value::of(a.get<std::string>() + b.get<std::string>());
  }
  if (op == "+" && a.is_array() && b.is_array()) {
    check_list_size(a.size() + b.size());
    json out = a;
    out.insert(out.end(), b.begin(), b.end());
    return Value::of(std::move(out));
  }
  if (op == "*" && a.is_string() && b.is_number_integer()) return repeat_string(a.get_ref<const std::string&>(), int_of(b, "'*'"));
  if (op == "*" && a.is_number_integer() && b.is_string()) return repeat_string(b.get_ref<const std::string&>(), int_of(a, "'*'"));
  if (op == "*" && a.is_array() && b.is_number_integer()) return repeat_list(l, int_of(b, "'*'"));
  if (op == "*" && a.is_number_integer() && b.is_array()) return repeat_list(r, int_of(a, "'*'"));
  check(a.is_number() && b.is_number(), "chat template: '{}' between {} and {}", op, a.type_name(), b.type_name());
  const bool ints = a.is_number_integer() && b.is_number_integer();
  if (ints && op != "/") {
    const int64_t x = int_of(a, op.c_str()), y = int_of(b, op.c_str());
    int64_t z;
    if (op == "+") {
      if (__builtin_add_overflow(x, y, &z)) overflow("+");
      return Value::of(z);
    }
    if (op == "-") {
      if (__builtin_sub_overflow(x, y, &z)) overflow("-");
      return Value::of(z);
    }
    if (op == "*") {
      if (__builtin_mul_overflow(x, y, &z)) overflow("*");
      return Value::of(z);
    }
    if (op == "//") return Value::of(floor_div(x, y));
    if (op == "%") return Value::of(floor_mod(x, y));
    if (op == "**") {
      if (y >= 0) return Value::of(checked_pow(x, y));
      check(x != 0, "chat template: division by zero (0 ** negative)");
      return Value::of(std::pow(double(x), double(y)));
    }
  }
  const double x = a.get<double>(), y = b.get<double>();
  if (op == "+") return Value::of(x + y);
  if (op == "-") return Value::of(x - y);
  if (op == "*") return Value::of(x * y);
  if (op == "**") {
    check(!(x == 0 && y < 0), "chat template: division by zero (0 ** negative)");
    return Value::of(std::pow(x, y));
  }
  check(y != 0, "chat template: division by zero");
  if (op == "/") return Value::of(x / y);
  if (op == "//") return Value::of(std::floor(x / y));
  double m = std::fmod(x, y);
  if (m != 0 && ((m < 0) != (y < 0))) m += y;  // Python: the result takes the divisor's sign
  return Value::of(m);
}

bool contains(const Value& hay, const Value& needle) {
  const json& h = hay.j();
  if (h.is_string()) {
    if (!needle.j().is_string()) return false;
    const std::string& n = needle.j().get_ref<const std::string&>();
    charge_search(h.get_ref<const std::string&>().size(), n.size());
    return h.get_ref<const std::string&>().find(n) != std::string::npos;
  }
  charge(hay.cost);
  if (h.is_array()) return std::find(h.begin(), h.end(), needle.j()) != h.end();
  if (h.is_object()) return needle.j().is_string() && h.contains(needle.j().get_ref<const std::string&>());
  return false;
}

struct Binary : Expr {
  std::string op;
  ExprP l, r;
  Value do_eval(Context& c) const override {
    if (op == "and") {
      Value a = l->eval(c);
      return truthy(a) ? r->eval(c) : a;
    }
    if (op == "or") {
      Value a = l->eval(c);
      return truthy(a) ? a : r->eval(c);
    }
    const Value a = l->eval(c), b = r->eval(c);
    if (op == "==" || op == "!=") {
      charge(std::min(a.cost, b.cost));
      const bool eq = a.is_undefined() || b.is_undefined() ? (a.is_undefined() && b.is_undefined()) : a.j() == b.j();
      return Value::of(op == "==" ? eq : !eq);
    }
    if (op == "in") return Value::of(contains(b, a));
    if (op == "not in") return Value::of(!contains(b, a));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      const json &x = a.j(), &y = b.j();
      check((x.is_number() && y.is_number()) || (x.is_string() && y.is_string()), "chat template: cannot compare {} and {}",
            x.type_name(), y.type_name());
      charge(std::min(a.cost, b.cost));
      if (op == "<") return Value::of(x < y);
      if (op == ">") return Value::of(y < x);
      if (op == "<=") return Value::of(!(y < x));
      return Value::of(!(x < y));
    }
    return arithmetic(op, a, b);
  }
};
struct Ternary : Expr {
  ExprP cond, then, otherwise;
  Value do_eval(Context& c) const override {
    return truthy(cond->eval(c)) ? then->eval(c) : (otherwise ? otherwise->eval(c) : Value::undefined());
  }
};
struct ListLit : Expr {
  std::vector<ExprP> items;
  Value do_eval(Context& c) const override {
    json out = json::array();
    for (auto& e : items) out.push_back(e->eval(c).j());
    return Value::of(std::move(out));
  }
};
struct DictLit : Expr {
  std::vector<std::pair<ExprP, ExprP>> items;
  Value do_eval(Context& c) const override {
    json out = json::object();
    for (auto& [k, v] : items) out[to_string(k->eval(c))] = v->eval(c).j();
    return Value::of(std::move(out));
  }
};

// ---------------------------------------------------------------- expression parser

// Parser nesting is bounded by max_depth (so `((((...` cannot exhaust the stack), and so is the height
// of every tree it builds (so `1+1+...+1` cannot make evaluation or destruction recurse too deeply).
class ExprParser {
 public:
  explicit ExprParser(const std::string& src) : toks_(tokenize_expr(src)) {}
  ExprP parse_all() {
    ExprP e = parse_expr();
    check(at_end(), "chat template: unexpected '{}' in expression", peek().text);
    return e;
  }
  ExprP parse_expr() { return parse_ternary(); }
  const ETok& peek(size_t k = 0) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  bool at_end() const { return peek().kind == ETok::End; }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).kind == ETok::Op && peek(k).text == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).kind == ETok::Name && peek(k).text == n; }
  void expect_op(const char* op) {
    check(is_op(op), "chat template: expected '{}' but found '{}'", op, peek().text);
    ++pos_;
  }
  std::string name() {
    check(peek().kind == ETok::Name, "chat template: expected a name but found '{}'", peek().text);
    return toks_[pos_++].text;
  }

 private:
  std::vector<ETok> toks_;
  size_t pos_ = 0;
  int depth_ = 0;

  class Nest {
   public:
    explicit Nest(int& depth) : depth_(depth) {
      check(depth_ < limits().max_depth, "chat template: expression nesting depth limit exceeded (deeper than {})",
            limits().max_depth);
      ++depth_;
    }
    ~Nest() { --depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    int& depth_;
  };

  // Sets e's height from its children's and checks it.
  template <typename T>
  static std::shared_ptr<T> grown(std::shared_ptr<T> e, const std::vector<ExprP>& kids, std::initializer_list<const ExprP*> more = {}) {
    int h = 0;
    for (const ExprP& k : kids) h = std::max(h, k->height);
    for (const ExprP* k : more)
      if (*k) h = std::max(h, (*k)->height);
    e->height = h + 1;
    check(e->height <= limits().max_depth, "chat template: expression nesting depth limit exceeded (deeper than {})",
          limits().max_depth);
    return e;
  }
  template <typename T>
  static std::shared_ptr<T> grown(std::shared_ptr<T> e, std::initializer_list<const ExprP*> kids) {
    return grown(std::move(e), {}, kids);
  }

  ExprP parse_ternary() {
    Nest nest(depth_);
    ExprP e = parse_or();
    if (is_name("if")) {
      ++pos_;
      auto t = std::make_shared<Ternary>();
      t->then = e;
      t->cond = parse_or();
      if (is_name("else")) {
        ++pos_;
        t->otherwise = parse_ternary();
      }
      return grown(t, {&t->then, &t->cond, &t->otherwise});
    }
    return e;
  }
  ExprP binary(ExprP l, std::string op, ExprP r) {
    auto b = std::make_shared<Binary>();
    b->op = std::move(op), b->l = std::move(l), b->r = std::move(r);
    return grown(b, {&b->l, &b->r});
  }
  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) ++pos_, e = binary(e, "or", parse_and());
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) ++pos_, e = binary(e, "and", parse_not());
    return e;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      Nest nest(depth_);
      ++pos_;
      auto u = std::make_shared<Unary>();
      u->op = "not", u->e = parse_not();
      return grown(u, {&u->e});
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_concat();
    for (;;) {
      if (peek().kind == ETok::Op && (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))) {
        const std::string op = toks_[pos_++].text;
        e = binary(e, op, parse_concat());
      } else if (is_name("in")) {
        ++pos_, e = binary(e, "in", parse_concat());
      } else if (is_name("not") && is_name("in", 1)) {
        pos_ += 2, e = binary(e, "not in", parse_concat());
      } else if (is_name("is")) {
        ++pos_;
        auto t = std::make_shared<TestExpr>();
        if (is_name("not")) ++pos_, t->negated = true;
        t->value = e;
        t->name = name();
        if (is_op("(")) {
          ++pos_;
          while (!is_op(")")) {
            check(!at_end(), "chat template: unclosed '(' in test arguments");
            t->args.push_back(parse_expr());
            if (is_op(",")) ++pos_;
          }
          ++pos_;
        } else if (!at_end() && (peek().kind == ETok::String || peek().kind == ETok::Number)) {
          t->args.push_back(parse_primary());  // `is equalto 'x'`
        }
        e = grown(t, t->args, {&t->value});
      } else {
        return e;
      }
    }
  }
  ExprP parse_concat() {
    ExprP e = parse_add();
    while (is_op("~")) ++pos_, e = binary(e, "~", parse_add());
    return e;
  }
  ExprP parse_add() {
    ExprP e = parse_mul();
    while (is_op("+") || is_op("-")) {
      const std::string op = toks_[pos_++].text;
      e = binary(e, op, parse_mul());
    }
    return e;
  }
  ExprP parse_mul() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = toks_[pos_++].text;
      e = binary(e, op, parse_pow());
    }
    return e;
  }
  ExprP parse_pow() {  // as Jinja2: left-associative, and binding looser than unary minus
    ExprP e = parse_unary();
    while (is_op("**")) ++pos_, e = binary(e, "**", parse_unary());
    return e;
  }
  ExprP parse_unary() {
    if (is_op("-")) {
      Nest nest(depth_);
      ++pos_;
      auto u = std::make_shared<Unary>();
      u->op = "-", u->e = parse_unary();
      return grown(u, {&u->e});
    }
    if (is_op("+")) ++pos_;
    return parse_postfix(parse_primary());
  }
  void parse_call_args(std::vector<ExprP>& args, std::vector<std::pair<std::string, ExprP>>& kwargs) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == ETok::Name && is_op("=", 1)) {
        const std::string k = name();
        ++pos_;
        kwargs.emplace_back(k, parse_expr());
      } else {
        args.push_back(parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++pos_;
  }
  static std::vector<ExprP> values_of(const std::vector<std::pair<std::string, ExprP>>& kwargs) {
    std::vector<ExprP> out;
    for (auto& kv : kwargs) out.push_back(kv.second);
    return out;
  }
  ExprP parse_postfix(ExprP e) {
    for (;;) {
      if (is_op(".")) {
        ++pos_;
        auto a = std::make_shared<Attr>();
        a->obj = e, a->name = name();
        e = grown(a, {&a->obj});
      } else if (is_op("[")) {
        ++pos_;
        ExprP first = is_op(":") ? nullptr : parse_expr();
        if (is_op(":")) {
          ++pos_;
          auto s = std::make_shared<Slice>();
          s->obj = e, s->start = first;
          if (!is_op("]") && !is_op(":")) s->stop = parse_expr();
          if (is_op(":")) {
            ++pos_;
            if (!is_op("]")) s->step = parse_expr();
          }
          expect_op("]");
          e = grown(s, {&s->obj, &s->start, &s->stop, &s->step});
        } else {
          expect_op("]");
          auto it = std::make_shared<Item>();
          it->obj = e, it->key = first;
          e = grown(it, {&it->obj, &it->key});
        }
      } else if (is_op("(")) {
        auto call = std::make_shared<Call>();
        call->callee = e;
        parse_call_args(call->args, call->kwargs);
        std::vector<ExprP> kids = values_of(call->kwargs);
        kids.insert(kids.end(), call->args.begin(), call->args.end());
        e = grown(call, kids, {&call->callee});
      } else if (is_op("|")) {
        ++pos_;
        auto f = std::make_shared<FilterExpr>();
        f->value = e, f->name = name();
        if (is_op("(")) parse_call_args(f->args, f->kwargs);
        std::vector<ExprP> kids = values_of(f->kwargs);
        kids.insert(kids.end(), f->args.begin(), f->args.end());
        e = grown(f, kids, {&f->value});
      } else {
        return e;
      }
    }
  }
  ExprP parse_primary() {
    const ETok t = peek();
    ++pos_;
    if (t.kind == ETok::Number) return std::make_shared<Literal>(Value::of(t.number));
    if (t.kind == ETok::String) {
      std::string s = t.text;
      while (peek().kind == ETok::String) {  // adjacent literals concatenate
        check_string_size(s.size() + peek().text.size());
        s += toks_[pos_++].text;
      }
      return std::make_shared<Literal>(Value::of(s));
    }
    if (t.kind == ETok::Name) {
      if (t.text == "true" || t.text == "True") return std::make_shared<Literal>(Value::of(true));
      if (t.text == "false" || t.text == "False") return std::make_shared<Literal>(Value::of(false));
      if (t.text == "none" || t.text == "None") return std::make_shared<Literal>(Value::of(nullptr));
      return std::make_shared<Var>(t.text);
    }
    if (t.kind == ETok::Op && t.text == "(") {
      ExprP e = parse_expr();
      if (is_op(",")) {  // a tuple: treat as a list
        auto l = std::make_shared<ListLit>();
        l->items.push_back(e);
        while (is_op(",")) {
          ++pos_;
          if (is_op(")")) break;
          l->items.push_back(parse_expr());
        }
        e = grown(l, l->items);
      }
      expect_op(")");
      return e;
    }
    if (t.kind == ETok::Op && t.text == "[") {
      auto l = std::make_shared<ListLit>();
      while (!is_op("]")) {
        l->items.push_back(parse_expr());
        if (!is_op("]")) expect_op(",");
      }
      ++pos_;
      return grown(l, l->items);
    }
    if (t.kind == ETok::Op && t.text == "{") {
      auto d = std::make_shared<DictLit>();
      std::vector<ExprP> kids;
      while (!is_op("}")) {
        ExprP k = parse_expr();
        expect_op(":");
        d->items.emplace_back(k, parse_expr());
        kids.push_back(k), kids.push_back(d->items.back().second);
        if (!is_op("}")) expect_op(",");
      }
      ++pos_;
      return grown(d, kids);
    }
    fail("chat template: unexpected '{}' in expression", t.text);
  }
};

}  // namespace serval::jinja

namespace serval::jinja {

// ---------------------------------------------------------------- attributes, filters, tests

std::string str_of(const Value& v, const char* what) {
  check(v.j().is_string(), "chat template: {} needs a string", what);
  return v.j().get<std::string>();
}

// Linear in |s| + |chars| (a byte set, not a search of `chars` per byte).
std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
  std::array<bool, 256> in{};
  for (unsigned char c : chars) in[c] = true;
  size_t a = 0, b = s.size();
  if (left) while (a < b && in[static_cast<unsigned char>(s[a])]) ++a;
  if (right) while (b > a && in[static_cast<unsigned char>(s[b - 1])]) --b;
  charge(chars.size() + (b - a));
  return s.substr(a, b - a);
}

// s with every `from` replaced by `to`; bounded by max_string_bytes as it grows.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  charge_search(s.size(), from.size());
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    check_string_size(out.size() + (hit - pos) + to.size());
    charge(hit - pos + to.size());
    out.append(s, pos, hit - pos);
    out += to;
  }
  check_string_size(out.size() + (s.size() - pos));
  return out.append(s, pos, std::string::npos);
}

Value string_method(const std::string& self, const std::string& name) {
  static const std::string ws = " \t\n\r\f\v";
  charge(self.size());  // each method captures a copy of the string
  auto chars = [](Args& a) { return a.empty() || a[0].j().is_null() ? ws : str_of(a[0], "strip"); };
  if (name == "strip") return Value::function([=](Args& a, Kwargs&) { return Value::of(strip_chars(self, chars(a), true, true)); });
  if (name == "lstrip") return Value::function([=](Args& a, Kwargs&) { return Value::of(strip_chars(self, chars(a), true, false)); });
  if (name == "rstrip") return Value::function([=](Args& a, Kwargs&) { return Value::of(strip_chars(self, chars(a), false, true)); });
  if (name == "upper" || name == "lower")
    return Value::function([=](Args&, Kwargs&) {
      std::string s = self;
      for (auto& c : s) c = char(name == "upper" ? std::toupper(c) : std::tolower(c));
      return Value::of(s);
    });
  if (name == "title" || name == "capitalize")
    return Value::function([=](Args& a, Kwargs& k) { return call_filter(name, Value::of(self), a, k); });
  if (name == "startswith" || name == "endswith")
    return Value::function([=](Args& a, Kwargs&) {
      const std::string p = str_of(a.at(0), name.c_str());
      const bool hit = p.size() <= self.size() &&
                       (name == "startswith" ? self.compare(0, p.size(), p) == 0 : self.compare(self.size() - p.size(), p.size(), p) == 0);
      return Value::of(hit);
    });
  if (name == "split")
    return Value::function([=](Args& a, Kwargs&) {
      json out = json::array();
      if (a.empty() || a[0].j().is_null()) {
        charge(self.size());
        std::istringstream in(self);
        for (std::string w; in >> w;) {
          check_list_size(out.size() + 1);
          out.push_back(w);
        }
        return Value::of(std::move(out));
      }
      const std::string sep = str_of(a[0], "split");
      check(!sep.empty(), "chat template: empty separator");
      charge_search(self.size(), sep.size());
      size_t pos = 0;
      for (size_t hit; (hit = self.find(sep, pos)) != std::string::npos; pos = hit + sep.size()) {
        check_list_size(out.size() + 2);
        out.push_back(self.substr(pos, hit - pos));
      }
      out.push_back(self.substr(pos));
      return Value::of(std::move(out));
    });
  if (name == "replace")
    return Value::function([=](Args& a, Kwargs& k) { return call_filter("replace", Value::of(self), a, k); });
  return Value::undefined();  // as Jinja2: an attribute a string lacks is undefined (calling it is an error)
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.kind == Value::Kind::Namespace) {
    return obj.ns->contains(name) ? Value::of((*obj.ns)[name]) : Value::undefined();
  }
  const json& j = obj.j();
  if (j.is_object()) {
    if (j.contains(name)) return Value::of(j[name]);
    auto data = obj.data;  // the methods share the (immutable) object rather than copy it
    if (name == "items")
      return Value::function([data](Args&, Kwargs&) {
        json out = json::array();
        for (auto& [k, v] : data->items()) out.push_back(json::array({k, v}));
        return Value::of(std::move(out));
      });
    if (name == "keys" || name == "values")
      return Value::function([data, name](Args&, Kwargs&) {
        json out = json::array();
        for (auto& [k, v] : data->items()) out.push_back(name == "keys" ? json(k) : v);
        return Value::of(std::move(out));
      });
    if (name == "get")
      return Value::function([data](Args& a, Kwargs&) {
        const std::string k = str_of(a.at(0), "get");
        return data->contains(k) ? Value::of((*data)[k]) : (a.size() > 1 ? a[1] : Value::of(nullptr));
      });
    return Value::undefined();
  }
  if (j.is_string()) return string_method(j.get<std::string>(), name);
  return Value::undefined();
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.kind == Value::Kind::Namespace || obj.j().is_object()) {
    if (!key.j().is_string()) return Value::undefined();
    return get_attr(obj, key.j().get<std::string>());
  }
  const json& j = obj.j();
  if ((j.is_array() || j.is_string()) && key.j().is_number_integer()) {
    const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get_ref<const std::string&>().size());
    int64_t i = int_of(key.j(), "an index");
    if (i < 0) i += n;  // cannot overflow: i < 0 <= n
    if (i < 0 || i >= n) return Value::undefined();
    return j.is_array() ? Value::of(j[size_t(i)]) : Value::of(std::string(1, j.get_ref<const std::string&>()[size_t(i)]));
  }
  return Value::undefined();
}

bool call_test(const std::string& name, const Value& v, Args& args) {
  const json& j = v.j();
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_data() && j.is_null();
  if (name == "string") return v.is_data() && j.is_string();
  if (name == "number") return v.is_data() && j.is_number();
  if (name == "integer") return v.is_data() && j.is_number_integer();
  if (name == "float") return v.is_data() && j.is_number_float();
  if (name == "boolean") return v.is_data() && j.is_boolean();
  if (name == "true") return v.is_data() && j.is_boolean() && j.get<bool>();
  if (name == "false") return v.is_data() && j.is_boolean() && !j.get<bool>();
  if (name == "mapping") return (v.is_data() && j.is_object()) || v.kind == Value::Kind::Namespace;
  if (name == "iterable" || name == "sequence") return v.is_data() && (j.is_array() || j.is_string() || j.is_object());
  if (name == "callable") return v.kind == Value::Kind::Function;
  if (name == "equalto" || name == "eq" || name == "sameas") {
    if (args.empty()) return false;
    charge(std::min(v.cost, args[0].cost));
    return j == args[0].j();
  }
  if (name == "odd" || name == "even") return j.is_number_integer() && (int_of(j, name.c_str()) % 2 != 0) == (name == "odd");
  fail("chat template: unsupported test '{}'", name);
}

Value call_filter(const std::string& name, Value v, Args& a, Kwargs& k) {
  DepthGuard guard;  // `map` applies filters: x|map('map', ...) recurses
  const json& j = v.j();
  if (name == "trim") return Value::of(strip_chars(to_string(v), " \t\n\r\f\v", true, true));
  if (name == "length" || name == "count") {
    if (j.is_string()) return Value::of(int64_t(j.get_ref<const std::string&>().size()));
    return Value::of(int64_t(j.is_array() || j.is_object() ? j.size() : 0));
  }
  if (name == "upper" || name == "lower") return get_attr(Value::of(to_string(v)), name).fn->operator()(a, k);
  if (name == "capitalize" || name == "title") {
    std::string s = to_string(v);
    bool start = true;
    for (auto& c : s) {
      const bool alpha = std::isalpha(static_cast<unsigned char>(c));
      c = char(start && alpha ? std::toupper(c) : (name == "capitalize" && !start) || alpha ? std::tolower(c) : c);
      if (name == "capitalize") start = false;
      else start = !alpha;
    }
    return Value::of(s);
  }
  if (name == "default" || name == "d") {
    const bool use = v.is_undefined() || (!a.empty() && a.size() > 1 && truthy(a[1]) && !truthy(v));
    return use ? (a.empty() ? Value::of("") : a[0]) : v;
  }
  if (name == "string") return Value::of(to_string(v));
  if (name == "int") {
    if (j.is_number_integer()) return Value::of(int_of(j, "int"));
    if (j.is_number()) return Value::of(int_from_double(j.get<double>()));
    const std::string s = to_string(v);
    errno = 0;
    const long long x = std::strtoll(s.c_str(), nullptr, 10);
    check(errno != ERANGE, "chat template: integer overflow (cannot convert '{}' to a 64-bit integer)", s.substr(0, 40));
    return Value::of(int64_t(x));
  }
  if (name == "float") return Value::of(j.is_number() ? j.get<double>() : std::atof(to_string(v).c_str()));
  if (name == "abs") {
    if (j.is_number_integer()) {
      const int64_t x = int_of(j, "abs");
      return Value::of(x < 0 ? checked_neg(x) : x);
    }
    return Value::of(std::fabs(j.get<double>()));
  }
  if (name == "list") {
    if (j.is_array()) return v;
    json out = json::array();
    if (j.is_string()) {
      check_list_size(j.get_ref<const std::string&>().size());
      for (char c : j.get_ref<const std::string&>()) out.push_back(std::string(1, c));
    } else if (j.is_object()) {
      for (auto& [key, val] : j.items()) out.push_back(key);
    }
    return Value::of(std::move(out));
  }
  if (name == "first" || name == "last") {
    if (!j.is_array() || j.empty()) return Value::undefined();
    return Value::of(name == "first" ? j.front() : j.back());
  }
  if (name == "reverse") {
    if (j.is_string()) { std::string s = j.get<std::string>(); std::reverse(s.begin(), s.end()); return Value::of(s); }
    json out = j;
    std::reverse(out.begin(), out.end());
    return Value::of(std::move(out));
  }
  if (name == "join") {
    const std::string sep = a.empty() ? "" : to_string(a[0]);
    std::string out;
    bool first = true;
    for (auto& x : j) {
      if (!first) {
        check_string_size(out.size() + sep.size());
        out += sep;
      }
      first = false;
      py_repr(x, true, out);  // checks max_string_bytes as out grows
      charge(kEvalCost);
    }
    return Value::of(std::move(out));
  }
  if (name == "replace") {
    return Value::of(replace_all(to_string(v), to_string(a.at(0)), to_string(a.at(1))));
  }
  if (name == "tojson") {
    int64_t indent = -1;
    if (k.count("indent") && k["indent"].j().is_number_integer()) indent = int_of(k["indent"].j(), "tojson indent");
    check(indent <= int64_t(limits().max_string_bytes), "chat template: string size limit exceeded (tojson indent {})", indent);
    std::string out;
    py_json(j, indent, 0, out);
    return Value::of(std::move(out));
  }
  if (name == "dictsort") {  // (key, value) pairs by key; case-insensitive unless case_sensitive=true
    check(j.is_object(), "chat template: dictsort needs a mapping, not {}", j.type_name());
    const bool cased = k.count("case_sensitive") ? truthy(k["case_sensitive"]) : a.size() > 0 && truthy(a[0]);
    std::vector<std::pair<std::string, const json*>> items;
    for (auto& [key, val] : j.items()) items.emplace_back(key, &val);
    auto fold = [&](std::string x) {
      if (!cased)
        for (char& ch : x) ch = char(std::tolower(static_cast<unsigned char>(ch)));
      return x;
    };
    std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) { return fold(x.first) < fold(y.first); });
    json out = json::array();
    for (auto& [key, val] : items) out.push_back(json::array({key, *val}));
    charge(measure(out, 0));
    return Value::of(std::move(out));
  }
  if (name == "items") {
    const Value items = get_attr(v, "items");
    check(items.kind == Value::Kind::Function, "chat template: items needs a mapping, not {}", j.type_name());
    return (*items.fn)(a, k);
  }
  if (name == "selectattr" || name == "rejectattr") {
    check(!a.empty(), "chat template: {} needs an attribute name", name);
    const std::string attr = to_string(a[0]);
    json out = json::array();
    for (auto& x : j) {
      const Value field = get_attr(Value::of(x), attr);
      Args rest(a.begin() + std::min<size_t>(2, a.size()), a.end());
      const bool ok = a.size() > 1 ? call_test(to_string(a[1]), field, rest) : truthy(field);
      if (ok == (name == "selectattr")) out.push_back(x);
    }
    return Value::of(std::move(out));
  }
  if (name == "map") {
    json out = json::array();
    const std::string attr = k.count("attribute") ? to_string(k["attribute"]) : "";
    for (auto& x : j) {
      if (!attr.empty()) out.push_back(get_attr(Value::of(x), attr).j());
      else out.push_back(call_filter(to_string(a.at(0)), Value::of(x), a, k).j());
    }
    return Value::of(std::move(out));
  }
  if (name == "safe") {
    if (!j.is_string()) return v;
    v.markup = true;
    return v;
  }
  if (name == "e" || name == "escape") return v.markup ? v : markup_of(html_escape(to_string(v)));
  if (name == "min" || name == "max") {  // of a list, as Python compares (numbers, or strings)
    check(j.is_array(), "chat template: {} needs a list, not {}", name, j.type_name());
    if (j.empty()) return Value::undefined();
    const json* best = &j[0];
    for (const auto& x : j) {
      check((x.is_number() && best->is_number()) || (x.is_string() && best->is_string()),
            "chat template: {} of values that do not compare", name);
      if (name == "min" ? x < *best : *best < x) best = &x;
    }
    return Value::of(*best);
  }
  fail("chat template: unsupported filter '{}'", name);
}

// ---------------------------------------------------------------- statements

struct Node {
  virtual ~Node() = default;
  virtual void render(Context& c, std::string& out) const = 0;
};
using NodeP = std::shared_ptr<Node>;

// Appends to a render's output (or a `{% set %}` capture), bounded by max_output_bytes.
void emit(std::string& out, const std::string& s) {
  const size_t cap = limits().max_output_bytes;
  check(s.size() <= cap && out.size() <= cap - s.size(), "chat template: output size limit exceeded (more than {} bytes)", cap);
  charge(s.size());
  out += s;
}

struct Block : Node {
  std::vector<NodeP> children;
  void render(Context& c, std::string& out) const override {
    DepthGuard guard;
    for (auto& n : children) {
      charge(kEvalCost);
      n->render(c, out);
    }
  }
};
struct TextNode : Node {
  std::string text;
  void render(Context&, std::string& out) const override { emit(out, text); }
};
struct OutputNode : Node {
  ExprP e;
  void render(Context& c, std::string& out) const override { emit(out, to_string(e->eval(c))); }
};
struct IfNode : Node {
  std::vector<std::pair<ExprP, NodeP>> branches;  // a null condition is the else branch
  void render(Context& c, std::string& out) const override {
    for (auto& [cond, body] : branches)
      if (!cond || truthy(cond->eval(c))) return body->render(c, out);
  }
};
// {% break %} and {% continue %} (Jinja2's loopcontrols, which transformers enables): thrown to the
// innermost ForNode, which the parser guarantees exists. Not std::exceptions, so nothing else catches them.
struct LoopBreak {};
struct LoopContinue {};
struct LoopControlNode : Node {
  bool is_break = true;
  void render(Context&, std::string&) const override {
    if (is_break) throw LoopBreak{};
    throw LoopContinue{};
  }
};

struct ForNode : Node {
  std::vector<std::string> vars;
  ExprP iterable, filter;
  NodeP body, otherwise;
  void render(Context& c, std::string& out) const override {
    const Value it = iterable->eval(c);  // holds the (immutable) items alive for the loop
    const json& j = it.j();
    json keys = json::array();
    const json* items = &keys;
    if (j.is_array()) {
      items = &j;
    } else if (j.is_object()) {
      for (auto& [k, v] : j.items()) keys.push_back(k);
    } else if (j.is_string()) {
      check_list_size(j.get_ref<const std::string&>().size());
      for (char ch : j.get_ref<const std::string&>()) keys.push_back(std::string(1, ch));
    } else {
      check(it.is_undefined() || j.is_null(), "chat template: cannot loop over {}", j.type_name());
    }
    std::vector<const json*> selected;
    selected.reserve(items->size());
    for (auto& x : *items) {
      charge(kEvalCost);
      if (filter) {
        tick_iteration();
        c.scopes.emplace_back();
        bind(c, x);
        const bool keep = truthy(filter->eval(c));
        c.scopes.pop_back();
        if (!keep) continue;
      }
      selected.push_back(&x);
    }
    if (selected.empty()) {
      if (otherwise) otherwise->render(c, out);
      return;
    }
    const int64_t n = int64_t(selected.size());
    std::shared_ptr<json> loop;  // reused from one iteration to the next while nothing else holds it
    for (int64_t i = 0; i < n; ++i) {
      tick_iteration();
      c.scopes.emplace_back();
      bind(c, *selected[size_t(i)]);
      const bool middle = i > 1 && i + 1 < n;  // the same keys as the iteration before
      const bool reuse = middle && loop && loop.use_count() == 1;
      uint64_t cost = (reuse ? 2 : 10) * kNodeCost;  // reused: only previtem and nextitem are new
      if (i > 0) cost += measure(*selected[size_t(i - 1)], 1);
      if (i + 1 < n) cost += measure(*selected[size_t(i + 1)], 1);
      charge(cost);
      if (reuse) {
        auto& m = loop->get_ref<json::object_t&>();  // index, index0, first, last, length, revindex, revindex0, previtem, nextitem
        m.begin()[0].second = i + 1, m.begin()[1].second = i, m.begin()[2].second = false, m.begin()[3].second = false;
        m.begin()[5].second = n - i, m.begin()[6].second = n - i - 1;
        m.begin()[7].second = *selected[size_t(i - 1)], m.begin()[8].second = *selected[size_t(i + 1)];
      } else {
        json l = {{"index", i + 1}, {"index0", i}, {"first", i == 0}, {"last", i + 1 == n},
                  {"length", n}, {"revindex", n - i}, {"revindex0", n - i - 1}};
        if (i > 0) l["previtem"] = *selected[size_t(i - 1)];
        if (i + 1 < n) l["nextitem"] = *selected[size_t(i + 1)];
        loop = std::make_shared<json>(std::move(l));
      }
      Value v;
      v.kind = Value::Kind::Data;
      v.data = loop;
      v.cost = cost;
      c.set("loop", std::move(v));
      bool stop = false;
      try {
        body->render(c, out);
      } catch (const LoopBreak&) {
        stop = true;
      } catch (const LoopContinue&) {
      }
      c.scopes.pop_back();
      if (stop) break;
    }
  }
  void bind(Context& c, const json& x) const {
    if (vars.size() == 1) return c.set(vars[0], Value::of(x));
    check(x.is_array() && x.size() == vars.size(), "chat template: cannot unpack loop item into {} names", vars.size());
    for (size_t i = 0; i < vars.size(); ++i) c.set(vars[i], Value::of(x[i]));
  }
};
struct SetNode : Node {
  std::string name, attr;  // attr: `set ns.attr = ...`
  ExprP e;
  NodeP body;  // block form: {% set x %}...{% endset %}
  void render(Context& c, std::string& out) const override {
    Value v;
    if (body) {
      std::string captured;
      body->render(c, captured);
      v = Value::of(std::move(captured));
    } else {
      v = e->eval(c);
    }
    if (attr.empty()) return c.set(name, v);
    const Value target = c.lookup(name);
    check(target.kind == Value::Kind::Namespace, "chat template: can only set attributes of a namespace");
    check_list_size(target.ns->size() + (target.ns->contains(attr) ? 0 : 1));
    charge(measure(v.j(), 1));  // one level below the namespace; and the copy below
    json copy = v.j();  // (v may be this very namespace)
    (*target.ns)[attr] = std::move(copy);
  }
};

// {% macro name(a, b=default) %}...{% endmacro %}: defines `name` as a function in the current scope.
// A call renders the body in a new scope (on top of the caller's, so the template's variables are
// visible, as Jinja2's macros see the template context) with the arguments bound, positional then by
// name, the rest from their defaults (evaluated at the call); it returns the rendered text. Recursion
// is bounded by the call depth limit.
struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprP>> params;  // default: null when none
  NodeP body;
  void render(Context& c, std::string&) const override {
    Context* ctx = &c;  // a render's context outlives every value made during it
    const MacroNode* self = this;
    c.set(name, Value::function([ctx, self](Args& a, Kwargs& k) {
      check(a.size() <= self->params.size(), "chat template: macro '{}' takes {} arguments, got {}", self->name,
            self->params.size(), a.size());
      for (const auto& kv : k) {  // (no structured binding: clang 14 cannot capture one in a lambda)
        const std::string& key = kv.first;
        const bool known = std::any_of(self->params.begin(), self->params.end(), [&](const auto& p) { return p.first == key; });
        check(known, "chat template: macro '{}' has no argument '{}'", self->name, key);
      }
      ctx->scopes.emplace_back();
      struct Pop {
        Context* c;
        ~Pop() { c->scopes.pop_back(); }
      } pop{ctx};
      for (size_t i = 0; i < self->params.size(); ++i) {
        const auto& [pname, dflt] = self->params[i];
        if (i < a.size()) ctx->set(pname, a[i]);
        else if (auto f = k.find(pname); f != k.end()) ctx->set(pname, f->second);
        else ctx->set(pname, dflt ? dflt->eval(*ctx) : Value::undefined());
      }
      std::string out;
      self->body->render(*ctx, out);
      return Value::of(std::move(out));
    }));
  }
};

// Splits "for a, b in xs if cond" style statements into words with expression tails.
class StmtParser {
 public:
  explicit StmtParser(const std::vector<Piece>& pieces) : pieces_(pieces) {}

  NodeP parse_block(const std::vector<std::string>& enders, std::string* ended_by) {
    check(depth_ < limits().max_depth, "chat template: statement nesting depth limit exceeded (deeper than {})",
          limits().max_depth);
    ++depth_;
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    auto block = std::make_shared<Block>();
    while (pos_ < pieces_.size()) {
      const Piece& p = pieces_[pos_];
      if (p.kind == Tok::Text) {
        auto t = std::make_shared<TextNode>();
        t->text = p.text;
        block->children.push_back(t);
        ++pos_;
        continue;
      }
      if (p.kind == Tok::Expr) {
        auto o = std::make_shared<OutputNode>();
        o->e = ExprParser(p.text).parse_all();
        block->children.push_back(o);
        ++pos_;
        continue;
      }
      const std::string kw = keyword(p.text);
      if (std::find(enders.begin(), enders.end(), kw) != enders.end()) {
        if (ended_by) *ended_by = kw;
        return block;
      }
      ++pos_;
      block->children.push_back(parse_statement(kw, rest_after(p.text, kw)));
    }
    check(enders.empty(), "chat template: missing {{% {} %}}", enders.empty() ? "" : enders.back());
    return block;
  }

 private:
  const std::vector<Piece>& pieces_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loops_ = 0;  // for loops around the statement being parsed (break / continue need one)

  static std::string keyword(const std::string& s) {
    const size_t a = s.find_first_not_of(" \t\r\n");
    if (a == std::string::npos) return "";
    size_t b = a;
    while (b < s.size() && (std::isalnum(static_cast<unsigned char>(s[b])) || s[b] == '_')) ++b;
    return s.substr(a, b - a);
  }
  static std::string rest_after(const std::string& s, const std::string& kw) { return s.substr(s.find(kw) + kw.size()); }

  NodeP parse_statement(const std::string& kw, const std::string& rest) {
    if (kw == "if") return parse_if(rest);
    if (kw == "for") return parse_for(rest);
    if (kw == "set") return parse_set(rest);
    if (kw == "macro") return parse_macro(rest);
    if (kw == "break" || kw == "continue") {
      check(loops_ > 0, "chat template: {{% {} %}} outside a for loop", kw);
      check(rest.find_first_not_of(" \t\r\n-") == std::string::npos, "chat template: unexpected text after {}", kw);
      auto node = std::make_shared<LoopControlNode>();
      node->is_break = kw == "break";
      return node;
    }
    fail("chat template: unsupported statement '{{% {} %}}'", kw);
  }

  NodeP parse_if(const std::string& cond) {
    auto node = std::make_shared<IfNode>();
    ExprP c = ExprParser(cond).parse_all();
    for (;;) {
      std::string ended;
      NodeP body = parse_block({"elif", "else", "endif"}, &ended);
      node->branches.emplace_back(c, body);
      const std::string text = pieces_[pos_++].text;
      if (ended == "endif") return node;
      c = ended == "elif" ? ExprParser(rest_after(text, "elif")).parse_all() : nullptr;
      if (ended == "else") {
        node->branches.emplace_back(nullptr, parse_block({"endif"}, nullptr));
        ++pos_;
        return node;
      }
    }
  }

  NodeP parse_for(const std::string& rest) {
    auto node = std::make_shared<ForNode>();
    ExprParser p(rest);
    node->vars.push_back(p.name());
    while (p.is_op(",")) {
      p.expect_op(",");
      node->vars.push_back(p.name());
    }
    check(p.is_name("in"), "chat template: expected 'in' in for loop");
    p.name();
    node->iterable = p.parse_expr();  // note: a trailing `if` is parsed as a ternary without else
    if (auto* t = dynamic_cast<Ternary*>(node->iterable.get()); t && !t->otherwise) {
      node->filter = t->cond;
      node->iterable = t->then;
    }
    check(p.at_end(), "chat template: unexpected '{}' in for loop", p.peek().text);
    std::string ended;
    ++loops_;
    node->body = parse_block({"else", "endfor"}, &ended);
    --loops_;
    ++pos_;
    if (ended == "else") {
      node->otherwise = parse_block({"endfor"}, nullptr);
      ++pos_;
    }
    return node;
  }

  NodeP parse_macro(const std::string& rest) {
    auto node = std::make_shared<MacroNode>();
    ExprParser p(rest);
    node->name = p.name();
    p.expect_op("(");
    while (!p.is_op(")")) {
      std::string param = p.name();
      ExprP dflt;
      if (p.is_op("=")) {
        p.expect_op("=");
        dflt = p.parse_expr();
      }
      node->params.emplace_back(std::move(param), std::move(dflt));
      if (!p.is_op(")")) p.expect_op(",");
    }
    p.expect_op(")");
    check(p.at_end(), "chat template: unexpected '{}' in macro", p.peek().text);
    const int outer_loops = loops_;
    loops_ = 0;  // a macro's body is not inside the loops around its definition
    node->body = parse_block({"endmacro"}, nullptr);
    loops_ = outer_loops;
    ++pos_;
    return node;
  }

  NodeP parse_set(const std::string& rest) {
    auto node = std::make_shared<SetNode>();
    ExprParser p(rest);
    node->name = p.name();
    if (p.is_op(".")) {
      p.expect_op(".");
      node->attr = p.name();
    }
    if (p.at_end()) {  // block form
      node->body = parse_block({"endset"}, nullptr);
      ++pos_;
      return node;
    }
    p.expect_op("=");
    node->e = p.parse_expr();
    check(p.at_end(), "chat template: unexpected '{}' in set", p.peek().text);
    return node;
  }
};

// ---------------------------------------------------------------- globals and entry points

void add_globals(Context& c) {
  c.set("range", Value::function([](Args& a, Kwargs&) {
          check(!a.empty() && a.size() <= 3, "chat template: range() takes 1 to 3 arguments");
          int64_t start = 0, stop, step = 1;
          if (a.size() == 1) stop = int_of(a[0].j(), "range()");
          else start = int_of(a[0].j(), "range()"), stop = int_of(a[1].j(), "range()");
          if (a.size() == 3) step = int_of(a[2].j(), "range()");
          check(step != 0, "chat template: range() step is zero");
          // The count in 128 bits: stop - start and the steps cannot overflow there.
          const __int128 span = step > 0 ? __int128(stop) - start : __int128(start) - stop;
          const __int128 stride = step > 0 ? __int128(step) : -__int128(step);
          const __int128 count = span <= 0 ? 0 : (span + stride - 1) / stride;
          check(count <= __int128(limits().max_list_items),
                "chat template: list size limit exceeded (range() of {} items; the limit is {})", uint64_t(count),
                limits().max_list_items);
          json out = json::array();
          for (__int128 i = 0; i < count; ++i) out.push_back(int64_t(start + i * step));
          return Value::of(std::move(out));
        }));
  c.set("namespace", Value::function([](Args&, Kwargs& k) {
          Value v;
          v.kind = Value::Kind::Namespace;
          v.ns = std::make_shared<json>(json::object());
          for (auto& [key, val] : k) (*v.ns)[key] = val.j();
          charge(measure(*v.ns, 0));
          return v;
        }));
  c.set("raise_exception", Value::function([](Args& a, Kwargs&) -> Value {
          fail("chat template raised: {}", a.empty() ? "error" : to_string(a[0]));
        }));
  c.set("strftime_now", Value::function([](Args& a, Kwargs&) {
          const std::time_t t = std::time(nullptr);
          std::tm tm{};
          localtime_r(&t, &tm);
          char buf[256];
          const std::string format = a.empty() ? "%Y-%m-%d" : to_string(a[0]);
          const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &tm);  // 0: too long (or empty)
          return Value::of(std::string(buf, n));
        }));
  c.set("dict", Value::function([](Args&, Kwargs& k) {
          json out = json::object();
          for (auto& [key, val] : k) out[key] = val.j();
          return Value::of(out);
        }));
}

// Runs f, turning any exception other than serval::Error (a JSON type error, an index out of range,
// memory exhausted) into one, so that a bad template is always reported the same way.
template <typename F>
auto guarded(F&& f) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("chat template: {}", e.what());
  }
}

Template::Template(const std::string& source, const Limits& limits) : limits_(limits) {
  guarded([&] {
    StateScope state(limits_);
    const auto pieces = lex(source);
    StmtParser parser(pieces);
    root_ = parser.parse_block({}, nullptr);
    return 0;
  });
}

Template::~Template() = default;

std::string Template::render(const nlohmann::ordered_json& context) const {
  return guarded([&] {
    StateScope state(limits_);
    Context c;
    c.scopes.emplace_back();
    add_globals(c);
    c.scopes.emplace_back();
    check(context.is_object(), "chat template context must be an object");
    for (auto& [k, v] : context.items()) c.set(k, Value::input(v));  // checks the input's nesting too
    std::string out;
    root_->render(c, out);
    return out;
  });
}

}  // namespace serval::jinja
