#include "server/jinja.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include "base/error.h"

namespace serval::jinja {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------- values

struct Value;
using Args = std::vector<Value>;
using Kwargs = std::map<std::string, Value>;
using Fn = std::function<Value(Args&, Kwargs&)>;

struct Value {
  enum class Kind { Undefined, Data, Namespace, Function } kind = Kind::Undefined;
  json data;
  std::shared_ptr<json> ns;  // namespace(): an object shared by reference
  std::shared_ptr<Fn> fn;

  static Value undefined() { return {}; }
  static Value of(json j) { Value v; v.kind = Kind::Data; v.data = std::move(j); return v; }
  static Value function(Fn f) { Value v; v.kind = Kind::Function; v.fn = std::make_shared<Fn>(std::move(f)); return v; }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_data() const { return kind == Kind::Data; }
  const json& j() const {
    static const json null_json;
    return kind == Kind::Data ? data : kind == Kind::Namespace ? *ns : null_json;
  }
};

bool truthy(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return false;
  if (v.kind != Value::Kind::Data) return true;
  const json& j = v.data;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0.0;
  if (j.is_string() || j.is_array() || j.is_object()) return !j.empty();
  return true;
}

std::string py_repr(const json& j, bool top);

std::string py_float(double d) {
  if (std::floor(d) == d && std::abs(d) < 1e16) return fmt::format("{:.1f}", d);
  return fmt::format("{}", d);
}

std::string py_repr(const json& j, bool top) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_integer()) return std::to_string(j.get<int64_t>());
  if (j.is_number_unsigned()) return std::to_string(j.get<uint64_t>());
  if (j.is_number()) return py_float(j.get<double>());
  if (j.is_string()) return top ? j.get<std::string>() : "'" + j.get<std::string>() + "'";
  std::string out;
  if (j.is_array()) {
    out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + py_repr(j[i], false);
    return out + "]";
  }
  out = "{";
  bool first = true;
  for (auto& [k, v] : j.items()) out += (first ? "" : ", ") + ("'" + k + "': ") + py_repr(v, false), first = false;
  return out + "}";
}

std::string to_string(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return "";
  if (v.kind == Value::Kind::Function) return "<function>";
  return py_repr(v.j(), true);
}

// json.dumps as Python writes it: ", " and ": " separators, optional indent, no ASCII escaping.
void py_json(const json& j, int indent, int depth, std::string& out) {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(size_t(indent * d), ' ');
  };
  if (j.is_array() && !j.empty()) {
    out += '[';
    for (size_t i = 0; i < j.size(); ++i) {
      if (i) out += indent < 0 ? ", " : ",";
      newline(depth + 1);
      py_json(j[i], indent, depth + 1, out);
    }
    newline(depth);
    out += ']';
  } else if (j.is_object() && !j.empty()) {
    out += '{';
    bool first = true;
    for (auto& [k, v] : j.items()) {
      if (!first) out += indent < 0 ? ", " : ",";
      first = false;
      newline(depth + 1);
      out += json(k).dump(-1, ' ', false) + ": ";
      py_json(v, indent, depth + 1, out);
    }
    newline(depth);
    out += '}';
  } else {
    out += j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

// ---------------------------------------------------------------- lexer

enum class Tok { Text, Expr, Stmt };
struct Piece {
  Tok kind;
  std::string text;
};

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
    const size_t end = src.find(close, open + 2);
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
      out.push_back({ETok::Number, num, is_float ? json(std::stod(num)) : json(std::stoll(num))});
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
  virtual ~Expr() = default;
  virtual Value eval(Context& ctx) const = 0;
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
  Value eval(Context&) const override { return v; }
};
struct Var : Expr {
  std::string name;
  explicit Var(std::string n) : name(std::move(n)) {}
  Value eval(Context& c) const override { return c.lookup(name); }
};
struct Attr : Expr {
  ExprP obj;
  std::string name;
  Value eval(Context& c) const override { return get_attr(obj->eval(c), name); }
};
struct Item : Expr {
  ExprP obj, key;
  Value eval(Context& c) const override { return get_item(obj->eval(c), key->eval(c)); }
};
struct Slice : Expr {
  ExprP obj, start, stop;
  Value eval(Context& c) const override {
    const Value o = obj->eval(c);
    const json& j = o.j();
    check(j.is_array() || j.is_string(), "chat template: slicing needs a list or a string");
    const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get<std::string>().size());
    auto clamp = [&](const ExprP& e, int64_t dflt) {
      if (!e) return dflt;
      int64_t x = e->eval(c).j().get<int64_t>();
      if (x < 0) x += n;
      return std::clamp<int64_t>(x, 0, n);
    };
    const int64_t a = clamp(start, 0), b = std::max(a, clamp(stop, n));
    if (j.is_string()) return Value::of(j.get<std::string>().substr(size_t(a), size_t(b - a)));
    return Value::of(json(j.begin() + a, j.begin() + b));
  }
};
struct Call : Expr {
  ExprP callee;
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  Value eval(Context& c) const override {
    const Value f = callee->eval(c);
    check(f.kind == Value::Kind::Function, "chat template: calling something that is not a function");
    Args a;
    Kwargs k;
    for (auto& e : args) a.push_back(e->eval(c));
    for (auto& [n, e] : kwargs) k[n] = e->eval(c);
    return (*f.fn)(a, k);
  }
};
struct FilterExpr : Expr {
  ExprP value;
  std::string name;
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  Value eval(Context& c) const override {
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
  Value eval(Context& c) const override {
    Args a;
    for (auto& e : args) a.push_back(e->eval(c));
    return Value::of(call_test(name, value->eval(c), a) != negated);
  }
};
struct Unary : Expr {
  std::string op;
  ExprP e;
  Value eval(Context& c) const override {
    const Value v = e->eval(c);
    if (op == "not") return Value::of(!truthy(v));
    const json& j = v.j();
    check(j.is_number(), "chat template: unary minus needs a number");
    return Value::of(j.is_number_integer() ? json(-j.get<int64_t>()) : json(-j.get<double>()));
  }
};

Value arithmetic(const std::string& op, const Value& l, const Value& r) {
  const json &a = l.j(), &b = r.j();
  if (op == "~") return Value::of(to_string(l) + to_string(r));
  if (op == "+" && a.is_string() && b.is_string()) return Value::of(a.get<std::string>() + b.get<std::string>());
  if (op == "+" && a.is_array() && b.is_array()) {
    json out = a;
    out.insert(out.end(), b.begin(), b.end());
    return Value::of(out);
  }
  if (op == "*" && a.is_string() && b.is_number_integer()) {
    std::string out;
    for (int64_t i = 0; i < b.get<int64_t>(); ++i) out += a.get<std::string>();
    return Value::of(out);
  }
  check(a.is_number() && b.is_number(), "chat template: '{}' between {} and {}", op, a.type_name(), b.type_name());
  const bool ints = a.is_number_integer() && b.is_number_integer();
  if (ints && op != "/") {
    const int64_t x = a.get<int64_t>(), y = b.get<int64_t>();
    if (op == "+") return Value::of(x + y);
    if (op == "-") return Value::of(x - y);
    if (op == "*") return Value::of(x * y);
    check(y != 0, "chat template: division by zero");
    if (op == "//") return Value::of(int64_t(std::floor(double(x) / double(y))));
    if (op == "%") return Value::of(((x % y) + y) % y);
  }
  const double x = a.get<double>(), y = b.get<double>();
  if (op == "+") return Value::of(x + y);
  if (op == "-") return Value::of(x - y);
  if (op == "*") return Value::of(x * y);
  check(y != 0, "chat template: division by zero");
  if (op == "/") return Value::of(x / y);
  if (op == "//") return Value::of(std::floor(x / y));
  return Value::of(std::fmod(x, y));
}

bool contains(const Value& hay, const Value& needle) {
  const json& h = hay.j();
  if (h.is_string()) return needle.j().is_string() && h.get<std::string>().find(needle.j().get<std::string>()) != std::string::npos;
  if (h.is_array()) return std::find(h.begin(), h.end(), needle.j()) != h.end();
  if (h.is_object()) return needle.j().is_string() && h.contains(needle.j().get<std::string>());
  return false;
}

struct Binary : Expr {
  std::string op;
  ExprP l, r;
  Value eval(Context& c) const override {
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
      const bool eq = a.is_undefined() || b.is_undefined() ? (a.is_undefined() && b.is_undefined()) : a.j() == b.j();
      return Value::of(op == "==" ? eq : !eq);
    }
    if (op == "in") return Value::of(contains(b, a));
    if (op == "not in") return Value::of(!contains(b, a));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      const json &x = a.j(), &y = b.j();
      check((x.is_number() && y.is_number()) || (x.is_string() && y.is_string()), "chat template: cannot compare {} and {}",
            x.type_name(), y.type_name());
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
  Value eval(Context& c) const override {
    return truthy(cond->eval(c)) ? then->eval(c) : (otherwise ? otherwise->eval(c) : Value::undefined());
  }
};
struct ListLit : Expr {
  std::vector<ExprP> items;
  Value eval(Context& c) const override {
    json out = json::array();
    for (auto& e : items) out.push_back(e->eval(c).j());
    return Value::of(out);
  }
};
struct DictLit : Expr {
  std::vector<std::pair<ExprP, ExprP>> items;
  Value eval(Context& c) const override {
    json out = json::object();
    for (auto& [k, v] : items) out[to_string(k->eval(c))] = v->eval(c).j();
    return Value::of(out);
  }
};

// ---------------------------------------------------------------- expression parser

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

  ExprP parse_ternary() {
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
      return t;
    }
    return e;
  }
  ExprP binary(ExprP l, std::string op, ExprP r) {
    auto b = std::make_shared<Binary>();
    b->op = std::move(op), b->l = std::move(l), b->r = std::move(r);
    return b;
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
      ++pos_;
      auto u = std::make_shared<Unary>();
      u->op = "not", u->e = parse_not();
      return u;
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
            t->args.push_back(parse_expr());
            if (is_op(",")) ++pos_;
          }
          ++pos_;
        } else if (!at_end() && (peek().kind == ETok::String || peek().kind == ETok::Number)) {
          t->args.push_back(parse_primary());  // `is equalto 'x'`
        }
        e = t;
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
    ExprP e = parse_unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = toks_[pos_++].text;
      e = binary(e, op, parse_unary());
    }
    return e;
  }
  ExprP parse_unary() {
    if (is_op("-")) {
      ++pos_;
      auto u = std::make_shared<Unary>();
      u->op = "-", u->e = parse_unary();
      return u;
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
  ExprP parse_postfix(ExprP e) {
    for (;;) {
      if (is_op(".")) {
        ++pos_;
        auto a = std::make_shared<Attr>();
        a->obj = e, a->name = name();
        e = a;
      } else if (is_op("[")) {
        ++pos_;
        ExprP first = is_op(":") ? nullptr : parse_expr();
        if (is_op(":")) {
          ++pos_;
          auto s = std::make_shared<Slice>();
          s->obj = e, s->start = first;
          if (!is_op("]")) s->stop = parse_expr();
          expect_op("]");
          e = s;
        } else {
          expect_op("]");
          auto it = std::make_shared<Item>();
          it->obj = e, it->key = first;
          e = it;
        }
      } else if (is_op("(")) {
        auto call = std::make_shared<Call>();
        call->callee = e;
        parse_call_args(call->args, call->kwargs);
        e = call;
      } else if (is_op("|")) {
        ++pos_;
        auto f = std::make_shared<FilterExpr>();
        f->value = e, f->name = name();
        if (is_op("(")) parse_call_args(f->args, f->kwargs);
        e = f;
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
      while (peek().kind == ETok::String) s += toks_[pos_++].text;  // adjacent literals concatenate
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
        e = l;
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
      return l;
    }
    if (t.kind == ETok::Op && t.text == "{") {
      auto d = std::make_shared<DictLit>();
      while (!is_op("}")) {
        ExprP k = parse_expr();
        expect_op(":");
        d->items.emplace_back(k, parse_expr());
        if (!is_op("}")) expect_op(",");
      }
      ++pos_;
      return d;
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

std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
  size_t a = 0, b = s.size();
  if (left) while (a < b && chars.find(s[a]) != std::string::npos) ++a;
  if (right) while (b > a && chars.find(s[b - 1]) != std::string::npos) --b;
  return s.substr(a, b - a);
}

Value string_method(const std::string& self, const std::string& name) {
  static const std::string ws = " \t\n\r\f\v";
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
        std::istringstream in(self);
        for (std::string w; in >> w;) out.push_back(w);
        return Value::of(out);
      }
      const std::string sep = str_of(a[0], "split");
      check(!sep.empty(), "chat template: empty separator");
      size_t pos = 0;
      for (size_t hit; (hit = self.find(sep, pos)) != std::string::npos; pos = hit + sep.size()) out.push_back(self.substr(pos, hit - pos));
      out.push_back(self.substr(pos));
      return Value::of(out);
    });
  if (name == "replace")
    return Value::function([=](Args& a, Kwargs& k) { return call_filter("replace", Value::of(self), a, k); });
  fail("chat template: unsupported string method '{}'", name);
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.kind == Value::Kind::Namespace) {
    return obj.ns->contains(name) ? Value::of((*obj.ns)[name]) : Value::undefined();
  }
  const json& j = obj.j();
  if (j.is_object()) {
    if (j.contains(name)) return Value::of(j[name]);
    if (name == "items")
      return Value::function([j](Args&, Kwargs&) {
        json out = json::array();
        for (auto& [k, v] : j.items()) out.push_back(json::array({k, v}));
        return Value::of(out);
      });
    if (name == "keys" || name == "values")
      return Value::function([j, name](Args&, Kwargs&) {
        json out = json::array();
        for (auto& [k, v] : j.items()) out.push_back(name == "keys" ? json(k) : v);
        return Value::of(out);
      });
    if (name == "get")
      return Value::function([j](Args& a, Kwargs&) {
        const std::string k = str_of(a.at(0), "get");
        return j.contains(k) ? Value::of(j[k]) : (a.size() > 1 ? a[1] : Value::of(nullptr));
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
    const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get<std::string>().size());
    int64_t i = key.j().get<int64_t>();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined();
    return j.is_array() ? Value::of(j[size_t(i)]) : Value::of(std::string(1, j.get<std::string>()[size_t(i)]));
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
  if (name == "equalto" || name == "eq" || name == "sameas") return !args.empty() && j == args[0].j();
  if (name == "odd" || name == "even") return j.is_number_integer() && (j.get<int64_t>() % 2 != 0) == (name == "odd");
  fail("chat template: unsupported test '{}'", name);
}

Value call_filter(const std::string& name, Value v, Args& a, Kwargs& k) {
  const json& j = v.j();
  if (name == "trim") return Value::of(strip_chars(to_string(v), " \t\n\r\f\v", true, true));
  if (name == "length" || name == "count") {
    if (j.is_string()) return Value::of(int64_t(j.get<std::string>().size()));
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
  if (name == "int") return Value::of(j.is_number() ? int64_t(j.get<double>()) : int64_t(std::atoll(to_string(v).c_str())));
  if (name == "float") return Value::of(j.is_number() ? j.get<double>() : std::atof(to_string(v).c_str()));
  if (name == "abs") return Value::of(j.is_number_integer() ? json(std::llabs(j.get<int64_t>())) : json(std::fabs(j.get<double>())));
  if (name == "list") {
    if (j.is_array()) return v;
    json out = json::array();
    if (j.is_string()) for (char c : j.get<std::string>()) out.push_back(std::string(1, c));
    else if (j.is_object()) for (auto& [key, val] : j.items()) out.push_back(key);
    return Value::of(out);
  }
  if (name == "first" || name == "last") {
    if (!j.is_array() || j.empty()) return Value::undefined();
    return Value::of(name == "first" ? j.front() : j.back());
  }
  if (name == "reverse") {
    if (j.is_string()) { std::string s = j.get<std::string>(); std::reverse(s.begin(), s.end()); return Value::of(s); }
    json out = j;
    std::reverse(out.begin(), out.end());
    return Value::of(out);
  }
  if (name == "join") {
    const std::string sep = a.empty() ? "" : to_string(a[0]);
    std::string out;
    bool first = true;
    for (auto& x : j) out += (first ? "" : sep) + py_repr(x, true), first = false;
    return Value::of(out);
  }
  if (name == "replace") {
    std::string s = to_string(v);
    const std::string from = to_string(a.at(0)), to = to_string(a.at(1));
    if (from.empty()) return Value::of(s);
    std::string out;
    size_t pos = 0;
    for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) out += s.substr(pos, hit - pos) + to;
    return Value::of(out + s.substr(pos));
  }
  if (name == "tojson") {
    int indent = -1;
    if (k.count("indent") && k["indent"].j().is_number_integer()) indent = int(k["indent"].j().get<int64_t>());
    std::string out;
    py_json(j, indent, 0, out);
    return Value::of(out);
  }
  if (name == "items") return get_attr(v, "items").fn->operator()(a, k);
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
    return Value::of(out);
  }
  if (name == "map") {
    json out = json::array();
    const std::string attr = k.count("attribute") ? to_string(k["attribute"]) : "";
    for (auto& x : j) {
      if (!attr.empty()) out.push_back(get_attr(Value::of(x), attr).j());
      else out.push_back(call_filter(to_string(a.at(0)), Value::of(x), a, k).j());
    }
    return Value::of(out);
  }
  if (name == "safe" || name == "e" || name == "escape") return v;
  fail("chat template: unsupported filter '{}'", name);
}

// ---------------------------------------------------------------- statements

struct Node {
  virtual ~Node() = default;
  virtual void render(Context& c, std::string& out) const = 0;
};
using NodeP = std::shared_ptr<Node>;

struct Block : Node {
  std::vector<NodeP> children;
  void render(Context& c, std::string& out) const override {
    for (auto& n : children) n->render(c, out);
  }
};
struct TextNode : Node {
  std::string text;
  void render(Context&, std::string& out) const override { out += text; }
};
struct OutputNode : Node {
  ExprP e;
  void render(Context& c, std::string& out) const override { out += to_string(e->eval(c)); }
};
struct IfNode : Node {
  std::vector<std::pair<ExprP, NodeP>> branches;  // a null condition is the else branch
  void render(Context& c, std::string& out) const override {
    for (auto& [cond, body] : branches)
      if (!cond || truthy(cond->eval(c))) return body->render(c, out);
  }
};
struct ForNode : Node {
  std::vector<std::string> vars;
  ExprP iterable, filter;
  NodeP body, otherwise;
  void render(Context& c, std::string& out) const override {
    const Value it = iterable->eval(c);
    json items = json::array();
    const json& j = it.j();
    if (j.is_array()) items = j;
    else if (j.is_object()) for (auto& [k, v] : j.items()) items.push_back(k);
    else if (j.is_string()) for (char ch : j.get<std::string>()) items.push_back(std::string(1, ch));
    else check(it.is_undefined() || j.is_null(), "chat template: cannot loop over {}", j.type_name());
    std::vector<json> selected;
    for (auto& x : items) {
      if (filter) {
        c.scopes.emplace_back();
        bind(c, x);
        const bool keep = truthy(filter->eval(c));
        c.scopes.pop_back();
        if (!keep) continue;
      }
      selected.push_back(x);
    }
    if (selected.empty()) {
      if (otherwise) otherwise->render(c, out);
      return;
    }
    for (size_t i = 0; i < selected.size(); ++i) {
      c.scopes.emplace_back();
      bind(c, selected[i]);
      const int64_t n = int64_t(selected.size());
      json loop = {{"index", int64_t(i) + 1}, {"index0", int64_t(i)}, {"first", i == 0}, {"last", int64_t(i) + 1 == n},
                   {"length", n}, {"revindex", n - int64_t(i)}, {"revindex0", n - int64_t(i) - 1}};
      if (i > 0) loop["previtem"] = selected[i - 1];
      if (int64_t(i) + 1 < n) loop["nextitem"] = selected[i + 1];
      c.set("loop", Value::of(loop));
      body->render(c, out);
      c.scopes.pop_back();
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
      v = Value::of(captured);
    } else {
      v = e->eval(c);
    }
    if (attr.empty()) return c.set(name, v);
    const Value target = c.lookup(name);
    check(target.kind == Value::Kind::Namespace, "chat template: can only set attributes of a namespace");
    (*target.ns)[attr] = v.j();
  }
};

// Splits "for a, b in xs if cond" style statements into words with expression tails.
class StmtParser {
 public:
  explicit StmtParser(const std::vector<Piece>& pieces) : pieces_(pieces) {}

  NodeP parse_block(const std::vector<std::string>& enders, std::string* ended_by) {
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
    node->body = parse_block({"else", "endfor"}, &ended);
    ++pos_;
    if (ended == "else") {
      node->otherwise = parse_block({"endfor"}, nullptr);
      ++pos_;
    }
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
          if (a.size() == 1) stop = a[0].j().get<int64_t>();
          else start = a[0].j().get<int64_t>(), stop = a[1].j().get<int64_t>();
          if (a.size() == 3) step = a[2].j().get<int64_t>();
          check(step != 0, "chat template: range() step is zero");
          json out = json::array();
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(i);
          return Value::of(out);
        }));
  c.set("namespace", Value::function([](Args&, Kwargs& k) {
          Value v;
          v.kind = Value::Kind::Namespace;
          v.ns = std::make_shared<json>(json::object());
          for (auto& [key, val] : k) (*v.ns)[key] = val.j();
          return v;
        }));
  c.set("raise_exception", Value::function([](Args& a, Kwargs&) -> Value {
          fail("chat template raised: {}", a.empty() ? "error" : to_string(a[0]));
        }));
  c.set("strftime_now", Value::function([](Args& a, Kwargs&) {
          const std::time_t t = std::time(nullptr);
          char buf[128];
          std::strftime(buf, sizeof buf, a.empty() ? "%Y-%m-%d" : to_string(a[0]).c_str(), std::localtime(&t));
          return Value::of(std::string(buf));
        }));
  c.set("dict", Value::function([](Args&, Kwargs& k) {
          json out = json::object();
          for (auto& [key, val] : k) out[key] = val.j();
          return Value::of(out);
        }));
}

Template::Template(const std::string& source) {
  const auto pieces = lex(source);
  StmtParser parser(pieces);
  root_ = parser.parse_block({}, nullptr);
}

Template::~Template() = default;

std::string Template::render(const nlohmann::ordered_json& context) const {
  Context c;
  c.scopes.emplace_back();
  add_globals(c);
  c.scopes.emplace_back();
  check(context.is_object(), "chat template context must be an object");
  for (auto& [k, v] : context.items()) c.set(k, Value::of(v));
  std::string out;
  root_->render(c, out);
  return out;
}

}  // namespace serval::jinja
