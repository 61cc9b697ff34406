// rewrite.cpp (CUDA emulator): turns a .cu file into C++ that g++ compiles against the
// emulator's headers. Three rewrites, nothing else changes:
//   NAME<<<CONFIG>>>(ARGS)          ->  ::cuda_emu::launch("NAME", NAME,
//                                         ::cuda_emu::LaunchConfig(CONFIG), ARGS)
//   extern __shared__ TYPE NAME[];  ->  TYPE* const NAME =
//                                         static_cast<TYPE*>(::cuda_emu::dynamic_shared_memory());
//   __shared__ TYPE NAME[N];        ->  auto& NAME = ::cuda_emu::block_shared<TYPE[N]>(&TAG);
// Comments, string and character literals are left alone. Each rewrite keeps the number of
// lines, and the output starts with cuda_runtime.h (which nvcc includes implicitly) and a
// #line naming the .cu file, so compiler messages and __FILE__ (CUDA_CHECK's) point into the
// original source.
//
// Usage: cuda_emu_rewrite IN.cu OUT.cpp
#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace {

[[noreturn]] void die(const std::string& file, const std::string& what) {
  std::fprintf(stderr, "cuda_emu_rewrite: %s: %s\n", file.c_str(), what.c_str());
  std::exit(1);
}

bool ident_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ':';
}

size_t count_lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// The end of the bracketed group that opens at `open` (text[open] is `(`), or npos.
size_t close_paren(const std::string& text, size_t open) {
  int depth = 0;
  for (size_t i = open; i < text.size(); ++i) {
    if (text[i] == '(') ++depth;
    if (text[i] == ')' && --depth == 0) return i;
  }
  return std::string::npos;
}

// Whether text[at] is code: not inside a comment (// or /* */), a string literal or a
// character literal, which the rewrites leave alone. A ' right after a hex digit is a digit
// separator (1'000, 0xff'ff), not a character literal (prefixes L, u and U are not hex).
bool is_code(const std::string& text, size_t at) {
  enum class In { code, line_comment, block_comment, string, character } in = In::code;
  for (size_t i = 0; i < at && i < text.size(); ++i) {
    const char c = text[i];
    const char next = i + 1 < text.size() ? text[i + 1] : '\0';
    switch (in) {
      case In::code:
        if (c == '/' && next == '/') {
          in = In::line_comment;
          ++i;
        } else if (c == '/' && next == '*') {
          in = In::block_comment;
          ++i;
        } else if (c == '"') {
          in = In::string;
        } else if (c == '\'' &&
                   !(i > 0 && std::isxdigit(static_cast<unsigned char>(text[i - 1])))) {
          in = In::character;
        }
        break;
      case In::line_comment:
        if (c == '\n') in = In::code;
        break;
      case In::block_comment:
        if (c == '*' && next == '/') {
          in = In::code;
          ++i;
        }
        break;
      case In::string:
      case In::character:
        if (c == '\\')
          ++i;  // an escape: the next character is the literal's
        else if (c == (in == In::string ? '"' : '\'') || c == '\n')
          in = In::code;  // closed (or unterminated at the line's end, which cannot compile)
        break;
    }
  }
  return in == In::code;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\n");
  const size_t e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::string rewrite_launches(const std::string& file, std::string text) {
  for (size_t at = text.find("<<<"); at != std::string::npos; at = text.find("<<<", at)) {
    if (!is_code(text, at)) {
      at += 3;
      continue;
    }
    // Back over whitespace, template arguments <...> and the (qualified) name.
    size_t start = at;
    while (start > 0 && std::isspace(static_cast<unsigned char>(text[start - 1]))) --start;
    if (start > 0 && text[start - 1] == '>') {
      int depth = 0;
      do {
        --start;
        if (text[start] == '>') ++depth;
        if (text[start] == '<') --depth;
      } while (start > 0 && depth > 0);
    }
    while (start > 0 && ident_char(text[start - 1])) --start;
    const std::string name = trim(text.substr(start, at - start));
    if (name.empty()) die(file, "a <<< with no kernel name before it");
    // The configuration ends at the first >>> outside parentheses.
    size_t end = at + 3;
    int depth = 0;
    for (; end + 2 < text.size(); ++end) {
      if (text[end] == '(') ++depth;
      if (text[end] == ')') --depth;
      if (depth == 0 && text.compare(end, 3, ">>>") == 0) break;
    }
    if (end + 2 >= text.size()) die(file, "no >>> closes the launch of " + name);
    const std::string config = text.substr(at + 3, end - at - 3);
    size_t open = end + 3;
    while (open < text.size() && std::isspace(static_cast<unsigned char>(text[open]))) ++open;
    if (open >= text.size() || text[open] != '(') die(file, "no argument list after " + name);
    const size_t close = close_paren(text, open);
    if (close == std::string::npos) die(file, "unbalanced arguments of " + name);
    const std::string args = text.substr(open + 1, close - open - 1);
    std::string out = "::cuda_emu::launch(\"" + name + "\", " + name +
                      ", ::cuda_emu::LaunchConfig(" + config + ")" +
                      (trim(args).empty() ? std::string() : ", " + args) + ")";
    const std::string original = text.substr(start, close + 1 - start);
    out.append(count_lines(original) - count_lines(out), '\n');
    text.replace(start, close + 1 - start, out);
    at = start + out.size();
  }
  return text;
}

std::string rewrite_dynamic_shared(const std::string& file, std::string text) {
  const std::string key = "extern __shared__";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at)) {
    if (!is_code(text, at)) {
      at += key.size();
      continue;
    }
    const size_t semi = text.find(';', at);
    if (semi == std::string::npos) die(file, "extern __shared__ without a ;");
    std::string decl = trim(text.substr(at + key.size(), semi - at - key.size()));
    if (decl.size() < 2 || decl.compare(decl.size() - 2, 2, "[]") != 0)
      die(file, "extern __shared__ " + decl + ": expected an unsized array");
    decl = trim(decl.substr(0, decl.size() - 2));
    if (const size_t align = decl.find("__align__("); align != std::string::npos) {
      const size_t close = close_paren(decl, align + 9);
      decl.erase(align, close + 1 - align);
    }
    size_t name_at = decl.size();
    while (name_at > 0 && ident_char(decl[name_at - 1])) --name_at;
    const std::string name = decl.substr(name_at), type = trim(decl.substr(0, name_at));
    if (name.empty() || type.empty()) die(file, "extern __shared__ " + decl + ": no type or name");
    const std::string out = type + "* const " + name + " = static_cast<" + type +
                            "*>(::cuda_emu::dynamic_shared_memory());";
    text.replace(at, semi + 1 - at, out);
    at += out.size();
  }
  return text;
}

// `__shared__ T name[N];` (in a kernel or device function) becomes a reference into the running
// block's static shared memory, poisoned like the dynamic kind at every block (a static
// thread_local, as the plain macro makes it, would keep the previous block's values).
std::string rewrite_static_shared(const std::string& file, std::string text) {
  const std::string key = "__shared__";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at)) {
    if (!is_code(text, at)) {
      at += key.size();
      continue;
    }
    const size_t semi = text.find(';', at);
    if (semi == std::string::npos) die(file, "__shared__ without a ;");
    const std::string decl = trim(text.substr(at + key.size(), semi - at - key.size()));
    const size_t bracket = decl.find('[');
    const std::string head = trim(decl.substr(0, bracket));
    const std::string dims = bracket == std::string::npos ? std::string() : decl.substr(bracket);
    size_t name_at = head.size();
    while (name_at > 0 && ident_char(head[name_at - 1])) --name_at;
    const std::string name = head.substr(name_at), type = trim(head.substr(0, name_at));
    if (name.empty() || type.empty() || decl.find('=') != std::string::npos)
      die(file, "__shared__ " + decl + ": expected `__shared__ TYPE NAME[DIMS];`");
    const std::string tag = "cuda_emu_tag_" + name;
    const std::string out = "static thread_local const char " + tag + " = 0; auto& " + name +
                            " = ::cuda_emu::block_shared<" + type + dims + ">(&" + tag + ");";
    text.replace(at, semi + 1 - at, out);
    at += out.size();
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: cuda_emu_rewrite IN.cu OUT.cpp\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) die(argv[1], "cannot read it");
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string text = rewrite_static_shared(
      argv[1], rewrite_dynamic_shared(argv[1], rewrite_launches(argv[1], buffer.str())));
  const std::string out_path = argv[2], tmp = out_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    // nvcc includes cuda_runtime.h in every .cu file before its first line.
    out << "#include <cuda_runtime.h>\n#line 1 \"" << argv[1] << "\"\n" << text;
    if (!out) die(tmp, "cannot write it");
  }
  if (std::rename(tmp.c_str(), out_path.c_str()) != 0) die(out_path, "cannot rename into place");
  return 0;
}
