// test_tokenize_cli.cpp: `strata tokenize` as a user runs it: a fortune-style .txt and a .jsonl
// through the byte tokenizer, read back with TokenFile and decoded to the documents with
// end-of-text between them, the file `strata eval` then reads, a SentencePiece model trained
// here, a Hugging Face tokenizer.json (its begin-of-text before each document), prompt and
// completion rows with their loss mask (by hand), conversations through a model's chat template
// (only the replies counted), and bad inputs named (missing file, bad JSON
// naming its line, a line without "text", an unsupported tokenizer.json).
#include "hf_tokenizer_testing.h"
#include "model/tokens.h"
#include "sentencepiece_testing.h"
#include "testing.h"
#include "train/tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace strata {
namespace {

namespace fs = std::filesystem;
using Result = test::CommandResult;

class TokenizeCli : public ::testing::Test {
 protected:
  fs::path write(const std::string& name, const std::string& text) const {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  static Result strata(const std::string& args, const std::string& redirect = "2>&1") {
    return test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " " + redirect);
  }
  static std::vector<uint32_t> read_tokens(const fs::path& p) {
    const TokenFile f = TokenFile::open(p, std::optional<TokenWidth>{});
    std::vector<uint32_t> t(static_cast<size_t>(f.size()));
    for (int64_t i = 0; i < f.size(); ++i) t[static_cast<size_t>(i)] = f.get(i);
    return t;
  }

  test::TempDir tmp_{"strata-tokenize-cli"};
  const fs::path& dir_ = tmp_.path;
};

TEST_F(TokenizeCli, FortuneTextThroughTheByteTokenizer) {
  const fs::path in = write("fortunes.txt",
                            "Fortune favors the bold.\n%\nA stitch in time\nsaves nine.\n%\n"
                            "Caf\xc3\xa9 au lait, 100%.\n%\n");
  const fs::path out = dir_ / "fortunes.bin";
  const Result r = strata("tokenize --tokenizer byte --input '" + in.string() + "' --output '" +
                          out.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const std::string& part :
       {std::string("3 documents"), std::string("tokens"), out.string(), std::string("byte")})
    EXPECT_NE(r.out.find(part), std::string::npos) << "'" << part << "' missing from: " << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;  // one line

  const TokenFile f = TokenFile::open(out, std::optional<TokenWidth>{});
  EXPECT_TRUE(f.llmc());
  EXPECT_EQ(f.width(), TokenWidth::u16);
  const std::vector<uint32_t> t = read_tokens(out);
  const std::string d1 = "Fortune favors the bold.\n", d2 = "A stitch in time\nsaves nine.\n",
                    d3 = "Caf\xc3\xa9 au lait, 100%.\n";
  EXPECT_EQ(t.size(), d1.size() + d2.size() + d3.size() + 2);  // eos between, none after
  EXPECT_EQ(t[d1.size()], 256u);
  EXPECT_EQ(t[d1.size() + 1 + d2.size()], 256u);
  EXPECT_EQ(make_byte_tokenizer()->decode(t), d1 + d2 + d3);

  // --append-eos ends the stream with one more; the file is replaced atomically.
  ASSERT_EQ(
      strata("tokenize --input '" + in.string() + "' --output '" + out.string() + "' --append-eos")
          .status,
      0);
  const std::vector<uint32_t> t2 = read_tokens(out);
  EXPECT_EQ(t2.size(), t.size() + 1);
  EXPECT_EQ(t2.back(), 256u);
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));

  // `strata eval` reads what tokenize wrote (the tiny preset's vocabulary holds 257 ids).
  const Result e =
      strata("eval --model tiny --init random --seed 1 --seq-len 8 --batch 2 --data '" +
             out.string() + "' --json");
  EXPECT_EQ(e.status, 0) << e.out;
  EXPECT_NE(e.out.find("\"loss\""), std::string::npos) << e.out;
}

TEST_F(TokenizeCli, JsonlDocumentsAndSeveralInputsInOrder) {
  const fs::path a = write("a.jsonl",
                           "{\"text\": \"first doc\\nline two\", \"meta\": {\"id\": 1}}\n\n"
                           "{\"text\": \"second \\u00e9\"}\n");
  const fs::path b = write("b.txt", "plain text file\n");
  const fs::path out = dir_ / "out.bin";
  const Result r = strata("tokenize --input '" + a.string() + "' '" + b.string() + "' --output '" +
                          out.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("3 documents"), std::string::npos) << r.out;
  const std::vector<uint32_t> t = read_tokens(out);
  const std::vector<uint32_t> want =
      tokenize_documents(*make_byte_tokenizer(),
                         {"first doc\nline two", "second \xc3\xa9", "plain text file\n"}, false);
  EXPECT_EQ(t, want);
  EXPECT_EQ(std::count(t.begin(), t.end(), 256u), 2);
}

// Prompt/completion rows (TRL's SFT format) beside a plain one: the tokens as always, and a loss
// mask beside them in which only completions and the end-of-text after them count. Rewritten
// from plain text, the output loses its mask.
TEST_F(TokenizeCli, PromptsAndCompletionsWriteALossMask) {
  const fs::path in = write("sft.jsonl",
                            "{\"prompt\": \"Q: hi\\n\", \"completion\": \"A: yo\"}\n"
                            "{\"text\": \"plain\"}\n"
                            "{\"prompt\": \"Q: 2+2\\n\", \"completion\": \"A: 4\"}\n");
  const fs::path out = dir_ / "sft.bin";
  const Result r =
      strata("tokenize --append-eos --input '" + in.string() + "' --output '" + out.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("2 of the documents have prompts"), std::string::npos) << r.out;
  const std::string q1 = "Q: hi\n", a1 = "A: yo", q2 = "Q: 2+2\n", a2 = "A: 4";
  std::vector<uint32_t> want;
  std::vector<uint8_t> counts;
  const auto put = [&](const std::string& text, uint8_t c) {
    for (unsigned char ch : text) {
      want.push_back(ch);
      counts.push_back(c);
    }
  };
  put(q1, 0);
  put(a1, 1);
  want.push_back(256);
  counts.push_back(1);
  put("plain", 1);
  want.push_back(256);
  counts.push_back(1);
  put(q2, 0);
  put(a2, 1);
  want.push_back(256);
  counts.push_back(1);
  EXPECT_EQ(read_tokens(out), want);
  const TokenFile tokens = TokenFile::open(out, std::optional<TokenWidth>{});
  const std::optional<LossMask> mask = LossMask::open_beside(tokens);
  ASSERT_TRUE(mask.has_value());
  EXPECT_EQ(mask->path(), (dir_ / "sft.bin.mask").string());
  std::vector<uint8_t> got;
  for (int64_t i = 0; i < mask->size(); ++i) got.push_back(mask->counts(i) ? 1 : 0);
  EXPECT_EQ(got, counts);
  const auto counted = std::count(counts.begin(), counts.end(), uint8_t{1});
  EXPECT_NE(r.out.find(fmt::format("{} of the {} tokens count", counted, want.size())),
            std::string::npos)
      << r.out;

  const fs::path plain = write("plain.txt", "no prompts here\n");
  const Result again =
      strata("tokenize --input '" + plain.string() + "' --output '" + out.string() + "'");
  ASSERT_EQ(again.status, 0) << again.out;
  EXPECT_FALSE(fs::exists(dir_ / "sft.bin.mask"));
  EXPECT_NE(again.out.find("removed"), std::string::npos) << again.out;
}

// Conversations ("messages" rows) through the chat template in the model directory's
// tokenizer_config.json, with the special tokens it names: the rendering encoded whole, and only
// the assistant's reply (with its end-of-text) counted in the mask beside it. --chat-loss all
// counts every token (no mask). Without a template the rows are refused, saying what to pass.
TEST_F(TokenizeCli, ConversationsThroughTheModelsChatTemplate) {
  const fs::path model = dir_ / "chat-model";
  test::write_tokenizer_json(model, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const nlohmann::json config = {
      {"bos_token", "<|begin_of_text|>"},
      {"eos_token", "<|endoftext|>"},
      {"chat_template",
       "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
       "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"}};
  std::ofstream(model / "tokenizer_config.json") << config.dump();
  const fs::path in =
      write("chat.jsonl",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"the\"}, {\"role\": "
            "\"assistant\", \"content\": \"the the\"}]}\n{\"text\": \"plain\"}\n");
  const fs::path out = dir_ / "chat.bin";
  const std::string args = "tokenize --tokenizer '" + model.string() + "' --input '" + in.string() +
                           "' --output '" + out.string() + "' --append-eos";
  const Result r = strata(args);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("1 conversation(s) rendered with the chat template " +
                       (model / "tokenizer_config.json").string()),
            std::string::npos)
      << r.out;

  const auto hf = open_tokenizer(model.string());
  const uint32_t bos = 260, eos = 259;
  const std::vector<uint32_t> whole =
      hf->encode("<|begin_of_text|><user>the<|endoftext|><assistant>the the<|endoftext|>");
  const std::vector<uint32_t> reply = hf->encode("the the<|endoftext|>");
  ASSERT_EQ(whole.front(), bos);
  ASSERT_EQ(whole.back(), eos);
  std::vector<uint32_t> want = whole;  // no second end-of-text after it
  want.push_back(bos);
  for (uint32_t id : hf->encode("plain")) want.push_back(id);
  want.push_back(eos);
  EXPECT_EQ(read_tokens(out), want);
  const TokenFile tokens = TokenFile::open(out, std::optional<TokenWidth>{});
  const std::optional<LossMask> mask = LossMask::open_beside(tokens);
  ASSERT_TRUE(mask.has_value());
  std::vector<uint32_t> counted;
  for (int64_t i = 0; i < mask->size(); ++i)
    if (mask->counts(i)) counted.push_back(tokens.get(i));
  std::vector<uint32_t> want_counted = reply;
  want_counted.push_back(bos);
  for (uint32_t id : hf->encode("plain")) want_counted.push_back(id);
  want_counted.push_back(eos);
  EXPECT_EQ(counted, want_counted);
  // Counted where they are: the reply is the whole's last tokens.
  for (size_t k = 0; k < whole.size(); ++k)
    EXPECT_EQ(mask->counts(static_cast<int64_t>(k)), k >= whole.size() - reply.size()) << k;

  // --show: the tokens as written, special tokens spelled out, what does not count in ⟦ ⟧.
  const Result shown = strata(args + " --show 1000");
  ASSERT_EQ(shown.status, 0) << shown.out;
  EXPECT_NE(shown.out.find("the first 32 tokens of " + out.string() +
                           " (⟦...⟧: not trained on):\n⟦<|begin_of_text|><user>the<|endoftext|>"
                           "<assistant>⟧the the<|endoftext|><|begin_of_text|>plain<|endoftext|>\n"),
            std::string::npos)
      << shown.out;

  const Result all = strata(args + " --chat-loss all");
  ASSERT_EQ(all.status, 0) << all.out;
  EXPECT_NE(all.out.find("every token counts (--chat-loss all)"), std::string::npos) << all.out;
  EXPECT_FALSE(fs::exists(dir_ / "chat.bin.mask"));
  EXPECT_EQ(read_tokens(out), want);

  const Result refused =
      strata("tokenize --input '" + in.string() + "' --output '" + (dir_ / "x.bin").string() + "'");
  EXPECT_EQ(refused.status, 1) << refused.out;
  EXPECT_NE(refused.out.find("chat.jsonl line 1"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--chat-template FILE"), std::string::npos) << refused.out;
  // A template given by name that does not parse is refused before anything is read.
  const fs::path broken = write("broken.jinja", "{% for m in messages %}");
  const Result unread = strata(args + " --chat-template '" + broken.string() + "'");
  EXPECT_EQ(unread.status, 1) << unread.out;
  EXPECT_NE(unread.out.find("broken.jinja line 1"), std::string::npos) << unread.out;
}

// Alpaca-style text rows with --response-template: prompts up to the template, completions
// after it, the row without it left out and said so.
TEST_F(TokenizeCli, AResponseTemplateMasksWhatComesBeforeIt) {
  const fs::path in = write("alpaca.jsonl",
                            "{\"text\": \"### Instruction: add\\n### Response: 4\"}\n"
                            "{\"text\": \"no answer\"}\n");
  const fs::path out = dir_ / "alpaca.bin";
  const Result r = strata("tokenize --input '" + in.string() + "' --output '" + out.string() +
                          "' --response-template '### Response:'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("1 document(s) without the response template \"### Response:\" left out"),
            std::string::npos)
      << r.out;
  const std::string prompt = "### Instruction: add\n### Response:", completion = " 4";
  std::vector<uint32_t> want(prompt.begin(), prompt.end());
  want.insert(want.end(), completion.begin(), completion.end());
  EXPECT_EQ(read_tokens(out), want);
  const std::optional<LossMask> mask =
      LossMask::open_beside(TokenFile::open(out, std::optional<TokenWidth>{}));
  ASSERT_TRUE(mask.has_value());
  EXPECT_EQ(mask->counted(), static_cast<int64_t>(completion.size()));
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(mask->counts(static_cast<int64_t>(i)), i >= prompt.size()) << i;
}

TEST_F(TokenizeCli, SentencePieceModel) {
  std::string why;
  const std::string model = test::train_sentencepiece(dir_, &why);
  if (model.empty()) GTEST_SKIP() << "SentencePiece could not train a model here: " << why;
  const fs::path in = write("in.jsonl",
                            "{\"text\": \"the quick brown fox\"}\n"
                            "{\"text\": \"a stitch in time saves nine\"}\n");
  const fs::path out = dir_ / "sp.bin";
  const Result r = strata("tokenize --tokenizer '" + model + "' --input '" + in.string() +
                          "' --output '" + out.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find(model), std::string::npos) << r.out;
  const auto sp = open_tokenizer(model);
  const std::vector<uint32_t> t = read_tokens(out);
  EXPECT_EQ(t,
            tokenize_documents(*sp, {"the quick brown fox", "a stitch in time saves nine"}, false));
  const auto eos = std::find(t.begin(), t.end(), *sp->eos_id());
  ASSERT_NE(eos, t.end());
  EXPECT_EQ(sp->decode(std::vector<uint32_t>(t.begin(), eos)), "the quick brown fox");
}

TEST_F(TokenizeCli, HuggingFaceTokenizerFromAModelDirectory) {
  // GPT-2's layout with Llama 3's begin-of-text (hf_tokenizer_testing.h): "Ġthe" is 258, "he"
  // 257, <|endoftext|> (end-of-text, by its name) 259, <|begin_of_text|> 260 before each document.
  const fs::path model = dir_ / "hf-model";
  test::write_tokenizer_json(model, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const fs::path in = write("in.jsonl", "{\"text\": \"the the\"}\n{\"text\": \" the!\"}\n");
  const fs::path out = dir_ / "hf.bin";
  const Result r = strata("tokenize --tokenizer '" + model.string() + "' --input '" + in.string() +
                          "' --output '" + out.string() + "' --append-eos");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find((model / "tokenizer.json").string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vocab 261"), std::string::npos) << r.out;
  EXPECT_EQ(read_tokens(out), (std::vector<uint32_t>{260, 't', 257, 258, 259, 260, 258, '!', 259}));
  // The tokenizer.json file itself works the same.
  const fs::path out2 = dir_ / "hf2.bin";
  const Result r2 =
      strata("tokenize --tokenizer '" + (model / "tokenizer.json").string() + "' --input '" +
             in.string() + "' --output '" + out2.string() + "' --append-eos");
  ASSERT_EQ(r2.status, 0) << r2.out;
  EXPECT_EQ(read_tokens(out2), read_tokens(out));
  // An unsupported file is refused naming its place, and nothing is written.
  nlohmann::json bad = test::gpt2_like_tokenizer();
  bad["model"]["type"] = "Unigram";
  test::write_tokenizer_json(dir_ / "bad-model", bad);
  const fs::path never = dir_ / "never-hf.bin";
  const Result refused =
      strata("tokenize --tokenizer '" + (dir_ / "bad-model").string() + "' --input '" +
             in.string() + "' --output '" + never.string() + "'");
  EXPECT_EQ(refused.status, 1) << refused.out;
  EXPECT_NE(refused.out.find("/model/type"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("Unigram"), std::string::npos) << refused.out;
  EXPECT_FALSE(fs::exists(never));
}

TEST_F(TokenizeCli, ShardsOfAtMostShardTokens) {
  const fs::path in = write("in.txt", "one\n%\ntwo two\n%\nthree three three\n");
  const fs::path whole = dir_ / "whole.bin", sharded = dir_ / "sharded.bin";
  Result r = strata("tokenize --input '" + in.string() + "' --output '" + whole.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<uint32_t> want = read_tokens(whole);  // 4 + 1 + 8 + 1 + 18 = 32 tokens
  ASSERT_EQ(want.size(), 32u);
  r = strata("tokenize --input '" + in.string() + "' --output '" + sharded.string() +
             "' --shard-tokens 10");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(
      r.out.find("4 shards, " + (dir_ / "sharded_000000.bin").string() + " ... sharded_000003.bin"),
      std::string::npos)
      << r.out;
  std::vector<uint32_t> got;
  for (int i = 0; i < 4; ++i) {
    const std::vector<uint32_t> t = read_tokens(dir_ / fmt::format("sharded_{:06}.bin", i));
    EXPECT_EQ(t.size(), i < 3 ? 10u : 2u) << i;
    got.insert(got.end(), t.begin(), t.end());
  }
  EXPECT_EQ(got, want);
  EXPECT_FALSE(fs::exists(sharded));
  // A later run with fewer shards says which older shard is not part of its output.
  r = strata("tokenize --input '" + in.string() + "' --output '" + sharded.string() +
             "' --shard-tokens 16");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("sharded_000002.bin is left from an earlier run"), std::string::npos)
      << r.out;
  // And strata train reads the shards as one data set.
  r = strata("train --model tiny --init random --seq-len 8 --steps 1 --devices host --data '" +
             (dir_ / "sharded_000000.bin").string() + "," + (dir_ / "sharded_000001.bin").string() +
             "' --run-dir '" + (dir_ / "run").string() + "'");
  EXPECT_EQ(r.status, 0) << r.out;
}

TEST_F(TokenizeCli, BadInputsAreNamed) {
  const fs::path out = dir_ / "never.bin";
  Result r = strata("tokenize --input '" + (dir_ / "missing.txt").string() + "' --output '" +
                    out.string() + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("missing.txt"), std::string::npos) << r.out;

  const fs::path bad_json =
      write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\"\n");
  r = strata("tokenize --input '" + bad_json.string() + "' --output '" + out.string() + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("bad.jsonl line 3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not valid JSON"), std::string::npos) << r.out;

  const fs::path no_text = write("notext.jsonl", "{\"text\": \"ok\"}\n{\"content\": \"x\"}\n");
  r = strata("tokenize --input '" + no_text.string() + "' --output '" + out.string() + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("notext.jsonl line 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"text\""), std::string::npos) << r.out;

  const fs::path empty = write("empty.txt", "");
  r = strata("tokenize --input '" + empty.string() + "' --output '" + out.string() + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("no document"), std::string::npos) << r.out;

  r = strata("tokenize --tokenizer '" + (dir_ / "nope.model").string() + "' --input '" +
             no_text.string() + "' --output '" + out.string() + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("nope.model"), std::string::npos) << r.out;

  r = strata("tokenize --input '" + empty.string() + "'");  // no --output
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--output"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace strata
