// hf_tokenizer.cpp: Hugging Face tokenizer.json files with a BPE model (Llama 3's byte-level
// BPE, GPT-2's, and the byte-fallback BPE of Llama 2's and Mistral's "fast" tokenizers), read
// and run the way the `tokenizers` library runs them. See tokenizer.h for what is supported.
//
// Encoding, in the library's order:
// 1. added tokens are cut out of the raw text first (leftmost, longest first), each becoming its
//    id; their lstrip/rstrip flags take the whitespace beside them along;
// 2. each piece between them goes through the normalizer (Prepend, Replace, the Unicode
//    normal forms NFC, NFD, NFKC and NFKD through ICU, Sequence);
// 3. then the pre-tokenizers (Split on a regex, ByteLevel, Metaspace, Digits, Sequence), which
//    cut it into words (ByteLevel also maps every byte to a printable character);
// 4. each word through the BPE model: its characters (absent ones become <0xHH> byte pieces
//    with byte_fallback, else the unk token) merged pair by pair, the lowest-ranked merge
//    first and, between equal ranks, the leftmost (the library's priority queue), or the word
//    whole when ignore_merges is set and the vocabulary has it.
// Regexes are PCRE2's with Unicode properties (\p{L}, \p{N}), compiled once and JIT-compiled
// where the platform allows; the library uses Oniguruma, which agrees on the patterns these
// tokenizers ship.
#include "core/error.h"
#include "model/file_io.h"
#include "train/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#include <unicode/utypes.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <functional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

namespace strata {

namespace {

using json = nlohmann::json;

// ---- UTF-8 ---------------------------------------------------------------------------------

// The length of the valid UTF-8 sequence at s[i], or 0 if there is none.
size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  uint32_t cp = 0;
  if ((c & 0xe0) == 0xc0) {
    n = 2;
    cp = c & 0x1fu;
  } else if ((c & 0xf0) == 0xe0) {
    n = 3;
    cp = c & 0x0fu;
  } else if ((c & 0xf8) == 0xf0) {
    n = 4;
    cp = c & 0x07u;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3fu);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

// Offset of the first byte that does not start a valid UTF-8 sequence, or npos.
size_t invalid_utf8_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

// Calls fn with each character of valid UTF-8 text, as its bytes, in order (none is held: a
// whole text may be one word).
template <typename Fn>
void for_each_utf8_char(std::string_view s, Fn&& fn) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::max<size_t>(1, utf8_sequence(s, i));
    fn(s.substr(i, n));
    i += n;
  }
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// ---- GPT-2's byte-level alphabet -------------------------------------------------------------

// Each byte as a printable character: the printable Latin-1 bytes ('!'..'~', '¡'..'¬',
// '®'..'ÿ') stand for themselves and the other 68 take U+0100 upward in byte order, so a space
// is 'Ġ' (U+0120) and a newline 'Ċ' (U+010A).
const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      append_utf8(t[b], printable ? b : extra++);
    }
    return t;
  }();
  return table;
}

// The byte a byte-level character stands for.
const std::unordered_map<std::string, unsigned char>& byte_level_bytes() {
  static const std::unordered_map<std::string, unsigned char> inverse = [] {
    std::unordered_map<std::string, unsigned char> m;
    for (int b = 0; b < 256; ++b)
      m.emplace(byte_level_chars()[size_t(b)], static_cast<unsigned char>(b));
    return m;
  }();
  return inverse;
}

std::string to_byte_level(std::string_view s) {
  std::string out;
  out.reserve(s.size() * 2);
  for (char c : s) out += byte_level_chars()[static_cast<unsigned char>(c)];
  return out;
}

// A token's text back to bytes; a token with any character outside the alphabet (an added
// token's text) stays as it is, as the library decodes it.
std::string from_byte_level(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::max<size_t>(1, utf8_sequence(s, i));
    const auto it = byte_level_bytes().find(std::string(s.substr(i, n)));
    if (it == byte_level_bytes().end()) return std::string(s);
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return out;
}

// ---- regexes ---------------------------------------------------------------------------------

// A PCRE2 pattern over UTF-8 with Unicode properties. Matching is thread-safe (match data per
// call).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(code, msg.data(), msg.size());
      fail(
          "{}: the regex {} does not compile ({} at offset {}); the file is damaged or uses a "
          "regex feature strata does not have",
          where, json(pattern).dump(), reinterpret_cast<const char*>(msg.data()), offset);
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional: interpreted where JIT is refused
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // Every non-overlapping match of valid UTF-8 text, [begin, end) byte offsets, left to right,
  // handed to `fn` as it is found. An empty match matches nothing: the scan moves on a character.
  template <typename Fn>
  void for_each_match(std::string_view s, Fn&& fn) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    try {
      size_t at = 0;
      while (at <= s.size()) {
        const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at,
                                   PCRE2_NO_UTF_CHECK, md, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0)
          fail("tokenizer regex: matching failed with PCRE2 error {} at byte {} of {}", rc, at,
               s.size());
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        const size_t b = ov[0], e = ov[1];
        if (e > b) {
          fn(b, e);
          at = e;
        } else {
          if (b >= s.size()) break;
          at = b + std::max<size_t>(1, utf8_sequence(s, b));
        }
      }
    } catch (...) {
      pcre2_match_data_free(md);
      throw;
    }
    pcre2_match_data_free(md);
  }

 private:
  pcre2_code* code_ = nullptr;
};

// A literal string as a PCRE2 pattern.
std::string escape_regex(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// `s` with every match of `re` replaced by `content`.
std::string replace_all(const Regex& re, std::string_view s, const std::string& content) {
  std::string out;
  size_t last = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    out.append(s.substr(last, b - last));
    out += content;
    last = e;
  });
  out.append(s.substr(last));
  return out;
}

// ---- reading the JSON ------------------------------------------------------------------------

// Where in the file a value sits, for errors: "tokenizer.json: /pre_tokenizer/pretokenizers/0".
struct At {
  const std::string& file;
  std::string pointer;
  At operator/(std::string_view key) const { return At{file, pointer + "/" + std::string(key)}; }
  At operator/(size_t index) const { return At{file, pointer + "/" + std::to_string(index)}; }
  std::string str() const { return file + ": " + (pointer.empty() ? "/" : pointer); }
};

const json& member(const json& obj, std::string_view key, const At& at) {
  if (!obj.is_object() || !obj.contains(key))
    fail("{}: no \"{}\"; the file is not a complete tokenizer.json", at.str(), key);
  return obj.at(std::string(key));
}

std::string string_at(const json& obj, std::string_view key, const At& at) {
  const json& v = member(obj, key, at);
  if (!v.is_string()) fail("{}: \"{}\" is {}, not a string", at.str(), key, v.dump());
  return v.get<std::string>();
}

bool bool_or(const json& obj, std::string_view key, bool fallback, const At& at) {
  if (!obj.contains(key) || obj.at(std::string(key)).is_null()) return fallback;
  const json& v = obj.at(std::string(key));
  if (!v.is_boolean()) fail("{}: \"{}\" is {}, not true or false", at.str(), key, v.dump());
  return v.get<bool>();
}

// A Split/Replace "pattern": {"String": s} (a literal) or {"Regex": r}.
std::string pattern_regex(const json& obj, const At& at) {
  const json& p = member(obj, "pattern", at);
  if (p.is_object() && p.contains("String") && p["String"].is_string())
    return escape_regex(p["String"].get<std::string>());
  if (p.is_object() && p.contains("Regex") && p["Regex"].is_string())
    return p["Regex"].get<std::string>();
  fail("{}: \"pattern\" is {}; expected {{\"String\": ...}} or {{\"Regex\": ...}}",
       (at / "pattern").str(), p.dump());
}

[[noreturn]] void unsupported(const std::string& what, const std::string& type, const At& at,
                              std::string_view supported) {
  fail(
      "{}: {} type \"{}\" is not supported (strata runs {}); use a tokenizer.json with those, "
      "or tokenize with Hugging Face's library into a token file",
      (at / "type").str(), what, type, supported);
}

// Metaspace's "prepend_scheme" (always, first, never), or the older "add_prefix_space" flag.
std::string prepend_scheme(const json& j, const At& at) {
  std::string scheme = "always";
  if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string())
    scheme = j["prepend_scheme"].get<std::string>();
  else if (j.contains("add_prefix_space"))
    scheme = bool_or(j, "add_prefix_space", true, at) ? "always" : "never";
  if (scheme != "always" && scheme != "first" && scheme != "never")
    fail("{}: \"prepend_scheme\" \"{}\" is not always, first or never", at.str(), scheme);
  return scheme;
}

// The steps of a Sequence: each element of its `key` array built by `make`.
template <typename Fn, typename Make>
std::vector<Fn> sequence_steps(const json& j, const char* key, const At& at, Make make) {
  const json& list = member(j, key, at);
  if (!list.is_array()) fail("{}: \"{}\" is {}, not an array", at.str(), key, list.type_name());
  std::vector<Fn> steps;
  for (size_t i = 0; i < list.size(); ++i) steps.push_back(make(list[i], at / key / i));
  return steps;
}

// ---- normalizers -----------------------------------------------------------------------------

using TextFn = std::function<std::string(std::string)>;

TextFn make_normalizer(const json& j, const At& at) {
  if (j.is_null()) return [](std::string s) { return s; };
  const std::string type = string_at(j, "type", at);
  if (type == "Sequence") {
    const auto steps = sequence_steps<TextFn>(j, "normalizers", at, make_normalizer);
    return [steps](std::string s) {
      for (const TextFn& f : steps) s = f(std::move(s));
      return s;
    };
  }
  if (type == "Prepend") {
    const std::string prepend = string_at(j, "prepend", at);
    return [prepend](std::string s) { return s.empty() ? s : prepend + s; };
  }
  if (type == "Replace") {
    auto re = std::make_shared<Regex>(pattern_regex(j, at), (at / "pattern").str());
    const std::string content = string_at(j, "content", at);
    return [re, content](std::string s) { return replace_all(*re, s, content); };
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    // ICU's normalizers, built once and shared by every thread (they are immutable).
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = type == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                                : type == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                                : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                                                 : icu::Normalizer2::getNFKDInstance(status);
    if (U_FAILURE(status) || n == nullptr)
      fail("{}: ICU has no {} normalizer ({}); check the libicu installation", at.str(), type,
           u_errorName(status));
    return [n, type](std::string s) {
      // ASCII is in every normal form: most text never leaves this check. Text reaching here
      // is valid UTF-8 (checked on encode), so the conversions below are exact.
      if (std::all_of(s.begin(), s.end(),
                      [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
        return s;
      UErrorCode st = U_ZERO_ERROR;
      const icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
      if (n->isNormalized(u, st) && U_SUCCESS(st)) return s;
      st = U_ZERO_ERROR;
      const icu::UnicodeString out = n->normalize(u, st);
      if (U_FAILURE(st)) fail("the {} normalizer failed ({})", type, u_errorName(st));
      std::string r;
      out.toUTF8String(r);
      return r;
    };
  }
  unsupported("normalizer", type, at, "Sequence, Prepend, Replace, NFC, NFD, NFKC and NFKD");
}

// ---- pre-tokenizers --------------------------------------------------------------------------

// The pre-tokenizers run as a pipeline, one word at a time: each step cuts the words it is given
// and hands its pieces on as soon as each is complete, and the last hands them to BPE. Only the
// word in flight is held, never a text's list of words, so a multi-megabyte document costs its
// text and its ids, not a hundred times its size in pieces.
using WordSink = std::function<void(std::string)>;
// Cuts `word` and hands the pieces to `sink` in order. first: the word is the first this step is
// given for a text that begins the input (not after an added token), which Metaspace's
// prepend_scheme "first" asks.
using SplitFn = std::function<void(std::string word, bool first, const WordSink& sink)>;

enum class Behavior : uint8_t {
  removed,
  isolated,
  merged_with_previous,
  merged_with_next,
  contiguous
};

Behavior behavior_of(const json& j, const At& at) {
  const std::string b = string_at(j, "behavior", at);
  if (b == "Removed") return Behavior::removed;
  if (b == "Isolated") return Behavior::isolated;
  if (b == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (b == "MergedWithNext") return Behavior::merged_with_next;
  if (b == "Contiguous") return Behavior::contiguous;
  fail(
      "{}: \"behavior\" \"{}\" is not one of Removed, Isolated, MergedWithPrevious, "
      "MergedWithNext, Contiguous",
      at.str(), b);
}

// Cuts `s` at the matches of `re` as the library's SplitDelimiterBehavior does, handing each
// non-empty piece to `sink`. The parts (the stretches between matches, and the matches, which
// are the delimiters unless `invert`) are decided one behind the scan, since MergedWithNext
// needs to know whether the next part is a delimiter; the last piece is held until no later
// part can join it.
void split_pieces(std::string_view s, const Regex& re, bool invert, Behavior behavior,
                  const WordSink& sink) {
  std::string piece;  // the piece being built, handed on once complete
  bool have = false, prev_delim = false, pending_next = false;
  const auto start = [&](std::string_view part) {
    if (have && !piece.empty()) sink(std::move(piece));
    piece.assign(part);
    have = true;
  };
  const auto decide = [&](std::string_view part, bool delim, const bool* next_delim) {
    switch (behavior) {
      case Behavior::removed:
        if (!delim) start(part);
        break;
      case Behavior::isolated:
        start(part);
        break;
      case Behavior::merged_with_previous:
        if (delim && have && !prev_delim)
          piece.append(part);
        else
          start(part);
        break;
      case Behavior::merged_with_next:  // a delimiter starts the next part, unless that is one
        if (pending_next)
          piece.append(part);
        else
          start(part);
        pending_next = delim && next_delim != nullptr && !*next_delim;
        break;
      case Behavior::contiguous:
        if (delim && prev_delim)
          piece.append(part);
        else
          start(part);
        break;
    }
    prev_delim = delim;
  };
  // The part before the one being found, decided once its successor is known.
  std::string_view held;
  bool held_delim = false, holding = false;
  const auto part = [&](size_t b, size_t e, bool delim) {
    if (holding) decide(held, held_delim, &delim);
    held = s.substr(b, e - b);
    held_delim = delim;
    holding = true;
  };
  size_t last = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    if (b > last) part(last, b, invert);
    part(b, e, !invert);
    last = e;
  });
  if (last < s.size()) part(last, s.size(), invert);
  if (holding) decide(held, held_delim, nullptr);
  if (have && !piece.empty()) sink(std::move(piece));
}

// GPT-2's own pattern, which ByteLevel splits with when use_regex is set.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

SplitFn make_pre_tokenizer(const json& j, const At& at) {
  if (j.is_null()) return [](std::string w, bool, const WordSink& sink) { sink(std::move(w)); };
  const std::string type = string_at(j, "type", at);
  if (type == "Sequence") {
    const auto steps = sequence_steps<SplitFn>(j, "pretokenizers", at, make_pre_tokenizer);
    // Step k's pieces go to step k + 1 as they come; whether a word is the first a step is given
    // is tracked per call.
    return [steps](std::string w, bool first, const WordSink& sink) {
      std::vector<char> given(steps.size(), 0);
      std::function<void(size_t, std::string)> feed = [&](size_t k, std::string word) {
        if (k == steps.size()) {
          sink(std::move(word));
          return;
        }
        const bool starts = first && !given[k];
        given[k] = 1;
        steps[k](std::move(word), starts,
                 [&](std::string piece) { feed(k + 1, std::move(piece)); });
      };
      feed(0, std::move(w));
    };
  }
  if (type == "Split") {
    auto re = std::make_shared<Regex>(pattern_regex(j, at), (at / "pattern").str());
    const Behavior behavior = behavior_of(j, at);
    const bool invert = bool_or(j, "invert", false, at);
    return [re, behavior, invert](std::string w, bool, const WordSink& sink) {
      split_pieces(w, *re, invert, behavior, sink);
    };
  }
  if (type == "ByteLevel") {
    const bool prefix_space = bool_or(j, "add_prefix_space", true, at);
    const bool use_regex = bool_or(j, "use_regex", true, at);
    std::shared_ptr<Regex> re;
    if (use_regex) re = std::make_shared<Regex>(kGpt2Pattern, at.str());
    return [re, prefix_space](std::string w, bool, const WordSink& sink) {
      // The library prefixes every word it is given.
      if (prefix_space && !w.empty() && w[0] != ' ') w.insert(0, " ");
      if (!re) {
        sink(to_byte_level(w));
        return;
      }
      split_pieces(w, *re, false, Behavior::isolated,
                   [&](std::string piece) { sink(to_byte_level(piece)); });
    };
  }
  if (type == "Metaspace") {
    const std::string rep = string_at(j, "replacement", at);
    const std::string scheme = prepend_scheme(j, at);
    const bool split = bool_or(j, "split", true, at);
    auto re = std::make_shared<Regex>(escape_regex(rep), at.str());
    return [rep, scheme, split, re](std::string word, bool first, const WordSink& sink) {
      std::string w;
      w.reserve(word.size());
      for (char c : word) {
        if (c == ' ')
          w += rep;
        else
          w.push_back(c);
      }
      std::string().swap(word);
      const bool prepend = scheme == "always" || (scheme == "first" && first);
      if (prepend && w.compare(0, rep.size(), rep) != 0) w.insert(0, rep);
      if (split)
        split_pieces(w, *re, false, Behavior::merged_with_next, sink);
      else
        sink(std::move(w));
    };
  }
  if (type == "Digits") {
    const bool individual = bool_or(j, "individual_digits", false, at);
    auto re = std::make_shared<Regex>(individual ? R"(\p{Nd})" : R"(\p{Nd}+)", at.str());
    return [re](std::string w, bool, const WordSink& sink) {
      split_pieces(w, *re, false, Behavior::isolated, sink);
    };
  }
  unsupported("pre_tokenizer", type, at, "Sequence, Split, ByteLevel, Metaspace and Digits");
}

// ---- decoders --------------------------------------------------------------------------------

using DecodeFn = std::function<void(std::vector<std::string>&)>;

// "<0xAB>" -> 0xAB, or -1.
int byte_piece(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (size_t k = 3; k < 5; ++k) {
    const char c = t[k];
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

DecodeFn make_decoder(const json& j, const At& at) {
  if (j.is_null()) return [](std::vector<std::string>&) {};
  const std::string type = string_at(j, "type", at);
  if (type == "Sequence") {
    const auto steps = sequence_steps<DecodeFn>(j, "decoders", at, make_decoder);
    return [steps](std::vector<std::string>& tokens) {
      for (const DecodeFn& f : steps) f(tokens);
    };
  }
  if (type == "ByteLevel")
    // Every token of the byte-level alphabet back to its bytes (one outside it, an added
    // token's text, as it is), joined. The library then replaces bytes that are not UTF-8 with
    // U+FFFD; strata keeps them, so a continuation cut mid-character is not altered.
    return [](std::vector<std::string>& tokens) {
      std::string all;
      for (const std::string& t : tokens) all += from_byte_level(t);
      tokens.assign(1, all);
    };
  if (type == "Replace") {
    auto re = std::make_shared<Regex>(pattern_regex(j, at), (at / "pattern").str());
    const std::string content = string_at(j, "content", at);
    return [re, content](std::vector<std::string>& tokens) {
      for (std::string& t : tokens) t = replace_all(*re, t, content);
    };
  }
  if (type == "ByteFallback")
    // Runs of <0xHH> pieces become their bytes; a run that is not valid UTF-8 becomes one
    // U+FFFD per byte, as the library writes it.
    return [](std::vector<std::string>& tokens) {
      std::vector<std::string> out;
      std::string bytes;
      size_t run = 0;
      auto flush = [&] {
        if (run == 0) return;
        if (invalid_utf8_at(bytes) == std::string_view::npos) {
          out.push_back(bytes);
        } else {
          for (size_t k = 0; k < run; ++k) out.emplace_back("\xef\xbf\xbd");
        }
        bytes.clear();
        run = 0;
      };
      for (std::string& t : tokens) {
        const int b = byte_piece(t);
        if (b >= 0) {
          bytes.push_back(static_cast<char>(b));
          ++run;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      tokens = std::move(out);
    };
  if (type == "Fuse")
    return [](std::vector<std::string>& tokens) {
      std::string all;
      for (const std::string& t : tokens) all += t;
      tokens.assign(1, all);
    };
  if (type == "Strip") {
    const std::string content = string_at(j, "content", at);
    const auto count = [&](const char* key) {
      const json& v = member(j, key, at);
      if (!v.is_number_unsigned()) fail("{}: \"{}\" is {}, not a count", at.str(), key, v.dump());
      return v.get<size_t>();
    };
    const size_t start = count("start"), stop = count("stop");
    return [content, start, stop](std::vector<std::string>& tokens) {
      if (content.empty()) return;
      for (std::string& t : tokens) {
        for (size_t k = 0; k < start && t.starts_with(content); ++k) t.erase(0, content.size());
        for (size_t k = 0; k < stop && t.ends_with(content); ++k)
          t.erase(t.size() - content.size());
      }
    };
  }
  if (type == "Metaspace") {
    const std::string rep = string_at(j, "replacement", at);
    const std::string scheme = prepend_scheme(j, at);
    return [rep, scheme](std::vector<std::string>& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string out;
        std::string_view t = tokens[i];
        for (size_t p = 0; p < t.size();) {
          if (!rep.empty() && t.substr(p, rep.size()) == rep) {
            out.push_back(' ');
            p += rep.size();
          } else {
            out.push_back(t[p++]);
          }
        }
        if (i == 0 && scheme != "never" && out.starts_with(' ')) out.erase(0, 1);
        tokens[i] = std::move(out);
      }
    };
  }
  unsupported("decoder", type, at,
              "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip and Metaspace");
}

// ---- the BPE model ---------------------------------------------------------------------------

class Bpe {
 public:
  Bpe(const json& model, const At& at) {
    const std::string type = string_at(model, "type", at);
    if (type != "BPE")
      fail(
          "{}: model type \"{}\" is not supported (strata runs BPE models: Llama 3, GPT-2, "
          "Llama 2 and Mistral's tokenizer.json); for a SentencePiece model pass its "
          "tokenizer.model",
          (at / "type").str(), type);
    if (model.contains("dropout") && !model["dropout"].is_null() &&
        !(model["dropout"].is_number() && model["dropout"].get<double>() == 0))
      fail(
          "{}: BPE dropout {} is a training-time option; inference runs without it (set it to "
          "null)",
          (at / "dropout").str(), model["dropout"].dump());
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && model[key] != "")
        fail("{}: {} \"{}\" is not supported (no Llama tokenizer uses it)", (at / key).str(), key,
             model[key].get<std::string>());
    byte_fallback_ = bool_or(model, "byte_fallback", false, at);
    fuse_unk_ = bool_or(model, "fuse_unk", false, at);
    ignore_merges_ = bool_or(model, "ignore_merges", false, at);

    const json& vocab = member(model, "vocab", at);
    if (!vocab.is_object()) fail("{}: \"vocab\" is not an object of piece: id", at.str());
    for (const auto& [piece, id] : vocab.items()) {
      if (!id.is_number_unsigned() || id.get<uint64_t>() >= (1ull << 31))
        fail("{}: piece {} has id {}, not an id", (at / "vocab").str(), json(piece).dump(),
             id.dump());
      vocab_.emplace(piece, id.get<uint32_t>());
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const std::string unk = model["unk_token"].get<std::string>();
      const auto it = vocab_.find(unk);
      if (it == vocab_.end())
        fail("{}: unk_token {} is not in the vocabulary", (at / "unk_token").str(),
             json(unk).dump());
      unk_ = it->second;
    }
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b) {
        const auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
        byte_ids_[size_t(b)] = it == vocab_.end() ? -1 : int64_t(it->second);
      }

    const json& merges = member(model, "merges", at);
    if (!merges.is_array()) fail("{}: \"merges\" is not an array", at.str());
    merges_.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& m = merges[r];
      std::string a, b;
      if (m.is_string()) {  // "a b"
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail("{}: merge {} is not two pieces separated by one space", (at / "merges" / r).str(),
               m.dump());
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        fail("{}: merge {} is neither \"a b\" nor [\"a\", \"b\"]", (at / "merges" / r).str(),
             m.dump());
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
        fail("{}: merge {} names a piece that is not in the vocabulary ({})",
             (at / "merges" / r).str(), m.dump(),
             json(ia == vocab_.end()   ? a
                  : ib == vocab_.end() ? b
                                       : a + b)
                 .dump());
      merges_.emplace(key(ia->second, ib->second), Merge{static_cast<uint32_t>(r), iab->second});
    }
  }

  const std::unordered_map<std::string, uint32_t>& vocab() const { return vocab_; }

  // One word (normalized and pre-tokenized) to its ids.
  void encode_word(std::string_view word, std::vector<uint32_t>& out) const {
    if (ignore_merges_) {
      const auto it = vocab_.find(std::string(word));
      if (it != vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    struct Sym {
      uint32_t id;
      int prev, next;
    };
    std::vector<Sym> syms;
    bool last_unk = false;
    for_each_utf8_char(word, [&](std::string_view ch) {
      const auto it = vocab_.find(std::string(ch));
      if (it != vocab_.end()) {
        syms.push_back({it->second, 0, 0});
        last_unk = false;
        return;
      }
      if (byte_fallback_ && std::all_of(ch.begin(), ch.end(), [&](char c) {
            return byte_ids_[static_cast<unsigned char>(c)] >= 0;
          })) {
        for (char c : ch)
          syms.push_back({static_cast<uint32_t>(byte_ids_[static_cast<unsigned char>(c)]), 0, 0});
        last_unk = false;
        return;
      }
      if (!unk_.has_value())
        fail(
            "tokenizer: the character {} (bytes {}) is not in the vocabulary, and the tokenizer "
            "has neither byte_fallback nor an unk_token; the text needs another tokenizer",
            json(std::string(ch)).dump(), hex_bytes(ch));
      if (!(fuse_unk_ && last_unk)) syms.push_back({*unk_, 0, 0});
      last_unk = true;
    });
    const int n = static_cast<int>(syms.size());
    for (int i = 0; i < n; ++i) {
      syms[size_t(i)].prev = i - 1;
      syms[size_t(i)].next = i + 1 < n ? i + 1 : -1;
    }
    // (rank, left position): the lowest rank first, then the leftmost. Eight bytes each, as a
    // whole text can be one word: a candidate is checked when it comes up instead of carrying
    // its pair, since a rank names one pair and the pair at `pos` then is the one it was
    // unless either symbol has merged since.
    struct Cand {
      uint32_t rank;
      int pos;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    const auto merge_at = [&](int pos) -> const Merge* {
      if (pos < 0) return nullptr;
      const int nx = syms[size_t(pos)].next;
      if (nx < 0) return nullptr;
      const auto it = merges_.find(key(syms[size_t(pos)].id, syms[size_t(nx)].id));
      return it == merges_.end() ? nullptr : &it->second;
    };
    std::vector<Cand> initial;
    for (int i = 0; i < n; ++i)
      if (const Merge* m = merge_at(i)) initial.push_back(Cand{m->rank, i});
    std::priority_queue<Cand, std::vector<Cand>, std::greater<>> queue(std::greater<>{},
                                                                       std::move(initial));
    std::vector<bool> dead(size_t(n), false);
    while (!queue.empty()) {
      const Cand c = queue.top();
      queue.pop();
      if (dead[size_t(c.pos)]) continue;
      const Merge* m = merge_at(c.pos);
      if (m == nullptr || m->rank != c.rank) continue;  // stale: a symbol of it merged since
      Sym& s = syms[size_t(c.pos)];
      const int gone = s.next;
      dead[size_t(gone)] = true;
      s.id = m->id;
      s.next = syms[size_t(gone)].next;
      if (s.next >= 0) syms[size_t(s.next)].prev = c.pos;
      for (int p : {s.prev, c.pos})
        if (const Merge* again = merge_at(p)) queue.push(Cand{again->rank, p});
    }
    for (int i = 0; i < n; ++i)
      if (!dead[size_t(i)]) out.push_back(syms[size_t(i)].id);
  }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t id;
  };
  static uint64_t key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }
  static std::string hex_bytes(std::string_view s) {
    std::string out;
    for (char c : s)
      out += fmt::format("{}{:02x}", out.empty() ? "" : " ", static_cast<unsigned char>(c));
    return out;
  }

  std::unordered_map<std::string, uint32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<uint32_t> unk_;
  std::array<int64_t, 256> byte_ids_{};
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
};

// ---- added tokens ----------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false, lstrip = false, rstrip = false;
};

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::filesystem::path& file) : path_(file.string()) {
    try {
      load(file);
    } catch (const json::exception& e) {  // a value of a type the checks above did not expect
      fail("{}: {}; the file is not a tokenizer.json strata can read", path_, e.what());
    }
  }

  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> eos_id() const override { return eos_; }
  std::vector<uint32_t> prefix_ids() const override { return prefix_; }
  std::vector<uint32_t> suffix_ids() const override { return suffix_; }
  std::string name() const override { return path_; }
  std::optional<std::string> special_piece(uint32_t id) const override {
    if (!special_ids_.contains(id)) return std::nullopt;
    return pieces_.at(id);
  }

 private:
  void load(const std::filesystem::path& file) {
    const json root = read_json_file(file, "tokenizer.json");
    const At at{path_, ""};
    if (!root.is_object()) fail("{}: not a JSON object; pass a Hugging Face tokenizer.json", path_);
    bpe_ = std::make_unique<Bpe>(member(root, "model", at), at / "model");
    normalize_ = make_normalizer(root.value("normalizer", json()), at / "normalizer");
    pre_tokenize_ = make_pre_tokenizer(root.value("pre_tokenizer", json()), at / "pre_tokenizer");
    decode_ = make_decoder(root.value("decoder", json()), at / "decoder");

    int64_t top = -1;
    for (const auto& [piece, id] : bpe_->vocab()) {
      top = std::max<int64_t>(top, id);
      pieces_[id] = piece;
    }
    if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
      const json& list = root["added_tokens"];
      if (!list.is_array())
        fail("{}: \"added_tokens\" is not an array", (at / "added_tokens").str());
      for (size_t i = 0; i < list.size(); ++i) {
        const At a = at / "added_tokens" / i;
        const json& t = list[i];
        AddedToken tok;
        tok.content = string_at(t, "content", a);
        const json& id = member(t, "id", a);
        if (!id.is_number_unsigned() || id.get<uint64_t>() >= (1ull << 31))
          fail("{}: \"id\" is {}, not an id", a.str(), id.dump());
        tok.id = id.get<uint32_t>();
        tok.special = bool_or(t, "special", false, a);
        tok.lstrip = bool_or(t, "lstrip", false, a);
        tok.rstrip = bool_or(t, "rstrip", false, a);
        if (bool_or(t, "single_word", false, a))
          fail("{}: \"single_word\" true is not supported; added tokens must match anywhere",
               a.str());
        if (tok.content.empty()) fail("{}: \"content\" is empty", a.str());
        top = std::max<int64_t>(top, tok.id);
        pieces_[tok.id] = tok.content;
        if (tok.special) special_ids_.insert(tok.id);
        added_.push_back(std::move(tok));
      }
    }
    vocab_size_ = top + 1;
    // Longest first, so the leftmost match is also the longest at its position.
    std::stable_sort(added_.begin(), added_.end(), [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() > b.content.size();
    });
    for (size_t i = 0; i < added_.size(); ++i)
      by_first_byte_[static_cast<unsigned char>(added_[i].content[0])].push_back(i);

    read_post_processor(root.value("post_processor", json()), at / "post_processor");
    read_config(file.parent_path() / "tokenizer_config.json");
  }

  std::optional<uint32_t> id_of(const std::string& piece) const {
    for (const AddedToken& t : added_)
      if (t.content == piece) return t.id;
    const auto it = bpe_->vocab().find(piece);
    if (it != bpe_->vocab().end()) return it->second;
    return std::nullopt;
  }

  // TemplateProcessing's "single" template: the special tokens before the text ($A) and after.
  void read_post_processor(const json& j, const At& at) {
    if (j.is_null()) return;
    const std::string type = string_at(j, "type", at);
    if (type == "Sequence") {
      const json& list = member(j, "processors", at);
      for (size_t i = 0; i < list.size(); ++i) read_post_processor(list[i], at / "processors" / i);
      return;
    }
    if (type == "ByteLevel") return;  // offsets only
    if (type != "TemplateProcessing")
      unsupported("post_processor", type, at, "TemplateProcessing, ByteLevel and Sequence");
    const json& single = member(j, "single", at);
    const json& specials = j.value("special_tokens", json::object());
    bool after = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      const At a = at / "single" / i;
      if (item.contains("Sequence")) {
        after = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
        fail("{}: {} is neither a Sequence nor a SpecialToken", a.str(), item.dump());
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      std::vector<uint32_t> ids;
      if (specials.contains(name) && specials[name].contains("ids")) {
        for (const json& id : specials[name]["ids"]) ids.push_back(id.get<uint32_t>());
      } else if (const auto id = id_of(name)) {
        ids.push_back(*id);
      } else {
        fail("{}: special token {} is in neither special_tokens nor the vocabulary", a.str(),
             json(name).dump());
      }
      auto& dst = after ? suffix_ : prefix_;
      dst.insert(dst.end(), ids.begin(), ids.end());
    }
  }

  // End-of-text: tokenizer_config.json's eos_token beside the file, else a piece with one of the
  // usual names.
  void read_config(const std::filesystem::path& config_path) {
    std::optional<std::string> eos;
    std::error_code ec;
    if (std::filesystem::exists(config_path, ec)) {
      const json config = read_json_file(config_path, "tokenizer config");
      eos = tokenizer_config_token(config, "eos_token");
      if (eos.has_value()) {
        eos_ = id_of(*eos);
        if (!eos_.has_value())
          fail("{}: eos_token {} is not a token of {}", config_path.string(), json(*eos).dump(),
               path_);
        return;
      }
    }
    for (const char* name : {"<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"})
      if ((eos_ = id_of(name))) return;
  }

  std::string path_;
  std::unique_ptr<Bpe> bpe_;
  TextFn normalize_;
  SplitFn pre_tokenize_;
  DecodeFn decode_;
  std::vector<AddedToken> added_;
  std::array<std::vector<size_t>, 256> by_first_byte_;
  std::unordered_map<uint32_t, std::string> pieces_;
  std::unordered_set<uint32_t> special_ids_;
  int64_t vocab_size_ = 0;
  std::optional<uint32_t> eos_;
  std::vector<uint32_t> prefix_, suffix_;
};

std::vector<uint32_t> HfTokenizer::encode(std::string_view text) const {
  const size_t bad = invalid_utf8_at(text);
  if (bad != std::string_view::npos)
    fail(
        "tokenizer {}: the text is not valid UTF-8 at byte {} of {} (byte 0x{:02x}); convert it "
        "to UTF-8 first",
        path_, bad, text.size(), static_cast<unsigned char>(text[bad]));
  std::vector<uint32_t> ids;
  // Words seen in this text and their ids; bounded, as a long text's distinct words are not.
  constexpr size_t kCachedWords = 1 << 16;
  std::unordered_map<std::string, std::vector<uint32_t>> cache;
  const WordSink to_ids = [&](std::string w) {
    if (w.empty()) return;
    auto it = cache.find(w);
    if (it == cache.end()) {
      if (cache.size() >= kCachedWords) cache.clear();
      std::vector<uint32_t> word_ids;
      bpe_->encode_word(w, word_ids);
      it = cache.emplace(std::move(w), std::move(word_ids)).first;
    }
    ids.insert(ids.end(), it->second.begin(), it->second.end());
  };
  size_t begin = 0;
  auto run_text = [&](std::string_view piece, bool text_start) {
    if (!piece.empty()) pre_tokenize_(normalize_(std::string(piece)), text_start, to_ids);
  };
  for (size_t i = 0; i < text.size();) {
    const AddedToken* hit = nullptr;
    for (size_t k : by_first_byte_[static_cast<unsigned char>(text[i])])
      if (text.substr(i, added_[k].content.size()) == added_[k].content) {
        hit = &added_[k];
        break;
      }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->lstrip)
      while (b > begin && is_ascii_space(text[b - 1])) --b;
    if (hit->rstrip)
      while (e < text.size() && is_ascii_space(text[e])) ++e;
    run_text(text.substr(begin, b - begin), begin == 0);
    ids.push_back(hit->id);
    begin = i = e;
  }
  run_text(text.substr(begin), begin == 0);
  return ids;
}

std::string HfTokenizer::decode(std::span<const uint32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto it = pieces_.find(ids[i]);
    if (it == pieces_.end())
      fail("tokenizer {}: id {} at position {} is {}; the ids come from another tokenizer", path_,
           ids[i], i,
           ids[i] >= vocab_size_ ? fmt::format("outside its vocabulary of {}", vocab_size_)
                                 : std::string("not assigned to any piece"));
    if (special_ids_.contains(ids[i])) continue;  // as skip_special_tokens=True
    tokens.push_back(it->second);
  }
  decode_(tokens);
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

}  // namespace

std::optional<std::string> tokenizer_config_token(const nlohmann::json& config,
                                                  std::string_view key) {
  if (!config.is_object() || !config.contains(key)) return std::nullopt;
  const nlohmann::json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file) {
  return std::make_unique<HfTokenizer>(file);
}

}  // namespace strata
