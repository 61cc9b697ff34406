#include "core/bytes.h"

#include "core/error.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

namespace strata {

uint64_t parse_bytes(std::string_view text) {
  const std::string_view orig = text;
  auto trim = [](std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
  };
  text = trim(text);
  const char* hint = "; write a size such as 512MiB, 24GiB, 1.5TB or 4096";
  if (text.empty()) fail("byte size is empty{}", hint);
  if (text.front() == '-') fail("byte size '{}' is negative{}", orig, hint);
  // Number: digits, optional fraction, optional exponent.
  size_t i = 0;
  auto digits = [&] {
    size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    return i > start;
  };
  if (i < text.size() && text[i] == '+') ++i;
  bool any = digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    any = digits() || any;
  }
  if (!any) fail("byte size '{}' does not start with a number{}", orig, hint);
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E') && i + 1 < text.size() &&
      (std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '+')) {
    ++i;
    if (text[i] == '+') ++i;
    if (!digits()) fail("byte size '{}' has a malformed exponent{}", orig, hint);
  }
  std::string number(text.substr(0, i));
  const std::string_view unit = trim(text.substr(i));

  struct Unit {
    std::string_view name;
    double scale;
  };
  static constexpr Unit units[] = {{"", 1},
                                   {"B", 1},
                                   {"K", 1024.0},
                                   {"KiB", 1024.0},
                                   {"KB", 1e3},
                                   {"M", 1048576.0},
                                   {"MiB", 1048576.0},
                                   {"MB", 1e6},
                                   {"G", 1073741824.0},
                                   {"GiB", 1073741824.0},
                                   {"GB", 1e9},
                                   {"T", 1099511627776.0},
                                   {"TiB", 1099511627776.0},
                                   {"TB", 1e12},
                                   {"PiB", 1125899906842624.0},
                                   {"PB", 1e15}};
  auto iequal = [](std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (size_t k = 0; k < a.size(); ++k)
      if (std::tolower(static_cast<unsigned char>(a[k])) !=
          std::tolower(static_cast<unsigned char>(b[k])))
        return false;
    return true;
  };
  const Unit* found = nullptr;
  for (const Unit& u : units)
    if (unit == "B" ? u.name == "B" : (unit != "b" && iequal(unit, u.name))) found = &u;
  if (found == nullptr)
    fail(
        "byte size '{}' has unknown unit '{}'; use B, KiB, MiB, GiB, TiB (powers of 1024) "
        "or KB, MB, GB, TB (powers of 1000)",
        orig, unit);

  // Whole numbers without exponent are parsed exactly; the rest go through long double.
  const bool integral = number.find_first_of(".eE") == std::string::npos;
  if (integral && found->scale == 1) {
    uint64_t value = 0;
    const char* first = number.data() + (number[0] == '+' ? 1 : 0);
    auto [ptr, ec] = std::from_chars(first, number.data() + number.size(), value);
    if (ec != std::errc{}) fail("byte size '{}' does not fit in 64 bits", orig);
    (void)ptr;
    return value;
  }
  const long double value = std::stold(number) * static_cast<long double>(found->scale);
  if (!(value < 18446744073709551616.0L)) fail("byte size '{}' does not fit in 64 bits", orig);
  if (value != std::floor(value))
    fail("byte size '{}' is not a whole number of bytes ({} B); use a smaller unit", orig,
         static_cast<double>(value));
  return static_cast<uint64_t>(value);
}

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  long double v = static_cast<long double>(bytes);
  while (v >= 1024.0L && u < 6) {
    v /= 1024.0L;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  std::string s = fmt::format("{:.2f}", static_cast<double>(v));
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s + " " + names[u];
}

}  // namespace strata
