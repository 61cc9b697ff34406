// test_tokenizer.cpp: the byte tokenizer (every byte, end-of-text, out-of-vocabulary ids named),
// how documents are split (.txt whole or by '%' lines, .jsonl "text" or "prompt"/"completion"
// per line, errors naming the line), the end-of-text between documents, the loss masks of
// prompted documents (by hand, streamed into shards, bound to their tokens), and a SentencePiece
// model trained here with the library's own trainer on text the test writes: encode/decode
// round trip and its end-of-text.
#include "hf_tokenizer_testing.h"
#include "model/tokens.h"
#include "sentencepiece_testing.h"
#include "testing.h"
#include "train/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace strata {
namespace {

namespace fs = std::filesystem;
using test::expect_error;

// The texts of documents that have no prompt (each is checked to have none).
std::vector<std::string> texts(const std::vector<Document>& docs) {
  std::vector<std::string> out;
  for (const Document& d : docs) {
    EXPECT_EQ(d.prompt, "") << d.text;
    out.push_back(d.text);
  }
  return out;
}

TEST(ByteTokenizer, EveryByteRoundTripsAndEndOfTextIs256) {
  const auto t = make_byte_tokenizer();
  EXPECT_EQ(t->vocab_size(), 257);
  EXPECT_EQ(t->eos_id(), 256u);
  EXPECT_EQ(t->name(), "byte");
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<uint32_t> ids = t->encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (uint32_t b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(t->decode(ids), all);
  EXPECT_EQ(t->encode("h\xc3\xa9"), (std::vector<uint32_t>{'h', 0xc3, 0xa9}));  // UTF-8 bytes
  const std::vector<uint32_t> with_eos = {'a', 256, 'b'};
  EXPECT_EQ(t->decode(with_eos), "ab");  // end-of-text decodes to nothing
  const std::vector<uint32_t> bad = {'a', 300};
  expect_error([&] { t->decode(bad); }, {"id 300", "position 1", "257"});
}

TEST(Documents, TextIsOneDocumentUnlessPercentLinesSeparateIt) {
  EXPECT_EQ(
      texts(split_documents("one\ndocument\n\nwith a blank line\n", DocumentFormat::text, "a.txt")),
      std::vector<std::string>{"one\ndocument\n\nwith a blank line\n"});
  EXPECT_EQ(texts(split_documents("first\nfortune\n%\nsecond 50%\n%\r\n%\nthird",
                                  DocumentFormat::text, "fortunes")),
            (std::vector<std::string>{"first\nfortune\n", "second 50%\n", "third"}));
  EXPECT_TRUE(split_documents("", DocumentFormat::text, "empty.txt").empty());
  EXPECT_TRUE(split_documents("%\n%\n", DocumentFormat::text, "x").empty());
  EXPECT_EQ(document_format_of("data/x.jsonl"), DocumentFormat::jsonl);
  EXPECT_EQ(document_format_of("data/x.txt"), DocumentFormat::text);
  EXPECT_EQ(document_format_of("/usr/share/games/fortunes/art"), DocumentFormat::text);
}

TEST(Documents, JsonlHoldsOneTextPerLine) {
  EXPECT_EQ(texts(split_documents("{\"text\": \"a\\nb\", \"id\": 1}\n\n  \n{\"text\": \"c\"}\r\n"
                                  "{\"text\": \"\"}\n{\"text\": \"d\"}",
                                  DocumentFormat::jsonl, "d.jsonl")),
            (std::vector<std::string>{"a\nb", "c", "d"}));
  expect_error(
      [] {
        split_documents("{\"text\": \"a\"}\n{\"text\": oops}\n", DocumentFormat::jsonl, "d.jsonl");
      },
      {"d.jsonl line 2", "not valid JSON"});
  expect_error(
      [] {
        split_documents("{\"text\": \"a\"}\n\n{\"body\": \"b\"}\n", DocumentFormat::jsonl,
                        "d.jsonl");
      },
      {"d.jsonl line 3", "no \"text\" string", "body"});
  expect_error([] { split_documents("{\"text\": 5}\n", DocumentFormat::jsonl, "d.jsonl"); },
               {"d.jsonl line 1", "\"text\""});
  expect_error([] { split_documents("[1, 2]\n", DocumentFormat::jsonl, "d.jsonl"); },
               {"line 1", "JSON object"});
}

TEST(Documents, EndOfTextSeparatesDocuments) {
  const auto t = make_byte_tokenizer();
  EXPECT_EQ(tokenize_documents(*t, {"ab", "c"}, false),
            (std::vector<uint32_t>{'a', 'b', 256, 'c'}));
  EXPECT_EQ(tokenize_documents(*t, {"ab", "c"}, true),
            (std::vector<uint32_t>{'a', 'b', 256, 'c', 256}));
  EXPECT_TRUE(tokenize_documents(*t, {}, true).empty());
  expect_error([] { read_documents("/nonexistent/strata/input.txt"); },
               {"/nonexistent/strata/input.txt", "cannot open"});
  expect_error([] { open_tokenizer("/nonexistent/strata/tok.model"); },
               {"/nonexistent/strata/tok.model", "SentencePiece"});
}

// The tokens of llm.c files, concatenated.
std::vector<uint32_t> read_all(const std::vector<fs::path>& files) {
  std::vector<uint32_t> all;
  for (const fs::path& f : files) {
    const TokenFile t = TokenFile::open(f, std::optional<TokenWidth>{});
    for (int64_t i = 0; i < t.size(); ++i) all.push_back(t.get(i));
  }
  return all;
}

// tokenize_files holds a batch of documents at a time and writes shards as they fill: for every
// batch size and shard size the same token stream as tokenize_documents over all of them.
TEST(Documents, TokenizingFilesInBatchesAndShardsGivesOneStream) {
  test::TempDir tmp("strata-tokenize-files");
  const fs::path a = tmp.path / "a.txt", b = tmp.path / "b.jsonl";
  std::ofstream(a) << "the first\n%\nthe second, longer document\n%\nthird\n";
  std::ofstream(b) << "{\"text\": \"fourth the\"}\n{\"text\": \"\"}\n{\"text\": \"the fifth\"}\n";
  const std::vector<std::string> docs = {"the first\n", "the second, longer document\n", "third\n",
                                         "fourth the", "the fifth"};
  test::write_tokenizer_json(tmp.path / "hf",
                             test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const auto byte = make_byte_tokenizer();
  const auto hf = open_tokenizer((tmp.path / "hf").string());
  for (const Tokenizer* t : {byte.get(), hf.get()})
    for (const bool eos : {false, true}) {
      const std::vector<uint32_t> want = tokenize_documents(*t, docs, eos);
      for (const uint64_t batch : {uint64_t{1}, uint64_t{12}, uint64_t{40}, uint64_t{1} << 20})
        for (const uint64_t shard : {uint64_t{0}, uint64_t{7}, uint64_t{want.size()}}) {
          SCOPED_TRACE(fmt::format("{} eos {} batch {} shard {}", t->name(), eos, batch, shard));
          const fs::path out = tmp.path / "out" / "tokens.bin";
          fs::remove_all(out.parent_path());
          fs::create_directories(out.parent_path());
          const TokenizedFiles r = tokenize_files(
              *t, {a, b}, out, {.shard_tokens = shard, .append_eos = eos, .batch_bytes = batch});
          EXPECT_EQ(r.documents, 5u);
          EXPECT_EQ(r.tokens, want.size());
          EXPECT_EQ(read_all(r.files), want);
          const uint64_t shards = shard == 0 ? 1 : (want.size() + shard - 1) / shard;
          ASSERT_EQ(r.files.size(), shards);
          EXPECT_EQ(r.files.front().filename(), shard == 0 ? "tokens.bin" : "tokens_000000.bin");
          for (const fs::path& f : r.files)
            EXPECT_LE(TokenFile::open(f, std::optional<TokenWidth>{}).size(),
                      static_cast<int64_t>(shard == 0 ? want.size() : shard));
          // Only the shards: no temporary file is left.
          EXPECT_EQ(
              std::distance(fs::directory_iterator(out.parent_path()), fs::directory_iterator()),
              static_cast<std::ptrdiff_t>(shards));
        }
    }
  // Nothing to tokenize: named, and nothing written.
  const fs::path empty = tmp.path / "empty.jsonl";
  std::ofstream(empty) << "{\"text\": \"\"}\n";
  expect_error([&] { tokenize_files(*byte, {empty}, tmp.path / "never.bin"); },
               {"no document", empty.string()});
  EXPECT_FALSE(fs::exists(tmp.path / "never.bin"));
  // A document too large to encode whole in the memory there is: refused, named, before
  // anything is written.
  expect_error(
      [&] {
        tokenize_files(*byte, {a, b}, tmp.path / "never.bin", {.memory_bytes = 400});
      },
      {"document 2 of " + a.string(), "28 B", "encoded whole", "400 B available",
       "lines holding only %"});
  EXPECT_FALSE(fs::exists(tmp.path / "never.bin"));
  EXPECT_NO_THROW(tokenize_files(*byte, {a, b}, tmp.path / "fits.bin", {.memory_bytes = 480}));
  // A missing input, even after a good one, fails before any shard is written.
  expect_error(
      [&] {
        tokenize_files(*byte, {a, tmp.path / "missing.txt"}, tmp.path / "never.bin",
                       {.shard_tokens = 3});
      },
      {"missing.txt", "cannot open"});
  EXPECT_FALSE(fs::exists(tmp.path / "never_000000.bin"));
}

TEST(Documents, JsonlRowsMayBePromptsWithCompletions) {
  EXPECT_EQ(split_documents("{\"prompt\": \"Q: 2+2?\\n\", \"completion\": \"A: 4\"}\n"
                            "{\"text\": \"plain\"}\n{\"prompt\": \"\", \"completion\": \"\"}\n"
                            "{\"prompt\": \"only a prompt\", \"completion\": \"\"}\n",
                            DocumentFormat::jsonl, "sft.jsonl"),
            (std::vector<Document>{{"Q: 2+2?\n", "A: 4"}, {"", "plain"}, {"only a prompt", ""}}));
  expect_error(
      [] {
        split_documents("{\"prompt\": \"p\", \"completion\": \"c\", \"text\": \"t\"}\n",
                        DocumentFormat::jsonl, "sft.jsonl");
      },
      {"sft.jsonl line 1", "both \"text\" and a prompt", "only the completion is trained on"});
  expect_error(
      [] {
        split_documents("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
                        DocumentFormat::jsonl, "chat.jsonl");
      },
      {"chat.jsonl line 1", "\"messages\" row", "chat template", "\"prompt\"", "\"completion\""});
  expect_error([] { split_documents("{\"prompt\": \"p\"}\n", DocumentFormat::jsonl, "sft.jsonl"); },
               {"sft.jsonl line 1", "\"completion\"", "{\"prompt\": \"p\"}"});
  expect_error(
      [] {
        split_documents("{\"prompt\": \"p\", \"completion\": 3}\n", DocumentFormat::jsonl,
                        "sft.jsonl");
      },
      {"sft.jsonl line 1", "\"completion\" string"});
}

// By hand with the byte tokenizer: a prompt's tokens do not count, its completion's and the
// end-of-text after it do; plain documents count whole. With a begin-of-text, a prompted
// document's does not count and a plain one's does.
TEST(LossMasks, OnlyCompletionsAndTheirEndOfTextCount) {
  const auto t = make_byte_tokenizer();
  const TokenStream s = encode_documents(*t, {{"Q:", "A"}, {"", "xy"}, {"P", ""}}, true);
  EXPECT_TRUE(s.prompted);
  EXPECT_EQ(s.tokens, (std::vector<uint32_t>{'Q', ':', 'A', 256, 'x', 'y', 256, 'P', 256}));
  EXPECT_EQ(s.counts, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1, 1, 0, 1}));
  const TokenStream plain = encode_documents(*t, {{"", "ab"}, {"", "c"}}, false);
  EXPECT_FALSE(plain.prompted);
  EXPECT_EQ(plain.counts, std::vector<uint8_t>(4, 1));
  EXPECT_EQ(plain.tokens, tokenize_documents(*t, {"ab", "c"}, false));

  test::TempDir tmp("strata-loss-mask-bos");
  test::write_tokenizer_json(tmp.path, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const auto hf = open_tokenizer(tmp.path.string());
  const std::vector<uint32_t> bos = hf->prefix_ids();
  ASSERT_EQ(bos.size(), 1u);
  const std::vector<uint32_t> p = hf->encode("the question"), c = hf->encode(" the answer");
  const TokenStream b =
      encode_documents(*hf, {{"the question", " the answer"}, {"", "the"}}, false);
  std::vector<uint32_t> want = bos;
  std::vector<uint8_t> counts = {0};
  want.insert(want.end(), p.begin(), p.end());
  counts.insert(counts.end(), p.size(), 0);
  want.insert(want.end(), c.begin(), c.end());
  counts.insert(counts.end(), c.size(), 1);
  want.push_back(*hf->eos_id());
  counts.push_back(1);
  want.push_back(bos[0]);
  counts.push_back(1);
  for (uint32_t id : hf->encode("the")) {
    want.push_back(id);
    counts.push_back(1);
  }
  EXPECT_EQ(b.tokens, want);
  EXPECT_EQ(b.counts, counts);
}

// Every flag of a token file's mask, in order, or none where it has no mask.
std::vector<uint8_t> read_masks(const std::vector<fs::path>& files) {
  std::vector<uint8_t> all;
  for (const fs::path& f : files) {
    const TokenFile t = TokenFile::open(f, std::optional<TokenWidth>{});
    const std::optional<LossMask> m = LossMask::open_beside(t);
    if (!m) continue;
    EXPECT_EQ(m->size(), t.size());
    for (int64_t i = 0; i < m->size(); ++i) all.push_back(m->counts(i) ? 1 : 0);
  }
  return all;
}

// Plain documents first, prompts later: the masks start with ones for what came before, follow
// the token shards, and are the same for every batch and shard size. Rewriting the output
// without prompts removes them; a mask that does not belong to its tokens is refused, named.
TEST(LossMasks, StreamedBesideEveryShardAndBoundToItsTokens) {
  test::TempDir tmp("strata-loss-mask-files");
  const fs::path a = tmp.path / "a.txt", b = tmp.path / "b.jsonl";
  std::ofstream(a) << "plain first\n%\nplain second\n";
  std::ofstream(b) << "{\"prompt\": \"Q1 \", \"completion\": \"A1\"}\n{\"text\": \"between\"}\n"
                      "{\"prompt\": \"Q2 \", \"completion\": \"A2!\"}\n";
  const std::vector<Document> docs = {{"", "plain first\n"},
                                      {"", "plain second\n"},
                                      {"Q1 ", "A1"},
                                      {"", "between"},
                                      {"Q2 ", "A2!"}};
  const auto t = make_byte_tokenizer();
  for (const bool eos : {false, true}) {
    const TokenStream want = encode_documents(*t, docs, eos);
    for (const uint64_t batch : {uint64_t{1}, uint64_t{20}, uint64_t{1} << 20})
      for (const uint64_t shard : {uint64_t{0}, uint64_t{5}, uint64_t{16}}) {
        SCOPED_TRACE(fmt::format("eos {} batch {} shard {}", eos, batch, shard));
        const fs::path out = tmp.path / "out" / "sft.bin";
        fs::remove_all(out.parent_path());
        fs::create_directories(out.parent_path());
        const TokenizedFiles r = tokenize_files(
            *t, {a, b}, out, {.shard_tokens = shard, .append_eos = eos, .batch_bytes = batch});
        EXPECT_EQ(r.prompted, 2u);
        EXPECT_EQ(read_all(r.files), want.tokens);
        EXPECT_EQ(read_masks(r.files), want.counts);
        ASSERT_EQ(r.masks.size(), r.files.size());
        for (size_t i = 0; i < r.files.size(); ++i)
          EXPECT_EQ(r.masks[i], loss_mask_path(r.files[i]));
        EXPECT_EQ(r.counted, static_cast<uint64_t>(
                                 std::count(want.counts.begin(), want.counts.end(), uint8_t{1})));
        // Tokens and masks only: no temporary file is left.
        EXPECT_EQ(
            std::distance(fs::directory_iterator(out.parent_path()), fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(2 * r.files.size()));
      }
  }
  // The same output rewritten from plain text: its old mask goes.
  const fs::path out = tmp.path / "one.bin";
  tokenize_files(*t, {a, b}, out);
  ASSERT_TRUE(fs::exists(loss_mask_path(out)));
  const TokenizedFiles plain = tokenize_files(*t, {a}, out);
  EXPECT_TRUE(plain.masks.empty());
  EXPECT_FALSE(fs::exists(loss_mask_path(out)));

  // A token file rewritten with other tokens of the same count keeps a mask that is not its.
  tokenize_files(*t, {a, b}, out);
  const fs::path mask = loss_mask_path(out);
  const fs::path saved = tmp.path / "saved.mask";
  fs::copy_file(mask, saved);
  std::vector<uint32_t> other = read_all({out});
  other[3] = 'Z';
  write_llmc_tokens(out, other, TokenWidth::u16);
  fs::copy_file(saved, mask, fs::copy_options::overwrite_existing);
  expect_error([&] { LossMask::open_beside(TokenFile::open(out, std::optional<TokenWidth>{})); },
               {mask.string(), "XXH3-64", "rewritten after its mask", "remove the mask"});
  // One token fewer: the counts differ.
  other.pop_back();
  write_llmc_tokens(out, other, TokenWidth::u16);
  expect_error([&] { LossMask::open_beside(TokenFile::open(out, std::optional<TokenWidth>{})); },
               {mask.string(), "flags", fmt::format("holds {} tokens", other.size())});
  // A damaged flag, and a file that is not a mask at all.
  tokenize_files(*t, {a, b}, out);
  {
    std::fstream f(mask, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1024 + 2);
    f.put(char{7});
  }
  expect_error([&] { LossMask::open_beside(TokenFile::open(out, std::optional<TokenWidth>{})); },
               {mask.string(), "flag 7 at token 2", "damaged"});
  std::ofstream(mask) << "not a mask";
  expect_error([&] { LossMask::open_beside(TokenFile::open(out, std::optional<TokenWidth>{})); },
               {mask.string(), "not a strata loss mask", out.string()});
}

// --response-template: a plain document is cut at the first occurrence of the template (the
// prompt keeps it), one without it is left out, and prompt/completion rows stay as they are.
TEST(LossMasks, AResponseTemplateCutsPlainDocuments) {
  test::TempDir tmp("strata-response-template");
  const fs::path a = tmp.path / "alpaca.jsonl";
  std::ofstream(a) << "{\"text\": \"Add 2+2.\\n### Response: 4 ### Response: again\"}\n"
                      "{\"text\": \"no template here\"}\n"
                      "{\"prompt\": \"P ### Response:\", \"completion\": \" C\"}\n"
                      "{\"text\": \"### Response:\"}\n";
  const auto t = make_byte_tokenizer();
  const fs::path out = tmp.path / "sft.bin";
  const TokenizedFiles r =
      tokenize_files(*t, {a}, out, {.append_eos = true, .response_template = "### Response:"});
  EXPECT_EQ(r.documents, 3u);
  EXPECT_EQ(r.untemplated, 1u);
  EXPECT_EQ(r.prompted, 3u);
  const TokenStream want = encode_documents(*t,
                                            {{"Add 2+2.\n### Response:", " 4 ### Response: again"},
                                             {"P ### Response:", " C"},
                                             {"### Response:", ""}},
                                            true);
  EXPECT_EQ(read_all(r.files), want.tokens);
  EXPECT_EQ(read_masks(r.files), want.counts);
  // Nothing holds it: named, nothing written.
  const fs::path b = tmp.path / "plain.jsonl";
  std::ofstream(b) << "{\"text\": \"one ### Response: x\"}\n{\"text\": \"two\"}\n";
  expect_error(
      [&] {
        tokenize_files(*t, {b}, tmp.path / "never.bin", {.response_template = "### Answer:"});
      },
      {"none of the 2 documents", "\"### Answer:\"", "--response-template"});
  EXPECT_FALSE(fs::exists(tmp.path / "never.bin"));
}

TEST(Documents, TheTokenWriterNamesShardsAndRefusesWhatDoesNotFit) {
  test::TempDir tmp("strata-token-writer");
  EXPECT_EQ(LlmcTokenWriter(tmp.path / "data", TokenWidth::u16, 5).shard_path(12),
            tmp.path / "data_000012");
  EXPECT_EQ(LlmcTokenWriter(tmp.path / "d.bin", TokenWidth::u16, 0).shard_path(0),
            tmp.path / "d.bin");
  expect_error([&] { LlmcTokenWriter(tmp.path / "x.bin", TokenWidth::u16, 1ull << 31); },
               {"--shard-tokens 2147483648", "int32"});
  LlmcTokenWriter w(tmp.path / "w.bin", TokenWidth::u16, 3);
  const std::vector<uint32_t> fits = {1, 2, 3, 4}, too_big = {5, 70000};
  w.write(fits);
  expect_error([&] { w.write(too_big); }, {"token 70000", "position 5", "uint32"});
}

class SentencePieceTest : public ::testing::Test {
 protected:
  test::TempDir tmp_{"strata-tokenizer"};
  const fs::path& dir_ = tmp_.path;
};

TEST_F(SentencePieceTest, ATrainedModelRoundTripsText) {
  std::string why;
  const std::string model = test::train_sentencepiece(dir_, &why);
  if (model.empty()) GTEST_SKIP() << "SentencePiece could not train a model here: " << why;
  const auto t = open_tokenizer(model);
  EXPECT_EQ(t->name(), model);
  EXPECT_GE(t->vocab_size(), 30);
  EXPECT_LE(t->vocab_size(), 120);
  ASSERT_TRUE(t->eos_id().has_value());  // </s>, id 2 by SentencePiece's default
  EXPECT_EQ(*t->eos_id(), 2u);
  for (const char* text : {"the quick brown fox", "a stitch in time saves nine gold apples",
                           "every state is scheduled 17"}) {
    const std::vector<uint32_t> ids = t->encode(text);
    EXPECT_FALSE(ids.empty());
    EXPECT_LT(ids.size(), std::string(text).size());  // pieces longer than a character
    for (uint32_t id : ids) EXPECT_LT(id, static_cast<uint32_t>(t->vocab_size()));
    EXPECT_EQ(t->decode(ids), text);
  }
  // <s> (id 1 by SentencePiece's default) starts each document, as Hugging Face's
  // LlamaTokenizer puts it.
  EXPECT_EQ(t->prefix_ids(), std::vector<uint32_t>{1});
  const std::vector<uint32_t> stream = tokenize_documents(*t, {"the fox", "the dog"}, true);
  EXPECT_EQ(std::count(stream.begin(), stream.end(), *t->eos_id()), 2);
  EXPECT_EQ(std::count(stream.begin(), stream.end(), 1u), 2);
  EXPECT_EQ(stream.front(), 1u);
  // </s> decodes to nothing; the next piece's word-start mark becomes a space.
  EXPECT_EQ(t->decode(stream), "the fox the dog");
  const std::vector<uint32_t> bad = {static_cast<uint32_t>(t->vocab_size())};
  expect_error([&] { t->decode(bad); }, {model, "outside its vocabulary"});

  // Not a model: named.
  const fs::path junk = dir_ / "junk.model";
  std::ofstream(junk) << "not a protobuf";
  expect_error([&] { open_tokenizer(junk.string()); }, {"junk.model", "cannot load"});
}

}  // namespace
}  // namespace strata
