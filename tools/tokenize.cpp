// tokenize.cpp: `strata tokenize`, text or JSONL documents into an llm.c token file that
// `strata eval` and `strata train` read.
//
// Documents, the tokenizer's prefix (a Hugging Face tokenizer's begin-of-text) before each and
// the end-of-text id between them are train/tokenizer.h's rules; the output is
// uint16 tokens (magic 20240520) while every id fits, uint32 (magic 20240801) for a vocabulary
// above 65,536, written atomically (a temporary file renamed over the output), or as shards of
// --shard-tokens tokens. The text is read, encoded and written a batch of documents at a time
// (train/tokenizer.h, tokenize_files), so a corpus larger than RAM can be tokenized. Prompts
// (prompt/completion rows, or plain documents cut at --response-template) and conversations
// (rendered by the model's chat template, only the assistant's replies counted unless
// --chat-loss all) get a loss mask beside each token file (model/tokens.h), which train and
// eval read.
#include "commands.h"
#include "core/error.h"
#include "core/log.h"
#include "model/tokens.h"
#include "train/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>

namespace strata::cli {

namespace {

struct TokenizeArgs {
  std::string tokenizer = "byte";
  std::vector<std::string> inputs;
  std::string output;
  bool append_eos = false;
  uint64_t shard_tokens = 0;
  std::string response_template;
  std::string chat_template;
  std::string chat_loss = "replies";
  int64_t show = 0;
};

// --show N: the first N tokens of the output as the model will see them, read back from the
// token file and its mask: decoded, special tokens written out (end-of-text among them, so the
// documents show), and the text that does not count as a target between ⟦ and ⟧, so a user can
// check a chat template's replies before training.
void show_tokens(const Tokenizer& tokenizer, const TokenizedFiles& r, int64_t count) {
  const TokenFile tokens = TokenFile::open(r.files.front(), std::optional<TokenWidth>{});
  const std::optional<LossMask> mask = LossMask::open_beside(tokens);
  const int64_t n = std::min(count, tokens.size());
  std::string text;
  std::vector<uint32_t> run;  // ordinary tokens, decoded together
  bool counted = true;
  const auto flush_run = [&] {
    text += tokenizer.decode(run);
    run.clear();
  };
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t id = tokens.get(i);
    const bool counts = !mask || mask->counts(i);
    if (counts != counted) {
      flush_run();
      text += counts ? "⟧" : "⟦";
      counted = counts;
    }
    if (const std::optional<std::string> special = tokenizer.special_piece(id)) {
      flush_run();
      text += *special;
    } else {
      run.push_back(id);
    }
  }
  flush_run();
  if (!counted) text += "⟧";
  fmt::print("the first {} tokens of {} (⟦...⟧: not trained on):\n{}\n", n,
             r.files.front().string(), text);
}

int run_tokenize(const TokenizeArgs& a) {
  const std::unique_ptr<Tokenizer> tokenizer = open_tokenizer(a.tokenizer);
  const std::vector<std::filesystem::path> inputs(a.inputs.begin(), a.inputs.end());
  // The chat template is read now, but its absence or a fault in it matters only to
  // conversations: plain documents tokenize without it.
  ChatOptions chat;
  chat.all_tokens = a.chat_loss == "all";
  try {
    chat.format = open_chat_format(*tokenizer, a.tokenizer, a.chat_template);
  } catch (const Error& e) {
    if (!a.chat_template.empty()) throw;  // asked for by name: it must be readable
    chat.unavailable = e.what();
  }
  const TokenizedFiles r = tokenize_files(*tokenizer, inputs, a.output,
                                          {.shard_tokens = a.shard_tokens,
                                           .append_eos = a.append_eos,
                                           .response_template = a.response_template,
                                           .chat = &chat});
  const std::string where =
      r.files.size() == 1
          ? r.files.front().string()
          : fmt::format("{} shards, {} ... {}", r.files.size(), r.files.front().string(),
                        r.files.back().filename().string());
  fmt::print(
      "tokenized {} documents ({} bytes) into {} tokens ({} tokenizer, vocab {}, {}) -> {}\n",
      r.documents, r.bytes, r.tokens, tokenizer->name(), tokenizer->vocab_size(),
      r.width == TokenWidth::u16 ? "uint16" : "uint32", where);
  if (r.untemplated > 0)
    fmt::print(
        "  {} document(s) without the response template {} left out (they would train on "
        "nothing)\n",
        r.untemplated, nlohmann::json(a.response_template).dump());
  if (r.conversations > 0)
    fmt::print("  {} conversation(s) rendered with the chat template {}{}\n", r.conversations,
               chat.format->source,
               chat.all_tokens ? "; every token counts (--chat-loss all)"
                               : "; only the assistant's replies count");
  if (!r.masks.empty())
    fmt::print(
        "  {} of the documents have prompts (or turns) that are not trained on: {} of the {} "
        "tokens count as targets; loss masks beside the token files ({}{})\n",
        r.prompted, r.counted, r.tokens, r.masks.front().filename().string(),
        r.masks.size() > 1 ? ", ..." : "");
  if (r.straddling > 0)
    fmt::print(
        "  {} prompt/completion row(s) encode with a token across the prompt's end (the prompt "
        "alone encodes otherwise than the start of the two together); as TRL does, the prompt's "
        "own count of tokens is not trained on; end the prompt at a word or a special token to "
        "keep the boundary exact\n",
        r.straddling);
  // Every output has its document index; where it has masks too, training reads it by default.
  if (!r.masks.empty() && !r.indexes.empty())
    fmt::print(
        "  where each document starts: {}{}; strata train and eval read one document per "
        "sequence (--packing auto: none)\n",
        r.indexes.front().filename().string(), r.indexes.size() > 1 ? ", ..." : "");
  if (a.show > 0) show_tokens(*tokenizer, r, a.show);
  for (const std::filesystem::path& m : r.removed)
    fmt::print("  removed {}, an earlier run's loss mask: this output has no prompts\n",
               m.string());
  // A shard past the last one, left by an earlier run with more of them, is not this output.
  const std::filesystem::path next = llmc_shard_path(a.output, r.files.size());
  if (a.shard_tokens > 0 && std::filesystem::exists(next))
    log_warn("tokenize: {} is left from an earlier run; it is not part of this output",
             next.string());
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Text (.txt: one document, or documents separated by '%' lines) or JSONL (a \"text\", a "
      "\"prompt\" and a \"completion\", or a conversation in \"messages\", per line) into an "
      "llm.c token file, and for prompts a loss mask beside it (FILE.mask) so that only "
      "completions (a conversation's replies) are trained on");
  auto a = std::make_shared<TokenizeArgs>();
  cmd->add_option("--tokenizer", a->tokenizer,
                  "byte (ids 0-255 the bytes, 256 end-of-text), a Hugging Face tokenizer.json (or "
                  "a model directory holding one; its begin-of-text starts each document), or a "
                  "SentencePiece .model file");
  cmd->add_option("--input", a->inputs, "input file(s), .txt or .jsonl, read in order")->required();
  cmd->add_option("--output", a->output, "the token file to write")->required();
  cmd->add_option("--shard-tokens", a->shard_tokens,
                  "write llm.c shards of at most this many tokens, OUTPUT with _000000, "
                  "_000001, ... before its extension (0: one file, at most 2^31 - 1 tokens)")
      ->capture_default_str();
  cmd->add_option("--response-template", a->response_template,
                  "cut each plain document at the first occurrence of this text (e.g. \"### "
                  "Response:\"): the part up to it is a prompt, not trained on, and the rest "
                  "its completion, as TRL's DataCollatorForCompletionOnlyLM masks them; a "
                  "document without it is left out");
  cmd->add_option("--chat-template", a->chat_template,
                  "the chat template that renders conversations (.jsonl rows of \"messages\", of a "
                  "\"prompt\" and a \"completion\" that are lists of messages, or ShareGPT's "
                  "\"conversations\"): a .jinja "
                  "file, a tokenizer_config.json or a model directory (default: the tokenizer's "
                  "own, from its chat_template.jinja or tokenizer_config.json)");
  cmd->add_option("--chat-loss", a->chat_loss,
                  "replies: only the assistant's replies in a conversation count as targets (each "
                  "with the template's end marker); all: every token, as TRL trains on a "
                  "\"messages\" row without assistant_only_loss")
      ->check(CLI::IsMember({"replies", "all"}))
      ->capture_default_str();
  cmd->add_option("--show", a->show,
                  "print the first N tokens as written: decoded, special tokens included, the text "
                  "that is not trained on between ⟦ and ⟧ (to check a chat template's replies)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--append-eos", a->append_eos,
                "also write end-of-text after the last document (it always separates documents)");
  return {cmd, [a] { return run_tokenize(*a); }};
}

}  // namespace strata::cli
