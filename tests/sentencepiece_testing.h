// sentencepiece_testing.h: a small SentencePiece model trained by the library's own trainer on
// text written by the test, for the tokenizer suites (no model file is shipped or downloaded).
#pragma once

#include <sentencepiece_trainer.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace strata::test {

// Trains a small unigram model on text written here; empty with the reason when the library
// cannot (then the test skips).
inline std::string train_sentencepiece(const std::filesystem::path& dir, std::string* why) {
  const std::filesystem::path corpus = dir / "corpus.txt";
  {
    std::ofstream out(corpus);
    const char* lines[] = {
        "the quick brown fox jumps over the lazy dog",
        "a stitch in time saves nine",
        "all that glitters is not gold",
        "the early bird catches the worm",
        "fortune favors the bold and the brave",
        "an apple a day keeps the doctor away",
        "strata trains language models whose state does not fit on the gpu",
        "every transfer is scheduled ahead of its use",
    };
    for (int rep = 0; rep < 40; ++rep)
      for (const char* l : lines) out << l << " " << rep << "\n";
  }
  const std::filesystem::path prefix = dir / "tiny";
  const sentencepiece::util::Status status =
      sentencepiece::SentencePieceTrainer::Train({{"input", corpus.string()},
                                                  {"model_prefix", prefix.string()},
                                                  {"vocab_size", "120"},
                                                  {"model_type", "unigram"},
                                                  {"character_coverage", "1.0"},
                                                  {"byte_fallback", "false"},
                                                  {"hard_vocab_limit", "false"},
                                                  {"num_threads", "1"},
                                                  {"minloglevel", "2"}});
  if (!status.ok()) {
    *why = status.ToString();
    return "";
  }
  return prefix.string() + ".model";
}

}  // namespace strata::test
