// chat_template.cpp: see chat_template.h. A small Jinja: the source is cut into text and tags
// (with Jinja's whitespace rules), each tag's inside into tokens, parsed into a tree of
// statements and expressions, and the tree is walked with Python's value semantics.
#include "train/chat_template.h"

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>
#include <variant>
#include <vector>

namespace strata {

namespace {

using ojson = nlohmann::ordered_json;

// An error inside the template; `line` is filled in by the innermost node that knows one.
struct TemplateError {
  std::string message;
  int line = 0;
};
// raise_exception(message): the template refusing its input.
struct Raised {
  std::string message;
  int line = 0;
};

[[noreturn]] void error(std::string message) {
  throw TemplateError{std::move(message), 0};
}

// Limits that keep a hostile or broken template (a model directory is downloaded input) from
// taking the process down: nesting (the parser and the interpreter recurse), and the size of any
// string or rendering.
constexpr int kMaxDepth = 200;
constexpr size_t kMaxText = size_t{256} << 20;

void check_text_size(size_t bytes) {
  if (bytes > kMaxText)
    error(fmt::format("a text of {} bytes, more than the {} MiB a rendering may make", bytes,
                      kMaxText >> 20));
}

constexpr size_t kMaxItems = size_t{1} << 20;
constexpr uint64_t kMaxIterations = uint64_t{1} << 20;  // about a second of loop bodies
void check_list_size(size_t items) {
  if (items > kMaxItems)
    error(
        fmt::format("a list of {} items, more than the {} a rendering may make", items, kMaxItems));
}

// Counts one level of recursion for as long as it lives.
class Depth {
 public:
  explicit Depth(int& depth) : depth_(depth) {
    if (++depth_ > kMaxDepth) {
      --depth_;
      error(fmt::format("nested more than {} deep", kMaxDepth));
    }
  }
  ~Depth() { --depth_; }
  Depth(const Depth&) = delete;
  Depth& operator=(const Depth&) = delete;

 private:
  int& depth_;
};

// ---- values ----------------------------------------------------------------------------------

struct Value;
struct ListData;
struct DictData;
struct Callable;

enum class Kind : uint8_t {
  undefined,
  none,
  boolean,
  integer,
  real,
  string,
  list,
  tuple,
  dict,
  ns,  // namespace(): the one mutable object
  function,
  bigint  // an integer of the context past int64 (uint64): its digits in `s`, for printing
};

struct Value {
  Kind kind = Kind::undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // a string; for an undefined, what is undefined ("'x' is undefined")
  // A string marked safe (Jinja's Markup, made by |safe and |e): `+` escapes the other operand's
  // HTML characters, as Markup.__add__ does, and its own methods keep the mark.
  bool safe = false;
  std::shared_ptr<ListData> list;
  std::shared_ptr<DictData> dict;
  std::shared_ptr<const Callable> fn;

  static Value undefined(std::string what) {
    Value v;
    v.s = std::move(what);
    return v;
  }
  static Value none() {
    Value v;
    v.kind = Kind::none;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.kind = Kind::boolean;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.kind = Kind::integer;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.kind = Kind::real;
    v.f = x;
    return v;
  }
  static Value string(std::string x, bool safe = false) {
    Value v;
    v.kind = Kind::string;
    v.s = std::move(x);
    v.safe = safe;
    return v;
  }
  static Value make_list(std::vector<Value> items, bool tuple = false);
  static Value make_dict(std::vector<std::pair<Value, Value>> items, bool ns = false);

  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_number() const {
    return kind == Kind::integer || kind == Kind::real || kind == Kind::boolean;
  }
  bool is_sequence() const { return kind == Kind::list || kind == Kind::tuple; }
  bool is_mapping() const { return kind == Kind::dict || kind == Kind::ns; }
  double number() const {
    return kind == Kind::real ? f : static_cast<double>(kind == Kind::boolean ? b : i);
  }
  int64_t integral() const { return kind == Kind::boolean ? b : i; }
};

struct ListData {
  std::vector<Value> items;
};
struct DictData {
  std::vector<std::pair<Value, Value>> items;
};

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};
struct Interp;
struct Callable {
  std::string name;
  std::function<Value(CallArgs&, Interp&)> call;
};

Value Value::make_list(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind = tuple ? Kind::tuple : Kind::list;
  v.list = std::make_shared<ListData>(ListData{std::move(items)});
  return v;
}
Value Value::make_dict(std::vector<std::pair<Value, Value>> items, bool ns) {
  Value v;
  v.kind = ns ? Kind::ns : Kind::dict;
  v.dict = std::make_shared<DictData>(DictData{std::move(items)});
  return v;
}

Value make_function(std::string name, std::function<Value(CallArgs&, Interp&)> call) {
  Value v;
  v.kind = Kind::function;
  v.fn = std::make_shared<const Callable>(Callable{std::move(name), std::move(call)});
  return v;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return "Undefined";
    case Kind::none:
      return "NoneType";
    case Kind::boolean:
      return "bool";
    case Kind::integer:
      return "int";
    case Kind::real:
      return "float";
    case Kind::string:
      return "str";
    case Kind::list:
      return "list";
    case Kind::tuple:
      return "tuple";
    case Kind::dict:
      return "dict";
    case Kind::ns:
      return "Namespace";
    case Kind::function:
      return "function";
    case Kind::bigint:
      return "int";
  }
  return "?";
}

// Using an undefined value as a value is Jinja's UndefinedError.
const Value& defined(const Value& v) {
  if (v.is_undefined()) error(v.s);
  return v;
}

Value from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null:
      return Value::none();
    case ojson::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) {  // printed as it is; no arithmetic on it
        Value v;
        v.kind = Kind::bigint;
        v.s = std::to_string(u);
        return v;
      }
      return Value::integer(static_cast<int64_t>(u));
    }
    case ojson::value_t::number_float:
      return Value::real(j.get<double>());
    case ojson::value_t::string:
      return Value::string(j.get<std::string>());
    case ojson::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const ojson& e : j) items.push_back(from_json(e));
      return Value::make_list(std::move(items));
    }
    case ojson::value_t::object: {
      std::vector<std::pair<Value, Value>> items;
      items.reserve(j.size());
      for (const auto& [k, e] : j.items()) items.emplace_back(Value::string(k), from_json(e));
      return Value::make_dict(std::move(items));
    }
    default:
      error(fmt::format("a {} value in the context is not supported", j.type_name()));
  }
}

// ---- text helpers ----------------------------------------------------------------------------

// The code points of UTF-8 text, as byte offsets: offsets[k] is where code point k starts, and
// offsets.back() the text's size.
std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> at;
  at.reserve(s.size() + 1);
  for (size_t k = 0; k < s.size(); ++k)
    if ((static_cast<unsigned char>(s[k]) & 0xC0) != 0x80) at.push_back(k);
  at.push_back(s.size());
  return at;
}
size_t code_points(std::string_view s) {
  return code_point_offsets(s).size() - 1;
}

// The length in bytes of Python whitespace (str.isspace) starting at s[k], or 0.
size_t space_at(std::string_view s, size_t k) {
  const auto c = static_cast<unsigned char>(s[k]);
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return 1;
  const auto next = [&](size_t n) {
    return k + n < s.size() ? static_cast<unsigned char>(s[k + n]) : 0u;
  };
  if (c == 0xC2 && (next(1) == 0x85 || next(1) == 0xA0)) return 2;
  if (c == 0xE1 && next(1) == 0x9A && next(2) == 0x80) return 3;  // U+1680
  if (c == 0xE2 && next(1) == 0x80 &&
      (next(2) <= 0x8A || next(2) == 0xA8 || next(2) == 0xA9 || next(2) == 0xAF))
    return 3;                                                     // U+2000-200A, 2028, 2029, 202F
  if (c == 0xE2 && next(1) == 0x81 && next(2) == 0x9F) return 3;  // U+205F
  if (c == 0xE3 && next(1) == 0x80 && next(2) == 0x80) return 3;  // U+3000
  return 0;
}
// The length in bytes of Python whitespace ending at s[end - 1], or 0.
size_t space_before(std::string_view s, size_t end) {
  for (size_t n = 1; n <= 3 && n <= end; ++n)
    if (space_at(s, end - n) == n) return n;
  return 0;
}

std::string strip_text(std::string_view s, bool left, bool right,
                       const std::optional<std::string>& chars) {
  size_t a = 0, b = s.size();
  if (chars.has_value()) {
    // Python strips any of the characters given (code points; these are mostly ASCII).
    const std::vector<size_t> cp = code_point_offsets(*chars);
    std::vector<std::string_view> set;
    for (size_t k = 0; k + 1 < cp.size(); ++k)
      set.push_back(std::string_view(*chars).substr(cp[k], cp[k + 1] - cp[k]));
    const auto match_at = [&](size_t k) -> size_t {
      for (std::string_view c : set)
        if (s.substr(k, c.size()) == c) return c.size();
      return 0;
    };
    const auto match_before = [&](size_t end) -> size_t {
      for (std::string_view c : set)
        if (c.size() <= end && s.substr(end - c.size(), c.size()) == c) return c.size();
      return 0;
    };
    while (left && a < b && match_at(a) > 0) a += match_at(a);
    while (right && b > a && match_before(b) > 0) b -= match_before(b);
  } else {
    while (left && a < b && space_at(s, a) > 0) a += space_at(s, a);
    while (right && b > a && space_before(s, b) > 0) b -= space_before(s, b);
  }
  return std::string(s.substr(a, b - a));
}

// Jinja's escape(): the HTML characters as entities, as Markup writes them.
std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

bool ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}
// Case changes: Python's are Unicode-wide; strata's are ASCII, and refuse other text rather
// than change it differently.
std::string ascii_case(std::string_view s, const char* method, int mode /*0 lower, 1 upper*/) {
  if (!ascii(s))
    error(
        fmt::format("{}() of non-ASCII text is not supported (Python changes its case by Unicode "
                    "rules; strata does so for ASCII only)",
                    method));
  std::string out(s);
  for (char& c : out)
    c = mode == 0 ? static_cast<char>(std::tolower(static_cast<unsigned char>(c)))
                  : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}
std::string title_case(std::string_view s, bool whole /*title*/, const char* method) {
  std::string out = ascii_case(s, method, 0);
  bool start = true;
  for (char& c : out) {
    const bool letter = std::isalpha(static_cast<unsigned char>(c)) != 0;
    if (letter && start) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (whole)
      start = !letter;
    else
      start = false;
  }
  return out;
}

// Python's repr of a float: the shortest digits that read back, fixed between 1e-4 and 1e16.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, end);  // [-]d[.ddd]e[+-]XX
  const size_t e = sci.find('e');
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string mantissa = sci.substr(0, e);
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  std::string out;
  if (exponent >= -5 && exponent < 16) {
    if (exponent < 0) {
      out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    } else if (static_cast<size_t>(exponent) + 1 >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(exponent) + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(exponent) + 1) + "." +
            digits.substr(static_cast<size_t>(exponent) + 1);
    }
    // Python switches to exponents below 1e-4.
    if (exponent == -5) {
      out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + "e-05";
    }
  } else {
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") +
          fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  return negative ? "-" + out : out;
}

std::string string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == quote || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;  // Python prints printable non-ASCII as it is
    }
  }
  out += quote;
  return out;
}

std::string repr(const Value& v);

// str(v), as {{ v }} prints it.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return "";
    case Kind::none:
      return "None";
    case Kind::boolean:
      return v.b ? "True" : "False";
    case Kind::integer:
      return std::to_string(v.i);
    case Kind::bigint:
      return v.s;
    case Kind::real:
      return float_repr(v.f);
    case Kind::string:
      return v.s;
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Kind::string:
      return string_repr(v.s);
    case Kind::list:
    case Kind::tuple: {
      std::string out = v.kind == Kind::list ? "[" : "(";
      for (size_t k = 0; k < v.list->items.size(); ++k)
        out += (k ? ", " : "") + repr(v.list->items[k]);
      if (v.kind == Kind::tuple && v.list->items.size() == 1) out += ",";
      return out + (v.kind == Kind::list ? "]" : ")");
    }
    case Kind::dict:
    case Kind::ns: {
      std::string out = v.kind == Kind::ns ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->items.size(); ++k)
        out +=
            (k ? ", " : "") + repr(v.dict->items[k].first) + ": " + repr(v.dict->items[k].second);
      return out + (v.kind == Kind::ns ? "}>" : "}");
    }
    case Kind::function:
      return fmt::format("<function {}>", v.fn->name);
    default:
      return to_str(v);
  }
}

// json.dumps(v, ensure_ascii=False, indent, separators, sort_keys), as transformers' tojson.
void to_json(const Value& v, std::string& out, int indent, int depth, const std::string& item_sep,
             const std::string& key_sep, bool sort_keys) {
  const auto newline = [&](int d) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind) {
    case Kind::none:
      out += "null";
      return;
    case Kind::boolean:
      out += v.b ? "true" : "false";
      return;
    case Kind::bigint:
      out += v.s;
      return;
    case Kind::integer:
      out += std::to_string(v.i);
      return;
    case Kind::real:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f < 0 ? "-Infinity" : "Infinity";
      else
        out += float_repr(v.f);
      return;
    case Kind::string: {
      out += '"';
      for (char ch : v.s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (ch) {
          case '"':
            out += "\\\"";
            break;
          case '\\':
            out += "\\\\";
            break;
          case '\n':
            out += "\\n";
            break;
          case '\r':
            out += "\\r";
            break;
          case '\t':
            out += "\\t";
            break;
          case '\b':
            out += "\\b";
            break;
          case '\f':
            out += "\\f";
            break;
          default:
            if (c < 0x20)
              out += fmt::format("\\u{:04x}", c);
            else
              out += ch;
        }
      }
      out += '"';
      return;
    }
    case Kind::list:
    case Kind::tuple: {
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        to_json(items[k], out, indent, depth + 1, item_sep, key_sep, sort_keys);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Kind::dict:
    case Kind::ns: {
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return to_str(a->first) < to_str(b->first); });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        const Value& key = items[k]->first;
        if (key.kind == Kind::string) {
          to_json(key, out, indent, depth + 1, item_sep, key_sep, sort_keys);
        } else if (key.kind == Kind::integer || key.kind == Kind::real ||
                   key.kind == Kind::boolean || key.kind == Kind::none) {
          std::string k2;
          to_json(key, k2, -1, 0, item_sep, key_sep, sort_keys);
          out += '"' + k2 + '"';
        } else {
          error(fmt::format("tojson: a dict key of type {} is not JSON", type_name(key)));
        }
        out += key_sep;
        to_json(items[k]->second, out, indent, depth + 1, item_sep, key_sep, sort_keys);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      error(fmt::format("tojson: a value of type {} is not JSON serializable", type_name(v)));
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
    case Kind::none:
      return false;
    case Kind::boolean:
      return v.b;
    case Kind::integer:
      return v.i != 0;
    case Kind::real:
      return v.f != 0;
    case Kind::string:
      return !v.s.empty();
    case Kind::list:
    case Kind::tuple:
      return !v.list->items.empty();
    case Kind::dict:
      return !v.dict->items.empty();
    default:
      return true;
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::real || b.kind == Kind::real) return a.number() == b.number();
    return a.integral() == b.integral();
  }
  if (a.is_sequence() && b.is_sequence()) {
    if (a.kind != b.kind || a.list->items.size() != b.list->items.size()) return false;
    for (size_t k = 0; k < a.list->items.size(); ++k)
      if (!equal(a.list->items[k], b.list->items[k])) return false;
    return true;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::undefined:
    case Kind::none:
      return true;
    case Kind::string:
    case Kind::bigint:
      return a.s == b.s;
    case Kind::dict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& entry : a.dict->items) {
        const auto it = std::find_if(b.dict->items.begin(), b.dict->items.end(),
                                     [&](const auto& kv) { return equal(kv.first, entry.first); });
        if (it == b.dict->items.end() || !equal(it->second, entry.second)) return false;
      }
      return true;
    }
    case Kind::ns:
      return a.dict == b.dict;
    case Kind::function:
      return a.fn == b.fn;
    default:
      return false;
  }
}

// Python's <: numbers, strings and sequences; anything else is a TypeError.
int compare(const Value& a, const Value& b, const char* op) {
  defined(a);
  defined(b);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::real || b.kind == Kind::real)
      return a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
    return a.integral() < b.integral() ? -1 : a.integral() > b.integral() ? 1 : 0;
  }
  if (a.kind == Kind::string && b.kind == Kind::string)
    return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
  if (a.is_sequence() && a.kind == b.kind) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (equal(x[k], y[k])) continue;
      return compare(x[k], y[k], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  error(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, type_name(a),
                    type_name(b)));
}

// Items of a value a for loop or filter iterates: a list's items, a dict's keys, a string's
// characters; nothing for an undefined.
std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return {};
    case Kind::list:
    case Kind::tuple:
      return v.list->items;
    case Kind::dict:
    case Kind::ns: {
      std::vector<Value> keys;
      for (const auto& kv : v.dict->items) keys.push_back(kv.first);
      return keys;
    }
    case Kind::string: {
      std::vector<Value> chars;
      const std::vector<size_t> at = code_point_offsets(v.s);
      for (size_t k = 0; k + 1 < at.size(); ++k)
        chars.push_back(Value::string(v.s.substr(at[k], at[k + 1] - at[k])));
      return chars;
    }
    default:
      error(fmt::format("'{}' object is not iterable", type_name(v)));
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return 0;
    case Kind::string:
      return static_cast<int64_t>(code_points(v.s));
    case Kind::list:
    case Kind::tuple:
      return static_cast<int64_t>(v.list->items.size());
    case Kind::dict:
    case Kind::ns:
      return static_cast<int64_t>(v.dict->items.size());
    default:
      error(fmt::format("object of type '{}' has no len()", type_name(v)));
  }
}

// Whether `v` is or holds a namespace: the one mutable object, so the one that can be made to
// hold itself, a cycle its shared pointers would never free.
bool holds_namespace(const Value& v) {
  if (v.kind == Kind::ns) return true;
  if (v.is_sequence())
    return std::any_of(v.list->items.begin(), v.list->items.end(), holds_namespace);
  if (v.kind == Kind::dict)
    return std::any_of(v.dict->items.begin(), v.dict->items.end(), [](const auto& kv) {
      return holds_namespace(kv.first) || holds_namespace(kv.second);
    });
  return false;
}

// Python's `in`; an undefined container holds nothing (Jinja's Undefined iterates as empty).
bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::undefined:
      return false;
    case Kind::string:
      if (item.kind != Kind::string)
        error(
            fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
      return container.s.find(item.s) != std::string::npos;
    case Kind::list:
    case Kind::tuple:
      return std::any_of(container.list->items.begin(), container.list->items.end(),
                         [&](const Value& x) { return equal(x, item); });
    case Kind::dict:
    case Kind::ns:
      return std::any_of(container.dict->items.begin(), container.dict->items.end(),
                         [&](const auto& kv) { return equal(kv.first, item); });
    default:
      defined(container);
      error(fmt::format("argument of type '{}' is not iterable", type_name(container)));
  }
}

const Value* dict_find(const Value& d, std::string_view key) {
  for (const auto& kv : d.dict->items)
    if (kv.first.kind == Kind::string && kv.first.s == key) return &kv.second;
  return nullptr;
}

// ---- lexing ----------------------------------------------------------------------------------

enum class Tok : uint8_t { name, string, integer, real, op, end };

struct Token {
  Tok type = Tok::end;
  std::string text;  // the name, the string's value, the operator
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// A piece of the template: text, {{ expression }}, or {% statement %}.
struct Segment {
  enum class Type : uint8_t { text, output, block } type = Type::text;
  std::string text;
  std::vector<Token> tokens;  // ending with Tok::end
  int line = 0;
};

bool name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}
bool name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {
    // Jinja reads every line ending as \n and drops one final newline (keep_trailing_newline off).
    std::string s;
    s.reserve(src_.size());
    for (size_t k = 0; k < src_.size(); ++k) {
      if (src_[k] == '\r') {
        s += '\n';
        if (k + 1 < src_.size() && src_[k + 1] == '\n') ++k;
      } else {
        s += src_[k];
      }
    }
    if (!s.empty() && s.back() == '\n') s.pop_back();
    src_ = std::move(s);
  }

  std::vector<Segment> run() {
    std::vector<Segment> out;
    size_t pos = 0;
    while (pos < src_.size()) {
      const size_t at = next_tag(pos);
      std::string text = src_.substr(pos, (at == std::string::npos ? src_.size() : at) - pos);
      const int text_line = line_at(pos);
      if (at == std::string::npos) {
        push_text(out, std::move(text), text_line);
        break;
      }
      const char kind = src_[at + 1];
      const char control = at + 2 < src_.size() ? src_[at + 2] : '\0';
      const bool line_starting = pos == 0 || src_[pos - 1] == '\n';
      if (control == '-') {
        text = strip_text(text, false, true, std::nullopt);
      } else if (kind != '{' && control != '+') {
        // lstrip_blocks: a block or comment tag alone on its line takes the indent before it.
        const size_t l = text.rfind('\n');
        const size_t from = l == std::string::npos ? 0 : l + 1;
        if ((from > 0 || line_starting) && text.find_first_not_of(" \t", from) == std::string::npos)
          text.erase(from);
      }
      push_text(out, std::move(text), text_line);
      size_t inner = at + 2 + (control == '-' || control == '+' ? 1 : 0);
      if (kind == '#') {
        const size_t close = src_.find("#}", inner);
        if (close == std::string::npos)
          fail_at(line_at(at), "a comment {# is never closed with #}");
        pos = after_tag(close + 2, close > inner && src_[close - 1] == '-', true);
        continue;
      }
      Segment seg;
      seg.type = kind == '{' ? Segment::Type::output : Segment::Type::block;
      seg.line = line_at(at);
      bool strip_after = false, keep_newline = false;
      inner = tokenize(inner, kind, seg.tokens, strip_after, keep_newline);
      if (seg.type == Segment::Type::block && !seg.tokens.empty() &&
          seg.tokens[0].type == Tok::name && seg.tokens[0].text == "raw") {
        pos = raw_block(inner, strip_after, keep_newline, out, seg.line);
        continue;
      }
      out.push_back(std::move(seg));
      pos = after_tag(inner, strip_after, kind == '%' && !keep_newline);
    }
    return out;
  }

 private:
  size_t next_tag(size_t pos) const {
    for (size_t k = src_.find('{', pos); k != std::string::npos; k = src_.find('{', k + 1))
      if (k + 1 < src_.size() && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#'))
        return k;
    return std::string::npos;
  }

  int line_at(size_t pos) {
    while (counted_ < pos && counted_ < src_.size()) {
      if (src_[counted_] == '\n') ++line_;
      ++counted_;
    }
    if (pos < counted_) {  // back: count afresh (rare)
      return 1 + static_cast<int>(
                     std::count(src_.begin(), src_.begin() + static_cast<long>(pos), '\n'));
    }
    return line_;
  }

  [[noreturn]] void fail_at(int line, std::string message) {
    throw TemplateError{std::move(message), line};
  }

  // Where the text after a tag ending at `pos` starts: all whitespace taken by `-`, one newline
  // by trim_blocks.
  size_t after_tag(size_t pos, bool strip, bool trim) const {
    if (strip) {
      while (pos < src_.size() && space_at(src_, pos) > 0) pos += space_at(src_, pos);
    } else if (trim && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    return pos;
  }

  static void push_text(std::vector<Segment>& out, std::string text, int line) {
    if (text.empty()) return;
    Segment seg;
    seg.type = Segment::Type::text;
    seg.text = std::move(text);
    seg.line = line;
    out.push_back(std::move(seg));
  }

  // {% raw %}...{% endraw %}: the text between, as it is.
  size_t raw_block(size_t pos, bool strip_after, bool keep_newline, std::vector<Segment>& out,
                   int line) {
    pos = after_tag(pos, strip_after, !keep_newline);
    for (size_t k = src_.find("{%", pos); k != std::string::npos; k = src_.find("{%", k + 2)) {
      size_t j = k + 2;
      const bool minus = j < src_.size() && src_[j] == '-';
      if (minus || (j < src_.size() && src_[j] == '+')) ++j;
      while (j < src_.size() && (src_[j] == ' ' || src_[j] == '\t' || src_[j] == '\n')) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && (src_[j] == ' ' || src_[j] == '\t' || src_[j] == '\n')) ++j;
      const bool strip = j < src_.size() && src_[j] == '-';
      const bool plus = j < src_.size() && src_[j] == '+';
      if (strip || plus) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos, k - pos);
      if (minus) text = strip_text(text, false, true, std::nullopt);
      push_text(out, std::move(text), line);
      return after_tag(j + 2, strip, !plus);
    }
    fail_at(line, "{% raw %} is never closed with {% endraw %}");
  }

  // The tokens of a tag's inside from `pos`, up to its end (}} or %}, with -/+ before it);
  // returns the position after the end.
  size_t tokenize(size_t pos, char kind, std::vector<Token>& tokens, bool& strip_after,
                  bool& keep_newline) {
    const int start_line = line_at(pos);
    int depth = 0;  // open brackets: a } inside them is not the tag's end
    const char closer = kind == '{' ? '}' : '%';
    while (true) {
      while (pos < src_.size() && std::isspace(static_cast<unsigned char>(src_[pos]))) ++pos;
      if (pos >= src_.size())
        fail_at(start_line, fmt::format("a tag {} is never closed with {}",
                                        kind == '{' ? "{{" : "{%", kind == '{' ? "}}" : "%}"));
      const int line = line_at(pos);
      if (depth == 0) {
        const char c = src_[pos];
        size_t p = pos;
        bool minus = false, plus = false;
        if ((c == '-' || c == '+') && src_.compare(p + 1, 2, std::string{closer, '}'}) == 0) {
          minus = c == '-';
          plus = c == '+';
          ++p;
        }
        if (src_.compare(p, 2, std::string{closer, '}'}) == 0) {
          strip_after = minus;
          keep_newline = plus;
          tokens.push_back(Token{Tok::end, "", 0, 0, line});
          return p + 2;
        }
      }
      Token t;
      t.line = line;
      const char c = src_[pos];
      if (name_start(c)) {
        size_t e = pos;
        while (e < src_.size() && name_char(src_[e])) ++e;
        t.type = Tok::name;
        t.text = src_.substr(pos, e - pos);
        pos = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos;
        bool real = false;
        while (e < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_'))
          ++e;
        if (e + 1 < src_.size() && src_[e] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          real = true;
          ++e;
          while (e < src_.size() &&
                 (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_'))
            ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t x = e + 1;
          if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
          if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
            real = true;
            e = x;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string digits;
        for (size_t k = pos; k < e; ++k)
          if (src_[k] != '_') digits += src_[k];
        if (real) {
          t.type = Tok::real;
          t.f = std::strtod(digits.c_str(), nullptr);
        } else {
          t.type = Tok::integer;
          const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), t.i);
          if (ec != std::errc()) fail_at(line, fmt::format("the integer {} is too large", digits));
        }
        pos = e;
      } else if (c == '\'' || c == '"') {
        t.type = Tok::string;
        pos = read_string(pos, t.text, line);
      } else {
        static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                           "]",  "{",  "}",  ".",  ",",  ":",  "|"};
        const char* found = nullptr;
        for (const char* op : kOps)
          if (src_.compare(pos, std::strlen(op), op) == 0) {
            found = op;
            break;
          }
        if (found == nullptr)
          fail_at(line,
                  fmt::format("unexpected character {} in a tag", string_repr(std::string(1, c))));
        t.type = Tok::op;
        t.text = found;
        if (t.text == "(" || t.text == "[" || t.text == "{") ++depth;
        if ((t.text == ")" || t.text == "]" || t.text == "}") && depth > 0) --depth;
        pos += t.text.size();
      }
      tokens.push_back(std::move(t));
    }
  }

  // A string literal with Python's escapes (unknown ones kept with their backslash).
  size_t read_string(size_t pos, std::string& out, int line) {
    const char quote = src_[pos++];
    while (true) {
      if (pos >= src_.size()) fail_at(line, "a string literal is never closed");
      const char c = src_[pos];
      if (c == quote) return pos + 1;
      if (c != '\\') {
        out += c;
        ++pos;
        continue;
      }
      if (pos + 1 >= src_.size()) fail_at(line, "a string literal is never closed");
      const char e = src_[pos + 1];
      pos += 2;
      const auto hex = [&](int n) {
        if (pos + static_cast<size_t>(n) > src_.size())
          fail_at(line, "a \\x, \\u or \\U escape is cut short");
        uint32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          const char h = src_[pos++];
          cp <<= 4;
          if (h >= '0' && h <= '9')
            cp |= static_cast<uint32_t>(h - '0');
          else if (h >= 'a' && h <= 'f')
            cp |= static_cast<uint32_t>(h - 'a' + 10);
          else if (h >= 'A' && h <= 'F')
            cp |= static_cast<uint32_t>(h - 'A' + 10);
          else
            fail_at(line, "a \\x, \\u or \\U escape has a character that is not hex");
        }
        append_utf8(out, cp);
      };
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case '0':
          out += '\0';
          break;
        case '\n':
          break;  // a line continued
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        default:
          out += '\\';
          out += e;
      }
    }
  }

  std::string src_;
  size_t counted_ = 0;
  int line_ = 1;
};

// ---- the tree --------------------------------------------------------------------------------

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum class Type : uint8_t {
    constant,
    name,
    list,
    tuple,
    dict,
    attr,
    item,
    slice,
    call,
    filter,
    test,
    neg,
    pos,
    binary,
    compare,
    and_,
    or_,
    not_,
    cond
  } type = Type::constant;
  int line = 0;
  Value value;              // constant
  std::string name;         // name, attr, filter, test, binary's operator
  std::vector<ExprP> args;  // operands; list/tuple items; dict keys and values alternating
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // compare: the operator before each operand after the first
  bool negated = false;          // test: `is not`
};

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  enum class Type : uint8_t {
    text,
    output,
    if_,
    for_,
    set,
    set_block,
    macro,
    call_block,
    filter_block,
    break_,
    continue_,
    body
  } type = Type::text;
  int line = 0;
  std::string text;                              // text; macro name; set_block's name
  ExprP expr;                                    // output; for's iterable; set's value; filter
  std::vector<std::pair<ExprP, Body>> branches;  // if: conditions and bodies
  Body body, else_body;
  std::vector<std::string> targets;  // for/set names (several: unpacking)
  ExprP target;                      // set: a namespace attribute
  ExprP condition;                   // for ... if condition
  std::vector<std::string> params;   // macro
  std::vector<ExprP> defaults;       // macro: one per param (null: none)
  ExprP call;                        // call_block: the macro call
};

// ---- parsing ---------------------------------------------------------------------------------

// The filters and tests the interpreter knows: a template naming another is refused when it is
// read, as Jinja refuses it when it compiles the template, not when a conversation reaches it.
constexpr std::string_view kFilters[] = {
    "abs",     "attr",    "capitalize", "count",  "d",      "default",    "dictsort", "e",
    "escape",  "first",   "float",      "indent", "int",    "items",      "join",     "last",
    "length",  "list",    "lower",      "map",    "max",    "min",        "reject",   "rejectattr",
    "replace", "reverse", "round",      "safe",   "select", "selectattr", "sort",     "string",
    "sum",     "title",   "tojson",     "trim",   "unique", "upper"};
constexpr std::string_view kTests[] = {
    "defined",  "undefined",   "none",     "string", "number",      "integer",
    "float",    "boolean",     "true",     "false",  "mapping",     "sequence",
    "iterable", "callable",    "odd",      "even",   "divisibleby", "lower",
    "upper",    "equalto",     "eq",       "==",     "sameas",      "ne",
    "!=",       "lt",          "lessthan", "<",      "le",          "<=",
    "gt",       "greaterthan", ">",        "ge",     ">=",          "in"};
bool known(std::span<const std::string_view> names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

class Parser {
 public:
  explicit Parser(std::vector<Segment> segments) : segs_(std::move(segments)) {}

  Body parse() { return parse_body({}, 0); }

 private:
  [[noreturn]] static void fail_at(int line, std::string message) {
    throw TemplateError{std::move(message), line};
  }

  // Statements up to one of `ends` (a block tag's name), which is left current; at the top level
  // `ends` is empty and the body runs to the end.
  Body parse_body(const std::vector<std::string>& ends, int opened) {
    const Nest guard(*this);
    Body body;
    while (seg_ < segs_.size()) {
      Segment& s = segs_[seg_];
      if (s.type == Segment::Type::text) {
        auto st = std::make_unique<Stmt>();
        st->type = Stmt::Type::text;
        st->line = s.line;
        st->text = std::move(s.text);
        body.push_back(std::move(st));
        ++seg_;
        continue;
      }
      toks_ = &s.tokens;
      tok_ = 0;
      if (s.type == Segment::Type::output) {
        auto st = std::make_unique<Stmt>();
        st->type = Stmt::Type::output;
        st->line = s.line;
        st->expr = parse_tuple(true);
        expect_end();
        body.push_back(std::move(st));
        ++seg_;
        continue;
      }
      const Token& head = cur();
      if (head.type != Tok::name)
        fail_at(head.line, "a {% tag %} must start with a statement name");
      if (std::find(ends.begin(), ends.end(), head.text) != ends.end()) return body;
      if (head.text.starts_with("end") || head.text == "elif" || head.text == "else")
        fail_at(head.line, fmt::format("{{% {} %}} without the tag it would close", head.text));
      body.push_back(parse_statement());
    }
    if (!ends.empty()) {
      std::string list;
      for (const std::string& e : ends) list += (list.empty() ? "" : " or ") + ("{% " + e + " %}");
      fail_at(opened, fmt::format("the tag here is never closed: the template ended where {} was "
                                  "expected",
                                  list));
    }
    return body;
  }

  // The rest of a tag, checked to be over, and the next segment made current.
  void end_tag() {
    expect_end();
    ++seg_;
  }
  // The rest of a block tag opened on `line`, its body and its end tag `end`.
  Body block_to(const char* end, int line, int loops) {
    end_tag();
    Body b = inner_body({end}, line, loops);
    ++tok_;
    end_tag();
    return b;
  }
  // The filters of a {% filter %} or {% set x | ... %} block: their input, the block's text,
  // takes the place of this placeholder.
  static ExprP placeholder(int line) {
    auto e = std::make_unique<Expr>();
    e->type = Expr::Type::constant;
    e->line = line;
    return e;
  }
  // The body of a tag opened on `line`, up to one of `ends`; a loop body with `loop` set.
  Body inner_body(const std::vector<std::string>& ends, int line, int loops) {
    const int saved = loops_;
    loops_ = loops;
    Body b = parse_body(ends, line);
    loops_ = saved;
    return b;
  }

  StmtP parse_statement() {
    const Token head = cur();
    ++tok_;
    auto st = std::make_unique<Stmt>();
    st->line = head.line;
    const std::string& w = head.text;
    const int line = head.line;
    if (w == "if") {
      st->type = Stmt::Type::if_;
      ExprP cond = parse_tuple(true);
      end_tag();
      while (true) {
        Body b = inner_body({"elif", "else", "endif"}, line, loops_);
        st->branches.emplace_back(std::move(cond), std::move(b));
        const std::string which = cur().text;
        ++tok_;
        if (which == "elif") {
          cond = parse_tuple(true);
          end_tag();
          continue;
        }
        if (which == "else") {
          end_tag();
          st->else_body = inner_body({"endif"}, line, loops_);
          ++tok_;
        }
        end_tag();
        break;
      }
    } else if (w == "for") {
      st->type = Stmt::Type::for_;
      st->targets = parse_targets();
      expect_name("in");
      st->expr = parse_tuple(false);
      if (is_name("if")) {
        ++tok_;
        st->condition = parse_tuple(true);
      }
      if (is_name("recursive")) fail_at(line, "recursive for loops are not supported");
      end_tag();
      st->body = inner_body({"else", "endfor"}, line, loops_ + 1);
      if (cur().text == "else") {
        ++tok_;
        end_tag();
        st->else_body = inner_body({"endfor"}, line, loops_);
      }
      ++tok_;
      end_tag();
    } else if (w == "set") {
      // {% set ns.attr = v %}, {% set a, b = v %}, {% set a = v %} or {% set a %}...{% endset %}
      if (cur().type == Tok::name && peek(1).type == Tok::op && peek(1).text == ".") {
        st->type = Stmt::Type::set;
        auto obj = std::make_unique<Expr>();
        obj->type = Expr::Type::name;
        obj->name = cur().text;
        obj->line = cur().line;
        tok_ += 2;
        if (cur().type != Tok::name) fail_at(cur().line, "{% set x. %} needs an attribute name");
        auto attr = std::make_unique<Expr>();
        attr->type = Expr::Type::attr;
        attr->name = cur().text;
        attr->line = cur().line;
        attr->args.push_back(std::move(obj));
        ++tok_;
        st->target = std::move(attr);
        expect_op("=");
        st->expr = parse_tuple(true);
        end_tag();
      } else {
        st->targets = parse_targets();
        if ((cur().type == Tok::end || is_op("|")) && st->targets.size() == 1) {
          st->type = Stmt::Type::set_block;
          st->text = st->targets[0];
          if (is_op("|"))  // {% set x | filter %}: the block's text filtered
            st->expr = parse_filters(placeholder(line), false);
          st->body = block_to("endset", line, loops_);
        } else {
          st->type = Stmt::Type::set;
          expect_op("=");
          st->expr = parse_tuple(true);
          end_tag();
        }
      }
    } else if (w == "macro") {
      st->type = Stmt::Type::macro;
      if (cur().type != Tok::name) fail_at(line, "{% macro %} needs a name");
      st->text = cur().text;
      ++tok_;
      parse_params(*st);
      st->body = block_to("endmacro", line, 0);
    } else if (w == "call") {
      st->type = Stmt::Type::call_block;
      st->text = "caller";  // the body is a macro of that name, with these parameters
      if (is_op("(")) parse_params(*st);
      st->call = parse_expression();
      if (st->call->type != Expr::Type::call)
        fail_at(line, "{% call %} needs a macro call, e.g. {% call m() %}");
      st->body = block_to("endcall", line, 0);
    } else if (w == "filter") {
      st->type = Stmt::Type::filter_block;
      // The filters (with their arguments) apply to the block's output, which the interpreter
      // puts in place of the placeholder at the chain's start.
      st->expr = parse_filters(placeholder(line), true);
      st->body = block_to("endfilter", line, loops_);
    } else if (w == "generation") {
      generation_ = true;
      // TRL's marker of an assistant's reply: the reply itself is what renders.
      st->type = Stmt::Type::body;
      st->body = block_to("endgeneration", line, loops_);
    } else if (w == "break" || w == "continue") {
      if (loops_ == 0) fail_at(line, fmt::format("{{% {} %}} outside a for loop", w));
      st->type = w == "break" ? Stmt::Type::break_ : Stmt::Type::continue_;
      end_tag();
    } else {
      fail_at(line,
              fmt::format("the tag {{% {} %}} is not supported in a chat template (supported: if, "
                          "for, set, macro, call, filter, generation, raw, break, continue)",
                          w));
    }
    return st;
  }

  // (a, b=default, ...): a macro's parameters, or a call block's caller's.
  void parse_params(Stmt& st) {
    expect_op("(");
    while (!is_op(")")) {
      if (cur().type != Tok::name) fail_at(cur().line, "a macro's parameters must be names");
      st.params.push_back(cur().text);
      ++tok_;
      if (is_op("=")) {
        ++tok_;
        st.defaults.push_back(parse_expression());
      } else {
        st.defaults.push_back(nullptr);
      }
      if (!is_op(",")) break;
      ++tok_;
    }
    expect_op(")");
  }

  // Names: `a` or `a, b` or `(a, b)`.
  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) ++tok_;
    while (true) {
      if (cur().type != Tok::name) fail_at(cur().line, "expected a name to assign to");
      names.push_back(cur().text);
      ++tok_;
      if (!is_op(",")) break;
      ++tok_;
    }
    if (paren) expect_op(")");
    return names;
  }

  // expr or `a, b, c` (a tuple); `with_cond`: a if b else c allowed (not in for's iterable).
  ExprP parse_tuple(bool with_cond) {
    const int line = cur().line;
    ExprP first = with_cond ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto t = std::make_unique<Expr>();
    t->type = Expr::Type::tuple;
    t->line = line;
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      ++tok_;
      if (cur().type == Tok::end || is_name("if") || is_op(")")) break;
      t->args.push_back(with_cond ? parse_expression() : parse_or());
    }
    return t;
  }

  ExprP parse_expression() {
    const Nest guard(*this);
    ExprP e = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      ++tok_;
      auto c = std::make_unique<Expr>();
      c->type = Expr::Type::cond;
      c->line = line;
      ExprP test = parse_or();
      ExprP otherwise;
      if (is_name("else")) {
        ++tok_;
        otherwise = parse_expression();
      }
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprP binary(Expr::Type type, ExprP a, ExprP b, int line, std::string op = {}) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = line;
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  // One level of left-associative binary operators: next (op next)*, an operator being a word
  // (and, or) or a symbol.
  ExprP left_assoc(ExprP (Parser::*next)(), std::initializer_list<std::string_view> ops,
                   Expr::Type type) {
    ExprP e = (this->*next)();
    while ((cur().type == Tok::op || cur().type == Tok::name) &&
           std::find(ops.begin(), ops.end(), cur().text) != ops.end()) {
      const std::string op = cur().text;
      const int line = cur().line;
      ++tok_;
      e = binary(type, std::move(e), (this->*next)(), line, op);
    }
    return e;
  }
  ExprP parse_or() { return left_assoc(&Parser::parse_and, {"or"}, Expr::Type::or_); }
  ExprP parse_and() { return left_assoc(&Parser::parse_not, {"and"}, Expr::Type::and_); }
  ExprP parse_not() {
    const Nest guard(*this);
    if (is_name("not")) {
      auto e = std::make_unique<Expr>();
      e->type = Expr::Type::not_;
      e->line = cur().line;
      ++tok_;
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP first = parse_math1();
    std::unique_ptr<Expr> c;
    while (true) {
      std::string op;
      if (cur().type == Tok::op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" ||
           cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        ++tok_;
      } else if (is_name("in")) {
        op = "in";
        ++tok_;
      } else if (is_name("not") && peek(1).type == Tok::name && peek(1).text == "in") {
        op = "not in";
        tok_ += 2;
      } else {
        break;
      }
      if (!c) {
        c = std::make_unique<Expr>();
        c->type = Expr::Type::compare;
        c->line = first->line;
        c->args.push_back(std::move(first));
      }
      c->ops.push_back(op);
      c->args.push_back(parse_math1());
    }
    return c ? std::move(c) : std::move(first);
  }
  ExprP parse_math1() { return left_assoc(&Parser::parse_concat, {"+", "-"}, Expr::Type::binary); }
  ExprP parse_concat() { return left_assoc(&Parser::parse_math2, {"~"}, Expr::Type::binary); }
  ExprP parse_math2() {
    return left_assoc(&Parser::parse_pow, {"*", "/", "//", "%"}, Expr::Type::binary);
  }
  ExprP parse_pow() { return left_assoc(&Parser::parse_filtered, {"**"}, Expr::Type::binary); }
  ExprP parse_filtered() { return parse_unary(true); }
  ExprP parse_unary(bool with_filter) {
    const Nest guard(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      auto u = std::make_unique<Expr>();
      u->type = cur().text == "-" ? Expr::Type::neg : Expr::Type::pos;
      u->line = cur().line;
      ++tok_;
      u->args.push_back(parse_unary(false));
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e), false);
    return e;
  }

  ExprP parse_primary() {
    const Token& t = cur();
    auto e = std::make_unique<Expr>();
    e->line = t.line;
    switch (t.type) {
      case Tok::name:
        if (t.text == "true" || t.text == "True") {
          e->value = Value::boolean(true);
        } else if (t.text == "false" || t.text == "False") {
          e->value = Value::boolean(false);
        } else if (t.text == "none" || t.text == "None") {
          e->value = Value::none();
        } else {
          e->type = Expr::Type::name;
          e->name = t.text;
        }
        ++tok_;
        return e;
      case Tok::string: {
        std::string s;
        while (cur().type == Tok::string) {  // adjacent literals join
          s += cur().text;
          ++tok_;
        }
        e->value = Value::string(std::move(s));
        return e;
      }
      case Tok::integer:
        e->value = Value::integer(t.i);
        ++tok_;
        return e;
      case Tok::real:
        e->value = Value::real(t.f);
        ++tok_;
        return e;
      case Tok::op:
        if (t.text == "(") {
          ++tok_;
          if (is_op(")")) {
            ++tok_;
            e->type = Expr::Type::tuple;
            return e;
          }
          ExprP inner = parse_expression();
          if (is_op(",")) {
            auto tup = std::make_unique<Expr>();
            tup->type = Expr::Type::tuple;
            tup->line = t.line;
            tup->args.push_back(std::move(inner));
            while (is_op(",")) {
              ++tok_;
              if (is_op(")")) break;
              tup->args.push_back(parse_expression());
            }
            inner = std::move(tup);
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          ++tok_;
          e->type = Expr::Type::list;
          while (!is_op("]")) {
            e->args.push_back(parse_expression());
            if (!is_op(",")) break;
            ++tok_;
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          ++tok_;
          e->type = Expr::Type::dict;
          while (!is_op("}")) {
            e->args.push_back(parse_expression());
            expect_op(":");
            e->args.push_back(parse_expression());
            if (!is_op(",")) break;
            ++tok_;
          }
          expect_op("}");
          return e;
        }
        break;
      default:
        break;
    }
    fail_at(t.line, t.type == Tok::end ? std::string("an expression ends too early")
                                       : fmt::format("unexpected {}", describe(t)));
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        const int line = cur().line;
        ++tok_;
        auto a = std::make_unique<Expr>();
        a->line = line;
        if (cur().type == Tok::name) {
          a->type = Expr::Type::attr;
          a->name = cur().text;
        } else if (cur().type == Tok::integer) {
          a->type = Expr::Type::item;
          auto idx = std::make_unique<Expr>();
          idx->value = Value::integer(cur().i);
          idx->line = line;
          a->args.push_back(std::move(e));
          a->args.push_back(std::move(idx));
          ++tok_;
          e = std::move(a);
          continue;
        } else {
          fail_at(line, "expected an attribute name after .");
        }
        ++tok_;
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj) {
    const int line = cur().line;
    ++tok_;
    ExprP parts[3];
    bool slice = false;
    int part = 0;
    while (true) {
      if (is_op(":")) {
        slice = true;
        if (++part > 2) fail_at(line, "a slice has at most three parts");
        ++tok_;
        continue;
      }
      if (is_op("]")) break;
      if (parts[part]) fail_at(line, "expected ] or : in a subscript");
      parts[part] = parse_expression();
    }
    expect_op("]");
    auto e = std::make_unique<Expr>();
    e->line = line;
    e->args.push_back(std::move(obj));
    if (slice) {
      e->type = Expr::Type::slice;
      for (auto& p : parts) e->args.push_back(std::move(p));
    } else {
      if (!parts[0]) fail_at(line, "an empty subscript []");
      e->type = Expr::Type::item;
      e->args.push_back(std::move(parts[0]));
    }
    return e;
  }

  // f(a, b, k=v): args[0] is the callee.
  ExprP parse_call(ExprP fn) {
    auto e = std::make_unique<Expr>();
    e->type = Expr::Type::call;
    e->line = cur().line;
    e->args.push_back(std::move(fn));
    parse_arguments(*e);
    return e;
  }
  void parse_arguments(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**"))
        fail_at(cur().line, "*args and **kwargs in a call are not supported");
      if (cur().type == Tok::name && peek(1).type == Tok::op && peek(1).text == "=") {
        std::string key = cur().text;
        tok_ += 2;
        e.kwargs.emplace_back(std::move(key), parse_expression());
      } else {
        if (!e.kwargs.empty())
          fail_at(cur().line, "a positional argument after a keyword argument");
        e.args.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      ++tok_;
    }
    expect_op(")");
  }

  // `| filter(args)` and `is [not] test(args)`, in any order; `block`: a {% filter %} tag's.
  ExprP parse_filters(ExprP e, bool block) {
    bool first = block;
    while (true) {
      if (is_op("|") || first) {
        if (!first) ++tok_;
        first = false;
        if (cur().type != Tok::name) fail_at(cur().line, "expected a filter name after |");
        auto f = std::make_unique<Expr>();
        f->type = Expr::Type::filter;
        f->line = cur().line;
        f->name = cur().text;
        ++tok_;
        while (is_op(".") && peek(1).type == Tok::name) {
          f->name += "." + peek(1).text;
          tok_ += 2;
        }
        if (!known(kFilters, f->name))
          fail_at(f->line, fmt::format("the filter '{}' is not supported (strata's Jinja knows {})",
                                       f->name, fmt::join(kFilters, ", ")));
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_arguments(*f);
        e = std::move(f);
      } else if (!block && is_name("is")) {
        ++tok_;
        auto t = std::make_unique<Expr>();
        t->type = Expr::Type::test;
        t->line = cur().line;
        if (is_name("not")) {
          t->negated = true;
          ++tok_;
        }
        if (cur().type != Tok::name) fail_at(cur().line, "expected a test name after is");
        t->name = cur().text;
        if (!known(kTests, t->name))
          fail_at(cur().line,
                  fmt::format("the test '{}' is not supported (strata's Jinja knows {})", t->name,
                              fmt::join(kTests, ", ")));
        ++tok_;
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          parse_arguments(*t);
        } else if ((cur().type == Tok::name && cur().text != "else" && cur().text != "or" &&
                    cur().text != "and" && cur().text != "if" && cur().text != "is" &&
                    cur().text != "in" && cur().text != "not") ||
                   cur().type == Tok::string || cur().type == Tok::integer ||
                   cur().type == Tok::real || is_op("[") || is_op("{")) {
          ExprP arg = parse_primary();
          t->args.push_back(parse_postfix(std::move(arg)));
        }
        e = std::move(t);
      } else if (!block && is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  // One level deeper in the parse, refused past kMaxDepth at the current line.
  struct Nest {
    explicit Nest(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxDepth)
        fail_at(parser.toks_ != nullptr ? parser.cur().line : 0,
                fmt::format("nested more than {} deep", kMaxDepth));
    }
    ~Nest() { --parser.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
    Parser& parser;
  };

  const Token& cur() const { return (*toks_)[std::min(tok_, toks_->size() - 1)]; }
  const Token& peek(size_t n) const { return (*toks_)[std::min(tok_ + n, toks_->size() - 1)]; }
  bool is_op(std::string_view op) const { return cur().type == Tok::op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == Tok::name && cur().text == n; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::name:
        return fmt::format("name {}", t.text);
      case Tok::string:
        return fmt::format("string {}", string_repr(t.text));
      case Tok::integer:
        return fmt::format("number {}", t.i);
      case Tok::real:
        return fmt::format("number {}", float_repr(t.f));
      case Tok::op:
        return fmt::format("'{}'", t.text);
      case Tok::end:
        return "end of tag";
    }
    return "?";
  }
  void expect_op(std::string_view op) {
    if (!is_op(op))
      fail_at(cur().line, fmt::format("expected '{}', found {}", op, describe(cur())));
    ++tok_;
  }
  void expect_name(std::string_view n) {
    if (!is_name(n))
      fail_at(cur().line, fmt::format("expected '{}', found {}", n, describe(cur())));
    ++tok_;
  }
  void expect_end() {
    if (cur().type != Tok::end)
      fail_at(cur().line, fmt::format("expected the end of the tag, found {}", describe(cur())));
  }

  std::vector<Segment> segs_;
  size_t seg_ = 0;
  const std::vector<Token>* toks_ = nullptr;
  size_t tok_ = 0;
  int loops_ = 0;
  bool generation_ = false;

 public:
  bool saw_generation() const { return generation_; }

 private:
  int depth_ = 0;  // for loops around the tag being parsed (a macro's body starts at 0)
};

}  // namespace

// ---- interpreting ----------------------------------------------------------------------------

struct ChatTemplate::Program {
  Body body;
  bool generation = false;
  std::string source;
};

namespace {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(std::string_view name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get())
      for (const auto& kv : s->vars)
        if (kv.first == name) return &kv.second;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& kv : vars)
      if (kv.first == name) {
        kv.second = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};
using ScopeP = std::shared_ptr<Scope>;

enum class Flow : uint8_t { normal, break_, continue_ };

// An argument by position or keyword, with a default; unknown keywords are errors.
struct Args {
  CallArgs& a;
  std::string what;
  std::vector<bool> used_kw;
  Args(CallArgs& args, std::string name)
      : a(args), what(std::move(name)), used_kw(args.kw.size()) {}
  std::optional<Value> get(size_t position, std::string_view keyword) {
    for (size_t k = 0; k < a.kw.size(); ++k)
      if (a.kw[k].first == keyword) {
        used_kw[k] = true;
        return a.kw[k].second;
      }
    if (position < a.pos.size()) return a.pos[position];
    return std::nullopt;
  }
  Value get(size_t position, std::string_view keyword, Value fallback) {
    std::optional<Value> v = get(position, keyword);
    return v ? *v : std::move(fallback);
  }
  Value need(size_t position, std::string_view keyword) {
    std::optional<Value> v = get(position, keyword);
    if (!v) error(fmt::format("{}() needs the argument {}", what, keyword));
    return *v;
  }
  void done(size_t max_positional) {
    if (a.pos.size() > max_positional)
      error(fmt::format("{}() takes at most {} positional arguments, {} given", what,
                        max_positional, a.pos.size()));
    for (size_t k = 0; k < a.kw.size(); ++k)
      if (!used_kw[k]) error(fmt::format("{}() has no argument {}", what, a.kw[k].first));
  }
};

std::string want_string(const Value& v, const char* what) {
  if (v.kind != Kind::string)
    error(fmt::format("{} needs a string, not {}", what, type_name(defined(v))));
  return v.s;
}
int64_t want_int(const Value& v, const char* what) {
  if (v.kind != Kind::integer && v.kind != Kind::boolean)
    error(fmt::format("{} needs an integer, not {}", what, type_name(defined(v))));
  return v.integral();
}

// Python's str.split(sep, maxsplit).
Value split_string(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<Value> parts;
  if (sep.kind == Kind::none || sep.is_undefined()) {
    size_t k = 0;
    while (true) {
      while (k < s.size() && space_at(s, k) > 0) k += space_at(s, k);
      if (k >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Value::string(strip_text(s.substr(k), false, true, std::nullopt)));
        break;
      }
      size_t e = k;
      while (e < s.size() && space_at(s, e) == 0) ++e;
      parts.push_back(Value::string(s.substr(k, e - k)));
      k = e;
    }
  } else {
    const std::string d = want_string(sep, "split()");
    if (d.empty()) error("split(): empty separator");
    size_t k = 0;
    while (true) {
      const size_t at = s.find(d, k);
      if (at == std::string::npos ||
          (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
        parts.push_back(Value::string(s.substr(k)));
        break;
      }
      parts.push_back(Value::string(s.substr(k, at - k)));
      k = at + d.size();
    }
  }
  return Value::make_list(std::move(parts));
}

std::string replace_all(std::string s, const std::string& from, const std::string& to,
                        int64_t count) {
  if (from.empty()) error("replace(): an empty string to replace is not supported");
  size_t k = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t at = s.find(from, k);
    if (at == std::string::npos) break;
    s.replace(at, from.size(), to);
    k = at + to.size();
  }
  return s;
}

// A Python-style index into n items (negative from the end); nullopt when out of range.
std::optional<size_t> index_of(int64_t i, size_t n) {
  if (i < 0) i += static_cast<int64_t>(n);
  if (i < 0 || i >= static_cast<int64_t>(n)) return std::nullopt;
  return static_cast<size_t>(i);
}

std::vector<size_t> slice_indexes(size_t n, const Value& a, const Value& b, const Value& c) {
  const auto given = [](const Value& v) { return !v.is_undefined() && v.kind != Kind::none; };
  const int64_t step = given(c) ? want_int(c, "a slice's step") : 1;
  if (step == 0) error("slice step cannot be zero");
  const auto len = static_cast<int64_t>(n);
  const auto clamp = [&](const Value& v, int64_t dflt) {
    if (!given(v)) return dflt;
    int64_t x = want_int(v, "a slice");
    if (x < 0) x += len;
    if (step > 0) return std::clamp<int64_t>(x, 0, len);
    return std::clamp<int64_t>(x, -1, len - 1);
  };
  const int64_t start = clamp(a, step > 0 ? 0 : len - 1);
  const int64_t stop = clamp(b, step > 0 ? len : -1);
  std::vector<size_t> out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step)
    out.push_back(static_cast<size_t>(k));
  return out;
}

struct Interp {
  std::string rendered;

  // ---- attributes and methods ----

  Value bound(const Value& self, std::string method) {
    return make_function(method, [self, method](CallArgs& call, Interp& in) {
      return in.call_method(self, method, call);
    });
  }

  Value getattr(const Value& obj, const std::string& attr) {
    switch (obj.kind) {
      case Kind::undefined:
        error(obj.s);
      case Kind::dict:
        if (attr == "items" || attr == "keys" || attr == "values" || attr == "get")
          return bound(obj, attr);
        [[fallthrough]];
      case Kind::ns:
        if (const Value* v = dict_find(obj, attr)) return *v;
        return Value::undefined(fmt::format("'{}' has no attribute '{}'",
                                            obj.kind == Kind::ns ? "Namespace" : "dict object",
                                            attr));
      case Kind::string: {
        static const char* const kMethods[] = {
            "strip",      "lstrip",  "rstrip",  "split",      "startswith", "endswith", "upper",
            "lower",      "replace", "title",   "capitalize", "find",       "count",    "join",
            "splitlines", "isdigit", "isspace", "isalpha",    "isalnum",    "isupper",  "islower"};
        for (const char* m : kMethods)
          if (attr == m) return bound(obj, attr);
        break;
      }
      case Kind::list:
      case Kind::tuple:
        if (attr == "index" || attr == "count") return bound(obj, attr);
        if (attr == "append" || attr == "pop" || attr == "insert" || attr == "extend" ||
            attr == "remove" || attr == "sort" || attr == "reverse" || attr == "clear")
          error(
              fmt::format("a list's {}() changes it, which a chat template may not (transformers "
                          "runs templates in Jinja's immutable sandbox)",
                          attr));
        break;
      default:
        break;
    }
    return Value::undefined(fmt::format("'{}' object has no attribute '{}'", type_name(obj), attr));
  }

  Value getitem(const Value& obj, const Value& key) {
    switch (obj.kind) {
      case Kind::undefined:
        error(obj.s);
      case Kind::dict:
      case Kind::ns:
        for (const auto& kv : obj.dict->items)
          if (equal(kv.first, key)) return kv.second;
        if (key.kind == Kind::string) return getattr(obj, key.s);
        return Value::undefined(fmt::format("'dict object' has no attribute {}", repr(key)));
      case Kind::list:
      case Kind::tuple: {
        if (key.kind != Kind::integer && key.kind != Kind::boolean) {
          if (key.kind == Kind::string) return getattr(obj, key.s);
          error(fmt::format("list indices must be integers, not {}", type_name(key)));
        }
        if (auto k = index_of(key.integral(), obj.list->items.size())) return obj.list->items[*k];
        return Value::undefined(
            fmt::format("{} object has no element {}", type_name(obj), key.integral()));
      }
      case Kind::string: {
        if (key.kind == Kind::string) return getattr(obj, key.s);
        const std::vector<size_t> at = code_point_offsets(obj.s);
        if (auto k = index_of(want_int(key, "a string index"), at.size() - 1))
          return Value::string(obj.s.substr(at[*k], at[*k + 1] - at[*k]));
        return Value::undefined(fmt::format("str object has no element {}", key.integral()));
      }
      default:
        if (key.kind == Kind::string) return getattr(obj, key.s);
        error(fmt::format("'{}' object is not subscriptable", type_name(obj)));
    }
  }

  Value call_method(const Value& self, const std::string& m, CallArgs& call) {
    Args a(call, m);
    if (self.kind == Kind::dict) {
      if (m == "items" || m == "keys" || m == "values") {
        a.done(0);
        std::vector<Value> out;
        for (const auto& [k, v] : self.dict->items)
          out.push_back(m == "items" ? Value::make_list({k, v}, true) : m == "keys" ? k : v);
        return Value::make_list(std::move(out));
      }
      if (m == "get") {
        const Value key = a.need(0, "key");
        const Value dflt = a.get(1, "default", Value::none());
        a.done(2);
        for (const auto& kv : self.dict->items)
          if (equal(kv.first, key)) return kv.second;
        return dflt;
      }
    }
    if (self.is_sequence()) {
      const Value x = a.need(0, "value");
      a.done(1);
      const auto& items = self.list->items;
      if (m == "count")
        return Value::integer(
            std::count_if(items.begin(), items.end(), [&](const Value& v) { return equal(v, x); }));
      for (size_t k = 0; k < items.size(); ++k)
        if (equal(items[k], x)) return Value::integer(static_cast<int64_t>(k));
      error(fmt::format("{} is not in list", repr(x)));
    }
    const std::string& s = self.s;
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      const Value chars = a.get(0, "chars", Value::none());
      a.done(1);
      std::optional<std::string> set;
      if (chars.kind != Kind::none) set = want_string(chars, "strip()");
      return Value::string(strip_text(s, m != "rstrip", m != "lstrip", set), self.safe);
    }
    if ((m == "split" || m == "splitlines") && self.safe)
      error(
          fmt::format("{}() of a safe string (|safe, |e) is not supported: Jinja's gives safe "
                      "pieces, which strata does not track",
                      m));
    if (m == "split") {
      const Value sep = a.get(0, "sep", Value::none());
      const Value maxsplit = a.get(1, "maxsplit", Value::integer(-1));
      a.done(2);
      return split_string(s, sep, want_int(maxsplit, "split()'s maxsplit"));
    }
    if (m == "splitlines") {
      a.done(0);
      std::vector<Value> lines;
      size_t k = 0;
      while (k < s.size()) {
        const size_t e = s.find_first_of("\n\r", k);
        if (e == std::string::npos) {
          lines.push_back(Value::string(s.substr(k)));
          break;
        }
        lines.push_back(Value::string(s.substr(k, e - k)));
        k = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
      }
      return Value::make_list(std::move(lines));
    }
    if (m == "startswith" || m == "endswith") {
      const Value p = a.need(0, "prefix");
      a.done(1);
      std::vector<std::string> options;
      if (p.kind == Kind::tuple)
        for (const Value& v : p.list->items) options.push_back(want_string(v, m.c_str()));
      else
        options.push_back(want_string(p, m.c_str()));
      for (const std::string& o : options)
        if (m == "startswith" ? s.starts_with(o) : s.ends_with(o)) return Value::boolean(true);
      return Value::boolean(false);
    }
    if (m == "upper" || m == "lower") {
      a.done(0);
      return Value::string(ascii_case(s, m.c_str(), m == "upper" ? 1 : 0), self.safe);
    }
    if (m == "title" || m == "capitalize") {
      a.done(0);
      return Value::string(title_case(s, m == "title", m.c_str()), self.safe);
    }
    if (m == "replace") {
      // A safe string's replace() escapes its arguments (Markup's methods do).
      const auto arg = [&](const Value& x) {
        const std::string t = want_string(x, "replace()");
        return self.safe && !x.safe ? html_escape(t) : t;
      };
      const std::string from = arg(a.need(0, "old"));
      const std::string to = arg(a.need(1, "new"));
      const Value count = a.get(2, "count", Value::integer(-1));
      a.done(3);
      return Value::string(replace_all(s, from, to, want_int(count, "replace()'s count")),
                           self.safe);
    }
    if (m == "find" || m == "count") {
      const std::string sub = want_string(a.need(0, "sub"), m.c_str());
      a.done(1);
      if (m == "find") {
        const size_t at = s.find(sub);
        return Value::integer(
            at == std::string::npos ? -1 : static_cast<int64_t>(code_points(s.substr(0, at))));
      }
      if (sub.empty()) return Value::integer(static_cast<int64_t>(code_points(s)) + 1);
      int64_t n = 0;
      for (size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++n;
      return Value::integer(n);
    }
    if (m == "join") {
      const Value items = a.need(0, "iterable");
      a.done(1);
      std::string out;
      bool first = true;
      for (const Value& v : iterate(items)) {
        if (!first) out += s;
        first = false;
        const std::string item = want_string(v, "join()");
        out += self.safe && !v.safe ? html_escape(item) : item;  // Markup.join escapes
      }
      return Value::string(out, self.safe);
    }
    if (m.starts_with("is")) {
      a.done(0);
      if (!ascii(s)) error(fmt::format("{}() of non-ASCII text is not supported", m));
      const auto all = [&](auto pred) {
        return !s.empty() && std::all_of(s.begin(), s.end(), [&](char c) {
          return pred(static_cast<unsigned char>(c)) != 0;
        });
      };
      if (m == "isdigit") return Value::boolean(all(::isdigit));
      if (m == "isspace") return Value::boolean(all(::isspace));
      if (m == "isalpha") return Value::boolean(all(::isalpha));
      if (m == "isalnum") return Value::boolean(all(::isalnum));
      const bool any_cased = std::any_of(s.begin(), s.end(), [](char c) {
        return std::isalpha(static_cast<unsigned char>(c)) != 0;
      });
      if (m == "isupper")
        return Value::boolean(any_cased && std::none_of(s.begin(), s.end(), [](char c) {
                                return std::islower(static_cast<unsigned char>(c)) != 0;
                              }));
      if (m == "islower")
        return Value::boolean(any_cased && std::none_of(s.begin(), s.end(), [](char c) {
                                return std::isupper(static_cast<unsigned char>(c)) != 0;
                              }));
    }
    error(fmt::format("the method {}() is not supported", m));
  }

  // ---- calls ----

  Value call_value(const Value& fn, CallArgs& args) {
    const Depth guard(calls_);
    if (fn.kind != Kind::function) {
      defined(fn);
      error(fmt::format("'{}' object is not callable", type_name(fn)));
    }
    return fn.fn->call(args, *this);
  }

  // ---- filters and tests ----

  Value apply_test(const std::string& test, const Value& v, CallArgs& call) {
    Args a(call, test);
    const auto arg = [&]() {
      Value x = a.need(0, "value");
      a.done(1);
      return x;
    };
    if (test == "defined") return a.done(0), Value::boolean(!v.is_undefined());
    if (test == "undefined") return a.done(0), Value::boolean(v.is_undefined());
    if (test == "none") return a.done(0), Value::boolean(v.kind == Kind::none);
    if (test == "string") return a.done(0), Value::boolean(v.kind == Kind::string);
    if (test == "number")
      return a.done(0), Value::boolean(v.kind == Kind::integer || v.kind == Kind::real ||
                                       v.kind == Kind::boolean || v.kind == Kind::bigint);
    if (test == "integer")
      return a.done(0), Value::boolean(v.kind == Kind::integer || v.kind == Kind::bigint);
    if (test == "float") return a.done(0), Value::boolean(v.kind == Kind::real);
    if (test == "boolean") return a.done(0), Value::boolean(v.kind == Kind::boolean);
    if (test == "true") return a.done(0), Value::boolean(v.kind == Kind::boolean && v.b);
    if (test == "false") return a.done(0), Value::boolean(v.kind == Kind::boolean && !v.b);
    if (test == "mapping") return a.done(0), Value::boolean(v.kind == Kind::dict);
    if (test == "sequence")
      return a.done(0),
             Value::boolean(v.is_sequence() || v.kind == Kind::string || v.kind == Kind::dict);
    if (test == "iterable")
      return a.done(0), Value::boolean(v.is_sequence() || v.kind == Kind::string ||
                                       v.is_mapping() || v.is_undefined());
    if (test == "callable") return a.done(0), Value::boolean(v.kind == Kind::function);
    if (test == "odd" || test == "even") {
      a.done(0);
      const int64_t x = want_int(v, test.c_str());
      return Value::boolean(((x % 2) != 0) == (test == "odd"));
    }
    if (test == "divisibleby") {
      const int64_t d = want_int(arg(), "divisibleby");
      if (d == 0) error("divisibleby(0): division by zero");
      return Value::boolean(want_int(v, "divisibleby") % d == 0);
    }
    if (test == "lower" || test == "upper") {
      a.done(0);
      want_string(v, test.c_str());
      CallArgs none;
      return call_method(v, "is" + test, none);
    }
    if (test == "equalto" || test == "eq" || test == "==" || test == "sameas")
      return Value::boolean(equal(v, arg()));
    if (test == "ne" || test == "!=") return Value::boolean(!equal(v, arg()));
    if (test == "lt" || test == "lessthan" || test == "<")
      return Value::boolean(compare(v, arg(), "<") < 0);
    if (test == "le" || test == "<=") return Value::boolean(compare(v, arg(), "<=") <= 0);
    if (test == "gt" || test == "greaterthan" || test == ">")
      return Value::boolean(compare(v, arg(), ">") > 0);
    if (test == "ge" || test == ">=") return Value::boolean(compare(v, arg(), ">=") >= 0);
    if (test == "in") return Value::boolean(contains(arg(), v));
    error(fmt::format("the test '{}' is not supported", test));
  }

  // Sort key: strings compared case-insensitively unless asked (Jinja's default).
  static Value sort_key(const Value& v, bool case_sensitive) {
    if (!case_sensitive && v.kind == Kind::string && ascii(v.s)) {
      std::string s = v.s;
      for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return Value::string(s);
    }
    if (!case_sensitive && v.kind == Kind::string)
      error("sorting non-ASCII strings without case_sensitive=true is not supported");
    return v;
  }

  // An item's attribute, as map(attribute=) and friends read it: "a.b" and "0" allowed.
  Value attribute_of(const Value& v, const Value& attr) {
    if (attr.kind == Kind::integer) return getitem(v, attr);
    const std::string path = want_string(attr, "attribute");
    Value cur = v;
    size_t k = 0;
    while (true) {
      const size_t dot = path.find('.', k);
      const std::string part =
          path.substr(k, dot == std::string::npos ? std::string::npos : dot - k);
      int64_t index = 0;
      const auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), index);
      if (ec == std::errc() && p == part.data() + part.size())
        cur = getitem(cur, Value::integer(index));
      else
        cur = getitem(cur, Value::string(part));
      if (dot == std::string::npos) return cur;
      k = dot + 1;
    }
  }

  Value apply_filter(const std::string& f, const Value& v, CallArgs& call) {
    Args a(call, f);
    if (f == "trim") {
      const Value chars = a.get(0, "chars", Value::none());
      a.done(1);
      std::optional<std::string> set;
      if (chars.kind != Kind::none) set = want_string(chars, "trim");
      return Value::string(strip_text(to_str(v), true, true, set), v.safe);
    }
    // These filters work on the string as it is, so a safe string stays safe.
    if (f == "length" || f == "count") return a.done(0), Value::integer(length(v));
    if (f == "upper" || f == "lower")
      return a.done(0),
             Value::string(ascii_case(to_str(v), f.c_str(), f == "upper" ? 1 : 0), v.safe);
    if (f == "capitalize")
      return a.done(0), Value::string(title_case(to_str(v), false, "capitalize"), v.safe);
    if (f == "title") {
      // Jinja's own rule, not str.title(): a word starts after whitespace, -, (, {, [ or <.
      a.done(0);
      std::string t = ascii_case(to_str(v), "title", 0);
      bool start = true;
      for (char& c : t) {
        if (start) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        start = std::isspace(static_cast<unsigned char>(c)) || c == '-' || c == '(' || c == '{' ||
                c == '[' || c == '<';
      }
      return Value::string(t, v.safe);
    }
    if (f == "default" || f == "d") {
      const Value dflt = a.get(0, "default_value", Value::string(""));
      const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
      a.done(2);
      if (v.is_undefined() || (boolean && !truthy(v))) return dflt;
      return v;
    }
    if (f == "string") return a.done(0), Value::string(to_str(v), v.safe);
    if (f == "safe") return a.done(0), Value::string(to_str(v), true);
    if (f == "e" || f == "escape") {
      a.done(0);
      if (v.kind == Kind::string && v.safe) return v;  // already escaped
      return Value::string(html_escape(to_str(v)), true);
    }
    if (f == "tojson") {
      const Value indent = a.get(1, "indent", Value::none());
      const Value ensure_ascii = a.get(0, "ensure_ascii", Value::boolean(false));
      const Value separators = a.get(2, "separators", Value::none());
      const bool sort_keys = truthy(a.get(3, "sort_keys", Value::boolean(false)));
      a.done(4);
      if (truthy(ensure_ascii)) error("tojson(ensure_ascii=true) is not supported");
      const int ind =
          indent.kind == Kind::none ? -1 : static_cast<int>(want_int(indent, "tojson's indent"));
      std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
      if (separators.kind != Kind::none) {
        if (!separators.is_sequence() || separators.list->items.size() != 2)
          error("tojson's separators must be a pair of strings");
        item_sep = want_string(separators.list->items[0], "tojson's separators");
        key_sep = want_string(separators.list->items[1], "tojson's separators");
      }
      std::string out;
      to_json(defined(v), out, ind, 0, item_sep, key_sep, sort_keys);
      return Value::string(out);
    }
    if (f == "first" || f == "last") {
      a.done(0);
      std::vector<Value> items = iterate(v);
      if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", f));
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") return a.done(0), Value::make_list(iterate(v));
    if (f == "reverse") {
      a.done(0);
      if (v.kind == Kind::string) {
        std::vector<Value> chars = iterate(v);
        std::string out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->s;
        return Value::string(out);
      }
      std::vector<Value> items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
    if (f == "join") {
      const Value sep = a.get(0, "d", Value::string(""));
      const Value attribute = a.get(1, "attribute", Value::none());
      a.done(2);
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v)) {
        if (!first) out += to_str(sep);
        first = false;
        out += to_str(attribute.kind == Kind::none ? item : attribute_of(item, attribute));
      }
      return Value::string(out);
    }
    if (f == "int") {
      const Value dflt = a.get(0, "default", Value::integer(0));
      a.done(1);
      if (v.kind == Kind::integer || v.kind == Kind::boolean) return Value::integer(v.integral());
      if (v.kind == Kind::real) return Value::integer(static_cast<int64_t>(v.f));
      if (v.kind == Kind::string) {
        const std::string s = strip_text(v.s, true, true, std::nullopt);
        int64_t x = 0;
        const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
        if (ec == std::errc() && p == s.data() + s.size()) return Value::integer(x);
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size())
          return Value::integer(static_cast<int64_t>(d));
      }
      return dflt;
    }
    if (f == "float") {
      const Value dflt = a.get(0, "default", Value::real(0));
      a.done(1);
      if (v.is_number()) return Value::real(v.number());
      if (v.kind == Kind::string) {
        const std::string s = strip_text(v.s, true, true, std::nullopt);
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size()) return Value::real(d);
      }
      return dflt;
    }
    if (f == "abs") {
      a.done(0);
      if (v.kind == Kind::real) return Value::real(std::fabs(v.f));
      const int64_t x = want_int(v, "abs");
      if (x == INT64_MIN) error("abs(-2^63) overflows 64 bits");
      return Value::integer(x < 0 ? -x : x);
    }
    if (f == "round") {
      const int64_t precision = want_int(a.get(0, "precision", Value::integer(0)), "round");
      const std::string method = want_string(a.get(1, "method", Value::string("common")), "round");
      a.done(2);
      if (!v.is_number()) error(fmt::format("round needs a number, not {}", type_name(defined(v))));
      const double x = v.number();
      if (method == "common") {
        if (v.kind != Kind::real && precision >= 0) return Value::integer(v.integral());
        // Python's round(): the value correctly rounded, ties to even, as printf rounds.
        const std::string s = fmt::format("{:.{}f}", x, std::max<int64_t>(precision, 0));
        return Value::real(std::strtod(s.c_str(), nullptr));
      }
      const double scale = std::pow(10.0, static_cast<double>(precision));
      if (method == "floor") return Value::real(std::floor(x * scale) / scale);
      if (method == "ceil") return Value::real(std::ceil(x * scale) / scale);
      error(fmt::format("round's method must be common, floor or ceil, not {}", method));
    }
    if (f == "replace") {
      const std::string from = to_str(a.need(0, "old"));
      const std::string to = to_str(a.need(1, "new"));
      const Value count = a.get(2, "count", Value::none());
      a.done(3);
      return Value::string(replace_all(to_str(v), from, to,
                                       count.kind == Kind::none ? -1 : want_int(count, "replace")));
    }
    if (f == "items") {
      a.done(0);
      if (v.is_undefined()) return Value::make_list({});
      if (v.kind != Kind::dict) error(fmt::format("items needs a mapping, not {}", type_name(v)));
      CallArgs none;
      return call_method(v, "items", none);
    }
    if (f == "dictsort") {
      const bool case_sensitive = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const std::string by = want_string(a.get(1, "by", Value::string("key")), "dictsort");
      const bool reverse = truthy(a.get(2, "reverse", Value::boolean(false)));
      a.done(3);
      if (v.kind != Kind::dict)
        error(fmt::format("dictsort needs a mapping, not {}", type_name(defined(v))));
      std::vector<Value> items;
      for (const auto& [k, x] : v.dict->items) items.push_back(Value::make_list({k, x}, true));
      const size_t pos = by == "value" ? 1 : 0;
      std::stable_sort(items.begin(), items.end(), [&](const Value& p, const Value& q) {
        const int c = compare(sort_key(p.list->items[pos], case_sensitive),
                              sort_key(q.list->items[pos], case_sensitive), "<");
        return reverse ? c > 0 : c < 0;
      });
      return Value::make_list(std::move(items));
    }
    if (f == "sort") {
      const bool reverse = truthy(a.get(0, "reverse", Value::boolean(false)));
      const bool case_sensitive = truthy(a.get(1, "case_sensitive", Value::boolean(false)));
      const Value attribute = a.get(2, "attribute", Value::none());
      a.done(3);
      std::vector<Value> items = iterate(v);
      std::vector<Value> keys;
      for (const Value& x : items)
        keys.push_back(sort_key(attribute.kind == Kind::none ? x : attribute_of(x, attribute),
                                case_sensitive));
      std::vector<size_t> order(items.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      std::stable_sort(order.begin(), order.end(), [&](size_t p, size_t q) {
        const int c = compare(keys[p], keys[q], "<");
        return reverse ? c > 0 : c < 0;
      });
      std::vector<Value> out;
      for (size_t k : order) out.push_back(items[k]);
      return Value::make_list(std::move(out));
    }
    if (f == "unique") {
      const bool case_sensitive = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const Value attribute = a.get(1, "attribute", Value::none());
      a.done(2);
      std::vector<Value> out, seen;
      for (const Value& x : iterate(v)) {
        const Value key =
            sort_key(attribute.kind == Kind::none ? x : attribute_of(x, attribute), case_sensitive);
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); }))
          continue;
        seen.push_back(key);
        out.push_back(x);
      }
      return Value::make_list(std::move(out));
    }
    if (f == "min" || f == "max") {
      const bool case_sensitive = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const Value attribute = a.get(1, "attribute", Value::none());
      a.done(2);
      std::vector<Value> items = iterate(v);
      if (items.empty())
        return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
      size_t best = 0;
      for (size_t k = 1; k < items.size(); ++k) {
        const auto key = [&](size_t i) {
          return sort_key(
              attribute.kind == Kind::none ? items[i] : attribute_of(items[i], attribute),
              case_sensitive);
        };
        const int c = compare(key(k), key(best), "<");
        if (f == "min" ? c < 0 : c > 0) best = k;
      }
      return items[best];
    }
    if (f == "sum") {
      const Value attribute = a.get(0, "attribute", Value::none());
      Value total = a.get(1, "start", Value::integer(0));
      a.done(2);
      for (const Value& x : iterate(v))
        total =
            arithmetic("+", total, attribute.kind == Kind::none ? x : attribute_of(x, attribute));
      return total;
    }
    // Jinja's map and select family start with `if value:`: a falsy input gives nothing.
    if ((f == "map" || f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") &&
        !truthy(v))
      return Value::make_list({});
    if (f == "map") {
      std::vector<Value> out;
      const std::optional<Value> attribute = a.get(99, "attribute");
      if (attribute) {
        const Value dflt = a.get(99, "default", Value::undefined(""));
        const bool has_default = std::any_of(call.kw.begin(), call.kw.end(),
                                             [](const auto& kv) { return kv.first == "default"; });
        a.done(0);
        for (const Value& x : iterate(v)) {
          Value y = attribute_of(x, *attribute);
          out.push_back(y.is_undefined() && has_default ? dflt : y);
        }
        return Value::make_list(std::move(out));
      }
      if (call.pos.empty()) error("map needs a filter name or attribute=");
      const std::string filter = want_string(call.pos[0], "map");
      CallArgs rest;
      rest.pos.assign(call.pos.begin() + 1, call.pos.end());
      rest.kw = call.kw;
      for (const Value& x : iterate(v)) {
        CallArgs each = rest;
        out.push_back(apply_filter(filter, x, each));
      }
      return Value::make_list(std::move(out));
    }
    if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
      const bool attr = f.ends_with("attr");
      const bool keep = f.starts_with("select");
      size_t next = 0;
      Value attribute;
      if (attr) {
        if (call.pos.empty()) error(fmt::format("{} needs an attribute name", f));
        attribute = call.pos[next++];
      }
      std::optional<std::string> test;
      if (next < call.pos.size()) test = want_string(call.pos[next++], f.c_str());
      CallArgs rest;
      rest.pos.assign(call.pos.begin() + static_cast<long>(next), call.pos.end());
      rest.kw = call.kw;
      std::vector<Value> out;
      for (const Value& x : iterate(v)) {
        const Value subject = attr ? attribute_of(x, attribute) : x;
        bool pass;
        if (test) {
          CallArgs each = rest;
          pass = truthy(apply_test(*test, subject, each));
        } else {
          pass = truthy(subject);
        }
        if (pass == keep) out.push_back(x);
      }
      return Value::make_list(std::move(out));
    }
    if (f == "attr") {
      const std::string name2 = want_string(a.need(0, "name"), "attr");
      a.done(1);
      return getattr(v, name2);
    }
    if (f == "indent") {
      const Value width = a.get(0, "width", Value::integer(4));
      const bool first = truthy(a.get(1, "first", Value::boolean(false)));
      const bool blank = truthy(a.get(2, "blank", Value::boolean(false)));
      a.done(3);
      const std::string pad =
          width.kind == Kind::string
              ? width.s
              : std::string(static_cast<size_t>(std::max<int64_t>(0, want_int(width, "indent"))),
                            ' ');
      const std::string s = to_str(v);
      std::string out;
      size_t k = 0;
      bool first_line = true;
      while (true) {
        const size_t e = s.find('\n', k);
        const std::string line = s.substr(k, e == std::string::npos ? std::string::npos : e - k);
        if ((first_line ? first : true) && (blank || !line.empty())) out += pad;
        out += line;
        if (e == std::string::npos) break;
        out += '\n';
        k = e + 1;
        first_line = false;
      }
      return Value::string(out, v.safe);  // Jinja's indent keeps a Markup one
    }
    error(fmt::format("the filter '{}' is not supported", f));
  }

  // ---- operators ----

  Value arithmetic(const std::string& op, const Value& x, const Value& y) {
    if (op == "~") {
      std::string a = to_str(x), b = to_str(y);
      check_text_size(a.size() + b.size());
      return Value::string(a + b);
    }
    defined(x);
    defined(y);
    if (op == "+") {
      if (x.kind == Kind::string && y.kind == Kind::string) {
        // Markup.__add__ and __radd__: beside a safe string, the other is escaped.
        const bool safe = x.safe || y.safe;
        const std::string a = safe && !x.safe ? html_escape(x.s) : x.s;
        const std::string b = safe && !y.safe ? html_escape(y.s) : y.s;
        check_text_size(a.size() + b.size());
        return Value::string(a + b, safe);
      }
      if (x.is_sequence() && x.kind == y.kind) {
        check_list_size(x.list->items.size() + y.list->items.size());
        std::vector<Value> items = x.list->items;
        items.insert(items.end(), y.list->items.begin(), y.list->items.end());
        return Value::make_list(std::move(items), x.kind == Kind::tuple);
      }
    }
    if (op == "*") {
      const Value* seq = x.kind == Kind::string || x.is_sequence()   ? &x
                         : y.kind == Kind::string || y.is_sequence() ? &y
                                                                     : nullptr;
      const Value* count = seq == &x ? &y : &x;
      if (seq != nullptr && (count->kind == Kind::integer || count->kind == Kind::boolean)) {
        const int64_t n = std::max<int64_t>(0, count->integral());
        if (seq->kind == Kind::string) {
          check_text_size(seq->s.size() * static_cast<size_t>(std::min<int64_t>(n, kMaxText + 1)));
          std::string out;
          for (int64_t k = 0; k < n; ++k) out += seq->s;
          return Value::string(out, seq->safe);
        }
        check_list_size(seq->list->items.size() *
                        static_cast<size_t>(std::min<int64_t>(n, kMaxItems + 1)));
        std::vector<Value> items;
        for (int64_t k = 0; k < n; ++k)
          items.insert(items.end(), seq->list->items.begin(), seq->list->items.end());
        return Value::make_list(std::move(items), seq->kind == Kind::tuple);
      }
    }
    if (x.kind == Kind::bigint || y.kind == Kind::bigint)
      error(fmt::format("{} {} {}: arithmetic on an integer past 2^63 is not supported", to_str(x),
                        op, to_str(y)));
    if (!x.is_number() || !y.is_number())
      error(fmt::format("unsupported operand types for {}: '{}' and '{}'", op, type_name(x),
                        type_name(y)));
    const bool real = x.kind == Kind::real || y.kind == Kind::real;
    if (op == "/") {
      if (y.number() == 0) error("division by zero");
      return Value::real(x.number() / y.number());
    }
    if (real) {
      const double a = x.number(), b = y.number();
      if (op == "+") return Value::real(a + b);
      if (op == "-") return Value::real(a - b);
      if (op == "*") return Value::real(a * b);
      if (op == "**") return Value::real(std::pow(a, b));
      if (b == 0) error("float division by zero");
      if (op == "//") return Value::real(std::floor(a / b));
      if (op == "%") {
        double r = std::fmod(a, b);
        if (r != 0 && ((r < 0) != (b < 0))) r += b;
        return Value::real(r);
      }
    } else {
      const int64_t a = x.integral(), b = y.integral();
      // Python's integers do not overflow; strata's are 64 bits and refuse to.
      const auto checked = [&](bool overflowed, int64_t r) {
        if (overflowed) error(fmt::format("{} {} {} overflows 64 bits", a, op, b));
        return Value::integer(r);
      };
      int64_t r = 0;
      if (op == "+") {
        const bool over = __builtin_add_overflow(a, b, &r);
        return checked(over, r);
      }
      if (op == "-") {
        const bool over = __builtin_sub_overflow(a, b, &r);
        return checked(over, r);
      }
      if (op == "*") {
        const bool over = __builtin_mul_overflow(a, b, &r);
        return checked(over, r);
      }
      if (op == "**") {
        if (b < 0) return Value::real(std::pow(static_cast<double>(a), static_cast<double>(b)));
        r = 1;
        for (int64_t k = 0; k < b; ++k)
          if (__builtin_mul_overflow(r, a, &r)) return checked(true, 0);
        return Value::integer(r);
      }
      if (b == 0) error("integer division or modulo by zero");
      if (a == INT64_MIN && b == -1) return checked(true, 0);
      int64_t q = a / b, m = a % b;
      if (m != 0 && ((m < 0) != (b < 0))) {
        --q;
        m += b;
      }
      if (op == "//") return Value::integer(q);
      if (op == "%") return Value::integer(m);
    }
    error(fmt::format("the operator {} is not supported", op));
  }

  // ---- expressions ----

  Value eval(const Expr& e, const ScopeP& scope) {
    try {
      return eval_inner(e, scope);
    } catch (TemplateError& err) {
      if (err.line == 0) err.line = e.line;
      throw;
    }
  }

  void call_args(const Expr& e, size_t from, const ScopeP& scope, CallArgs& out) {
    for (size_t k = from; k < e.args.size(); ++k) out.pos.push_back(eval(*e.args[k], scope));
    for (const auto& [key, x] : e.kwargs) out.kw.emplace_back(key, eval(*x, scope));
  }

  Value eval_inner(const Expr& e, const ScopeP& scope) {
    using T = Expr::Type;
    switch (e.type) {
      case T::constant:
        return e.value;
      case T::name: {
        if (const Value* v = scope->find(e.name)) return *v;
        return Value::undefined(fmt::format("'{}' is undefined", e.name));
      }
      case T::list:
      case T::tuple: {
        std::vector<Value> items;
        for (const auto& x : e.args) items.push_back(eval(*x, scope));
        return Value::make_list(std::move(items), e.type == T::tuple);
      }
      case T::dict: {
        std::vector<std::pair<Value, Value>> items;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k], scope);
          Value val = eval(*e.args[k + 1], scope);
          auto it = std::find_if(items.begin(), items.end(),
                                 [&](const auto& kv) { return equal(kv.first, key); });
          if (it != items.end())
            it->second = std::move(val);
          else
            items.emplace_back(std::move(key), std::move(val));
        }
        return Value::make_dict(std::move(items));
      }
      case T::attr:
        return getattr(eval(*e.args[0], scope), e.name);
      case T::item:
        return getitem(eval(*e.args[0], scope), eval(*e.args[1], scope));
      case T::slice: {
        const Value obj = defined(eval(*e.args[0], scope));
        Value parts[3];
        for (int k = 0; k < 3; ++k)
          if (e.args[static_cast<size_t>(k) + 1])
            parts[k] = eval(*e.args[static_cast<size_t>(k) + 1], scope);
        if (obj.kind == Kind::string) {
          const std::vector<size_t> at = code_point_offsets(obj.s);
          std::string out;
          for (size_t k : slice_indexes(at.size() - 1, parts[0], parts[1], parts[2]))
            out += obj.s.substr(at[k], at[k + 1] - at[k]);
          return Value::string(out);
        }
        if (!obj.is_sequence())
          error(fmt::format("'{}' object is not subscriptable", type_name(obj)));
        std::vector<Value> out;
        for (size_t k : slice_indexes(obj.list->items.size(), parts[0], parts[1], parts[2]))
          out.push_back(obj.list->items[k]);
        return Value::make_list(std::move(out), obj.kind == Kind::tuple);
      }
      case T::call: {
        const Value fn = eval(*e.args[0], scope);
        CallArgs args;
        call_args(e, 1, scope, args);
        return call_value(fn, args);
      }
      case T::filter: {
        const Value v =
            e.args[0]->type == T::constant && e.args[0]->value.is_undefined() && filter_input_
                ? *filter_input_
                : eval(*e.args[0], scope);
        CallArgs args;
        call_args(e, 1, scope, args);
        return apply_filter(e.name, v, args);
      }
      case T::test: {
        const Value v = eval(*e.args[0], scope);
        CallArgs args;
        call_args(e, 1, scope, args);
        const bool r = truthy(apply_test(e.name, v, args));
        return Value::boolean(r != e.negated);
      }
      case T::neg:
      case T::pos: {
        const Value v = defined(eval(*e.args[0], scope));
        if (!v.is_number())
          error(fmt::format("bad operand type for unary {}: '{}'", e.type == T::neg ? '-' : '+',
                            type_name(v)));
        if (e.type == T::pos) return v.kind == Kind::boolean ? Value::integer(v.integral()) : v;
        if (v.kind == Kind::real) return Value::real(-v.f);
        if (v.integral() == INT64_MIN) error("-(-2^63) overflows 64 bits");
        return Value::integer(-v.integral());
      }
      case T::binary:
        return arithmetic(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope));
      case T::compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], scope);
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==")
            r = equal(left, right);
          else if (op == "!=")
            r = !equal(left, right);
          else if (op == "in")
            r = contains(right, left);
          else if (op == "not in")
            r = !contains(right, left);
          else {
            const int c = compare(left, right, op.c_str());
            r = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
          }
          if (!r) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case T::and_: {
        Value a = eval(*e.args[0], scope);
        return truthy(a) ? eval(*e.args[1], scope) : a;
      }
      case T::or_: {
        Value a = eval(*e.args[0], scope);
        return truthy(a) ? a : eval(*e.args[1], scope);
      }
      case T::not_:
        return Value::boolean(!truthy(eval(*e.args[0], scope)));
      case T::cond: {
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the if expression was false and had no else");
      }
    }
    error("unknown expression");
  }

  // ---- statements ----

  static void assign(const ScopeP& scope, const std::vector<std::string>& targets, const Value& v) {
    if (targets.size() == 1) {
      scope->set(targets[0], v);
      return;
    }
    std::vector<Value> items = iterate(defined(v));
    if (items.size() != targets.size())
      error(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    for (size_t k = 0; k < targets.size(); ++k) scope->set(targets[k], items[k]);
  }

  Flow exec(const Body& body, const ScopeP& scope, std::string& out) {
    for (const StmtP& st : body) {
      Flow f;
      try {
        f = exec_one(*st, scope, out);
      } catch (TemplateError& err) {
        if (err.line == 0) err.line = st->line;
        throw;
      } catch (Raised& r) {
        if (r.line == 0) r.line = st->line;
        throw;
      }
      if (f != Flow::normal) return f;
    }
    return Flow::normal;
  }

  Flow exec_one(const Stmt& st, const ScopeP& scope, std::string& out) {
    using T = Stmt::Type;
    switch (st.type) {
      case T::text:
        check_text_size(out.size() + st.text.size());
        out += st.text;
        return Flow::normal;
      case T::output: {
        const std::string text = to_str(eval(*st.expr, scope));
        check_text_size(out.size() + text.size());
        out += text;
        return Flow::normal;
      }
      case T::body: {  // a generation block: where it writes the result, its range is kept
        const bool top = generation != nullptr && &out == &rendered;
        const size_t start = out.size();
        const Flow f = exec(st.body, scope, out);
        if (top && out.size() > start) generation->emplace_back(start, out.size());
        return f;
      }
      case T::if_:
        for (const auto& [cond, b] : st.branches)
          if (truthy(eval(*cond, scope))) return exec(b, scope, out);
        return exec(st.else_body, scope, out);
      case T::for_: {
        const Value seq = eval(*st.expr, scope);
        std::vector<Value> items = iterate(seq);
        if (st.condition) {
          std::vector<Value> kept;
          for (const Value& x : items) {
            auto s = std::make_shared<Scope>();
            s->parent = scope;
            assign(s, st.targets, x);
            if (truthy(eval(*st.condition, s))) kept.push_back(x);
          }
          items = std::move(kept);
        }
        if (items.empty()) return exec(st.else_body, scope, out);
        const auto n = static_cast<int64_t>(items.size());
        const Value* outer = scope->find("loop");
        const int64_t depth =
            outer != nullptr && outer->kind == Kind::dict && dict_find(*outer, "depth")
                ? dict_find(*outer, "depth")->integral() + 1
                : 1;
        // One loop object, its fields set for each pass (as Jinja's LoopContext advances).
        Value loop = Value::make_dict({});
        const std::weak_ptr<DictData> fields = loop.dict;
        for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last",
                                "length", "depth", "depth0", "previtem", "nextitem"})
          loop.dict->items.emplace_back(Value::string(key), Value());
        loop.dict->items.emplace_back(Value::string("cycle"),
                                      make_function("cycle", [fields](CallArgs& c, Interp&) {
                                        const std::shared_ptr<DictData> f = fields.lock();
                                        if (!f) error("loop.cycle() called after its loop ended");
                                        if (c.pos.empty())
                                          error("loop.cycle() needs at least one value");
                                        const auto at = static_cast<size_t>(f->items[1].second.i);
                                        return c.pos[at % c.pos.size()];
                                      }));
        for (int64_t k = 0; k < n; ++k) {
          if (++iterations_ > kMaxIterations)
            error(fmt::format("more than {} loop iterations in one rendering", kMaxIterations));
          auto s = std::make_shared<Scope>();
          s->parent = scope;
          const auto idx = static_cast<size_t>(k);
          auto& field = loop.dict->items;
          field[0].second = Value::integer(k + 1);
          field[1].second = Value::integer(k);
          field[2].second = Value::integer(n - k);
          field[3].second = Value::integer(n - k - 1);
          field[4].second = Value::boolean(k == 0);
          field[5].second = Value::boolean(k == n - 1);
          field[6].second = Value::integer(n);
          field[7].second = Value::integer(depth);
          field[8].second = Value::integer(depth - 1);
          field[9].second = k > 0 ? items[idx - 1] : Value::undefined("there is no previous item");
          field[10].second = k + 1 < n ? items[idx + 1] : Value::undefined("there is no next item");
          s->set("loop", loop);
          assign(s, st.targets, items[idx]);
          const Flow f = exec(st.body, s, out);
          if (f == Flow::break_) break;
        }
        return Flow::normal;
      }
      case T::set: {
        const Value v = eval(*st.expr, scope);
        if (st.target) {
          const Value obj = eval(*st.target->args[0], scope);
          if (holds_namespace(v))
            error(
                fmt::format("a namespace (or a list or dict holding one) cannot be an attribute "
                            "of a namespace ({}): it could hold itself",
                            st.target->name));
          if (obj.kind != Kind::ns)
            error(
                fmt::format("cannot assign the attribute {} of {}: only a namespace() takes "
                            "attributes",
                            st.target->name, obj.is_undefined() ? obj.s : type_name(obj)));
          for (auto& kv : obj.dict->items)
            if (kv.first.kind == Kind::string && kv.first.s == st.target->name) {
              kv.second = v;
              return Flow::normal;
            }
          obj.dict->items.emplace_back(Value::string(st.target->name), v);
          return Flow::normal;
        }
        assign(scope, st.targets, v);
        return Flow::normal;
      }
      case T::set_block: {
        std::string captured;
        exec(st.body, scope, captured);
        Value v = Value::string(std::move(captured));
        if (st.expr) v = filtered(*st.expr, v, scope);
        scope->set(st.text, std::move(v));
        return Flow::normal;
      }
      case T::macro: {
        scope->set(st.text, macro_value(st, scope));
        return Flow::normal;
      }
      case T::call_block: {
        const Expr& c = *st.call;
        const Value fn = eval(*c.args[0], scope);
        CallArgs args;
        call_args(c, 1, scope, args);
        args.kw.emplace_back("caller", macro_value(st, scope));
        out += to_str(call_value(fn, args));
        return Flow::normal;
      }
      case T::filter_block: {
        std::string captured;
        exec(st.body, scope, captured);
        out += to_str(filtered(*st.expr, Value::string(std::move(captured)), scope));
        return Flow::normal;
      }
      case T::break_:
        return Flow::break_;
      case T::continue_:
        return Flow::continue_;
    }
    return Flow::normal;
  }

  // A block's text through the filters of `chain` (whose start is the placeholder).
  Value filtered(const Expr& chain, const Value& input, const ScopeP& scope) {
    const Value* saved = filter_input_;
    filter_input_ = &input;
    try {
      Value result = eval(chain, scope);
      filter_input_ = saved;
      return result;
    } catch (...) {
      filter_input_ = saved;
      throw;
    }
  }

  // A macro (or a call block's caller) as a function. It holds its scope weakly: the scope holds
  // the macro, and a strong hold would be a cycle that is never freed.
  static Value macro_value(const Stmt& st, const ScopeP& defined_in) {
    const Stmt* m = &st;
    const std::weak_ptr<Scope> where = defined_in;
    return make_function(st.text, [m, where](CallArgs& call, Interp& in) {
      auto s = std::make_shared<Scope>();
      s->parent = where.lock();
      if (!s->parent)
        error(fmt::format("the macro {} was called after the block defining it ended", m->text));
      std::vector<bool> set(m->params.size());
      std::vector<Value> extra;
      for (size_t k = 0; k < call.pos.size(); ++k) {
        if (k < m->params.size()) {
          s->set(m->params[k], call.pos[k]);
          set[k] = true;
        } else {
          extra.push_back(call.pos[k]);
        }
      }
      std::vector<std::pair<Value, Value>> kwargs;
      for (auto& [key, v] : call.kw) {
        const auto it = std::find(m->params.begin(), m->params.end(), key);
        if (it != m->params.end()) {
          s->set(key, v);
          set[static_cast<size_t>(it - m->params.begin())] = true;
        } else if (key == "caller") {
          s->set("caller", v);
        } else {
          kwargs.emplace_back(Value::string(key), v);
        }
      }
      for (size_t k = 0; k < m->params.size(); ++k) {
        if (set[k]) continue;
        if (m->defaults[k])
          s->set(m->params[k], in.eval(*m->defaults[k], s));
        else
          s->set(m->params[k], Value::undefined(fmt::format("the macro {} was called without {}",
                                                            m->text, m->params[k])));
      }
      if (!extra.empty())
        error(fmt::format("the macro {} takes {} arguments, {} given", m->text, m->params.size(),
                          call.pos.size()));
      if (!kwargs.empty())
        error(fmt::format("the macro {} has no argument {}", m->text, kwargs[0].first.s));
      std::string captured;
      in.exec(m->body, s, captured);
      return Value::string(std::move(captured));
    });
  }

  const Value* filter_input_ = nullptr;
  int calls_ = 0;
  uint64_t iterations_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>>* generation = nullptr;  // see render()
};

ScopeP globals() {
  auto g = std::make_shared<Scope>();
  g->set("raise_exception", make_function("raise_exception", [](CallArgs& c, Interp&) -> Value {
           throw Raised{c.pos.empty() ? std::string() : to_str(c.pos[0])};
         }));
  g->set("range", make_function("range", [](CallArgs& c, Interp&) {
           if (c.pos.empty() || c.pos.size() > 3 || !c.kw.empty())
             error("range() takes 1 to 3 integers");
           int64_t start = 0, stop, step = 1;
           if (c.pos.size() == 1) {
             stop = want_int(c.pos[0], "range()");
           } else {
             start = want_int(c.pos[0], "range()");
             stop = want_int(c.pos[1], "range()");
             if (c.pos.size() == 3) step = want_int(c.pos[2], "range()");
           }
           if (step == 0) error("range() step must not be zero");
           // The count first (unsigned: the ends may be far apart), so a huge range is refused
           // before it is built.
           uint64_t count = 0;
           if (step > 0 ? start < stop : start > stop) {
             const uint64_t span = step > 0
                                       ? static_cast<uint64_t>(stop) - static_cast<uint64_t>(start)
                                       : static_cast<uint64_t>(start) - static_cast<uint64_t>(stop);
             const uint64_t magnitude =
                 step > 0 ? static_cast<uint64_t>(step) : static_cast<uint64_t>(-(step + 1)) + 1;
             count = span / magnitude + (span % magnitude != 0 ? 1 : 0);
           }
           check_list_size(count > kMaxItems ? kMaxItems + 1 : static_cast<size_t>(count));
           std::vector<Value> out;
           out.reserve(static_cast<size_t>(count));
           for (uint64_t k = 0; k < count; ++k)
             out.push_back(Value::integer(start + static_cast<int64_t>(k) * step));
           return Value::make_list(std::move(out));
         }));
  g->set("namespace", make_function("namespace", [](CallArgs& c, Interp&) {
           std::vector<std::pair<Value, Value>> items;
           for (const Value& p : c.pos) {
             if (p.kind != Kind::dict) error("namespace() takes a mapping or keyword arguments");
             items.insert(items.end(), p.dict->items.begin(), p.dict->items.end());
           }
           for (auto& [k, v] : c.kw) items.emplace_back(Value::string(k), v);
           return Value::make_dict(std::move(items), true);
         }));
  g->set("dict", make_function("dict", [](CallArgs& c, Interp&) {
           std::vector<std::pair<Value, Value>> items;
           for (const Value& p : c.pos) {
             if (p.kind != Kind::dict) error("dict() takes a mapping or keyword arguments");
             items.insert(items.end(), p.dict->items.begin(), p.dict->items.end());
           }
           for (auto& [k, v] : c.kw) items.emplace_back(Value::string(k), v);
           return Value::make_dict(std::move(items));
         }));
  g->set("strftime_now", make_function("strftime_now", [](CallArgs& c, Interp&) {
           if (c.pos.size() != 1) error("strftime_now() takes one format string");
           const std::string f = want_string(c.pos[0], "strftime_now()");
           const std::time_t now = std::time(nullptr);
           std::tm tm{};
           localtime_r(&now, &tm);
           char buf[256];
           const size_t n = std::strftime(buf, sizeof(buf), f.c_str(), &tm);
           return Value::string(std::string(buf, n));
         }));
  return g;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, std::string name)
    : program_(std::make_unique<Program>()), name_(std::move(name)) {
  try {
    Parser parser(Lexer(std::string(source)).run());
    program_->body = parser.parse();
    program_->generation = parser.saw_generation();
    program_->source = std::string(source);
  } catch (const TemplateError& e) {
    fail("chat template {} line {}: {}; the template cannot be read", name_, e.line, e.message);
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

bool ChatTemplate::has_generation() const {
  return program_->generation;
}

bool ChatTemplate::mentions(std::string_view word) const {
  return program_->source.find(word) != std::string::npos;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context,
                                 std::vector<std::pair<uint64_t, uint64_t>>* generation) const {
  static const ScopeP builtins = globals();
  auto scope = std::make_shared<Scope>();
  scope->parent = builtins;
  Interp in;
  in.generation = generation;
  if (generation != nullptr) generation->clear();
  try {
    if (!context.is_object()) error("the context must be a JSON object");
    for (const auto& [k, v] : context.items()) scope->set(k, from_json(v));
    in.exec(program_->body, scope, in.rendered);
  } catch (const Raised& r) {
    fail("chat template {} line {}: the template refused the conversation: {}", name_, r.line,
         r.message);
  } catch (const TemplateError& e) {
    fail("chat template {} line {}: {}", name_, e.line, e.message);
  }
  return std::move(in.rendered);
}

}  // namespace strata
