// tokenize.cpp: `strata tokenize`, text or JSONL documents into an llm.c token file that
// `strata eval` and `strata train` read.
//
// Documents, the tokenizer's prefix (a Hugging Face tokenizer's begin-of-text) before each and
// the end-of-text id between them are train/tokenizer.h's rules; the output is
// uint16 tokens (magic 20240520) while every id fits, uint32 (magic 20240801) for a vocabulary
// above 65,536, written atomically (a temporary file renamed over the output).
#include "commands.h"
#include "core/error.h"
#include "model/tokens.h"
#include "train/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <memory>

namespace strata::cli {

namespace {

struct TokenizeArgs {
  std::string tokenizer = "byte";
  std::vector<std::string> inputs;
  std::string output;
  bool append_eos = false;
};

int run_tokenize(const TokenizeArgs& a) {
  const std::unique_ptr<Tokenizer> tokenizer = open_tokenizer(a.tokenizer);
  std::vector<std::string> documents;
  uint64_t bytes = 0;
  for (const std::string& input : a.inputs) {
    std::vector<std::string> docs = read_documents(input);
    for (std::string& d : docs) {
      bytes += d.size();
      documents.push_back(std::move(d));
    }
  }
  if (documents.empty())
    fail("tokenize: no document in {}; the input is empty (or every .jsonl \"text\" is empty)",
         fmt::join(a.inputs, ", "));
  const std::vector<uint32_t> tokens = tokenize_documents(*tokenizer, documents, a.append_eos);
  const TokenWidth width = tokenizer->vocab_size() > 65536 ? TokenWidth::u32 : TokenWidth::u16;
  write_llmc_tokens(a.output, tokens, width);
  fmt::print(
      "tokenized {} documents ({} bytes) into {} tokens ({} tokenizer, vocab {}, {}) -> {}\n",
      documents.size(), bytes, tokens.size(), tokenizer->name(), tokenizer->vocab_size(),
      width == TokenWidth::u16 ? "uint16" : "uint32", a.output);
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Text (.txt: one document, or documents separated by '%' lines) or JSONL (a \"text\" per "
      "line) into an llm.c token file");
  auto a = std::make_shared<TokenizeArgs>();
  cmd->add_option("--tokenizer", a->tokenizer,
                  "byte (ids 0-255 the bytes, 256 end-of-text), a Hugging Face tokenizer.json (or "
                  "a model directory holding one; its begin-of-text starts each document), or a "
                  "SentencePiece .model file");
  cmd->add_option("--input", a->inputs, "input file(s), .txt or .jsonl, read in order")->required();
  cmd->add_option("--output", a->output, "the token file to write")->required();
  cmd->add_flag("--append-eos", a->append_eos,
                "also write end-of-text after the last document (it always separates documents)");
  return {cmd, [a] { return run_tokenize(*a); }};
}

}  // namespace strata::cli
