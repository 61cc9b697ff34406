// hf_tokenizer_testing.h: a small Hugging Face tokenizer.json written by the tests, in GPT-2's
// byte-level layout, for the tokenizer, tokenize and generate suites (no file is shipped or
// downloaded).
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace strata::test {

// GPT-2's byte-to-character table written out independently of the code under test: the bytes
// outside '!'..'~', 0xA1..0xAC and 0xAE..0xFF take U+0100, U+0101, ... in byte order (so a
// space is 'Ġ', U+0120).
inline std::string byte_char(int b) {
  const auto kept = [](int k) {
    return (k >= 0x21 && k <= 0x7e) || (k >= 0xa1 && k <= 0xac) || k >= 0xae;
  };
  int cp = b;
  if (!kept(b)) {
    cp = 0x100;
    for (int k = 0; k < b; ++k)
      if (!kept(k)) ++cp;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
  return s;
}

// GPT-2's layout: ids 0..255 the byte characters, then "Ġt" (256), "he" (257) and "Ġthe" (258)
// by the merges "Ġ t", "h e", "Ġt he" in that rank order, and <|endoftext|> (259), an added
// special token.
inline nlohmann::json gpt2_like_tokenizer() {
  using json = nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["\xc4\xa0t"] = 256;  // "Ġt"
  vocab["he"] = 257;
  vocab["\xc4\xa0the"] = 258;
  return json{
      {"added_tokens",
       json::array({{{"id", 259}, {"content", "<|endoftext|>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}, {"trim_offsets", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", json::array({"\xc4\xa0 t", "h e", "\xc4\xa0t he"})}}}};
}

// The same with Llama 3's begin-of-text: <|begin_of_text|> (260), an added special token that a
// TemplateProcessing post-processor puts before every text.
inline nlohmann::json with_begin_of_text(nlohmann::json tokenizer) {
  using json = nlohmann::json;
  tokenizer["added_tokens"].push_back(
      {{"id", 260}, {"content", "<|begin_of_text|>"}, {"special", true}});
  tokenizer["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       json::array({tokenizer["post_processor"],
                    {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}}}},
                                             {{"Sequence", {{"id", "A"}}}}})},
                     {"special_tokens",
                      {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {260}}}}}}}})}};
  return tokenizer;
}

// Writes `tokenizer` as dir/tokenizer.json (creating dir).
inline void write_tokenizer_json(const std::filesystem::path& dir,
                                 const nlohmann::json& tokenizer) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tokenizer.dump(1);
}

}  // namespace strata::test
