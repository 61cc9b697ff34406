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
#include <tuple>
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
  EXPECT_EQ(t->special_piece(256), "<eos>");  // what tokenize --show writes for it
  EXPECT_FALSE(t->special_piece('a').has_value());
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

// The document starts of llm.c files' indexes, as positions in their tokens end to end.
std::vector<uint64_t> read_starts(const std::vector<fs::path>& files) {
  std::vector<uint64_t> all;
  uint64_t offset = 0;
  for (const fs::path& f : files) {
    const TokenFile t = TokenFile::open(f, std::optional<TokenWidth>{});
    const std::optional<DocumentIndex> index = DocumentIndex::open_beside(t);
    EXPECT_TRUE(index.has_value()) << f;
    for (int64_t d = 0; index && d < index->size(); ++d) all.push_back(offset + index->start(d));
    offset += static_cast<uint64_t>(t.size());
  }
  return all;
}

// tokenize_files holds a batch of documents at a time and writes shards as they fill: for every
// batch size and shard size the same token stream as tokenize_documents over all of them, and
// beside each file the index of where its documents start: a byte document's after the
// end-of-text before it, a Hugging Face one's at its begin-of-text.
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
          const std::vector<uint64_t> starts = read_starts(r.files);
          ASSERT_EQ(starts.size(), 5u);
          EXPECT_EQ(starts.front(), 0u);
          for (const uint64_t at : starts) {
            if (t == byte.get() && at > 0) {
              EXPECT_EQ(want[at - 1], 256u) << at;
            }
            if (t == hf.get()) {
              EXPECT_EQ(want[at], t->prefix_ids().front()) << at;
            }
          }
          EXPECT_EQ(r.indexes.size(), r.files.size());
          const uint64_t shards = shard == 0 ? 1 : (want.size() + shard - 1) / shard;
          ASSERT_EQ(r.files.size(), shards);
          EXPECT_EQ(r.files.front().filename(), shard == 0 ? "tokens.bin" : "tokens_000000.bin");
          for (const fs::path& f : r.files)
            EXPECT_LE(TokenFile::open(f, std::optional<TokenWidth>{}).size(),
                      static_cast<int64_t>(shard == 0 ? want.size() : shard));
          // Only the shards and their indexes: no temporary file is left.
          EXPECT_EQ(
              std::distance(fs::directory_iterator(out.parent_path()), fs::directory_iterator()),
              static_cast<std::ptrdiff_t>(2 * shards));
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
      {"chat.jsonl line 1", "conversation", "chat template", "--chat-template"});
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
        EXPECT_EQ(read_starts(r.files), want.starts);
        EXPECT_EQ(want.starts.size(), docs.size());
        ASSERT_EQ(r.masks.size(), r.files.size());
        for (size_t i = 0; i < r.files.size(); ++i)
          EXPECT_EQ(r.masks[i], loss_mask_path(r.files[i]));
        EXPECT_EQ(r.counted, static_cast<uint64_t>(
                                 std::count(want.counts.begin(), want.counts.end(), uint8_t{1})));
        // Tokens, masks and indexes only: no temporary file is left.
        EXPECT_EQ(
            std::distance(fs::directory_iterator(out.parent_path()), fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(3 * r.files.size()));
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
  EXPECT_EQ(t->special_piece(2), "</s>");
  EXPECT_FALSE(t->special_piece(static_cast<uint32_t>(t->encode("the").front())).has_value());
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

// ---- conversations through a chat template ---------------------------------------------------

// A small template of the ChatML kind: each turn in role markers, a generation prompt.
constexpr const char* kTurns =
    "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}";

ChatOptions chat_options(const char* source, bool all_tokens = false) {
  ChatOptions chat;
  chat.format = ChatFormat{std::make_shared<ChatTemplate>(source, "turns.jinja"), nullptr,
                           nlohmann::ordered_json::object(), "turns.jinja"};
  chat.all_tokens = all_tokens;
  return chat;
}

std::vector<std::string> reply_texts(const Document& d) {
  std::vector<std::string> out;
  for (const auto& [a, b] : d.replies) out.push_back(d.text.substr(a, b - a));
  return out;
}

// A "messages" row renders whole, and each assistant turn (with its end marker) is a reply; a
// conversational prompt-completion row's completion is its one reply; --chat-loss all keeps no
// replies (every token counts).
TEST(Conversations, RepliesAreTheAssistantTurns) {
  const ChatOptions chat = chat_options(kTurns);
  const std::vector<Document> docs = split_documents(
      "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief \"}, {\"role\": \"user\", "
      "\"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}, {\"role\": "
      "\"user\", \"content\": \"bye\"}, {\"role\": \"assistant\", \"content\": \" ciao\"}]}\n"
      "{\"text\": \"plain\"}\n"
      "{\"prompt\": [{\"role\": \"user\", \"content\": \"q\"}], \"completion\": [{\"role\": "
      "\"assistant\", \"content\": \"a\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &chat);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_TRUE(docs[0].rendered);
  EXPECT_EQ(docs[0].prompt, "");
  EXPECT_EQ(docs[0].text,
            "<system>be brief</system>\n<user>hi</user>\n<assistant>hello</assistant>\n"
            "<user>bye</user>\n<assistant>ciao</assistant>\n");
  EXPECT_EQ(reply_texts(docs[0]),
            (std::vector<std::string>{"hello</assistant>\n", "ciao</assistant>\n"}));
  EXPECT_EQ(docs[1], (Document{"", "plain"}));
  EXPECT_EQ(docs[2].text, "<user>q</user>\n<assistant>a</assistant>\n");
  EXPECT_EQ(reply_texts(docs[2]), std::vector<std::string>{"a</assistant>\n"});

  const ChatOptions all = chat_options(kTurns, true);
  const std::vector<Document> whole = split_documents(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
      "\"content\": \"yo\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &all);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_TRUE(whole[0].rendered);
  EXPECT_TRUE(whole[0].replies.empty());
  // A conversational prompt/completion row still trains on its completion alone: TRL's
  // completion_only_loss is apart from its assistant_only_loss, which --chat-loss all turns off.
  const std::vector<Document> pc = split_documents(
      "{\"prompt\": [{\"role\": \"user\", \"content\": \"q\"}], \"completion\": [{\"role\": "
      "\"assistant\", \"content\": \"a\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &all);
  ASSERT_EQ(pc.size(), 1u);
  EXPECT_EQ(reply_texts(pc[0]), std::vector<std::string>{"a</assistant>\n"});
}

// A row's chat_template_kwargs reach the template as its variables (TRL passes them to
// apply_chat_template), and tools given as a JSON string are that list (as TRL parses them).
TEST(Conversations, TemplateKwargsAndToolsAsAString) {
  const ChatOptions chat = chat_options(
      "{% if tools %}[{{ tools | length }} tools]{% endif %}"
      "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
      "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}",
      true);
  const std::vector<Document> docs = split_documents(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
      "\"chat_template_kwargs\": {\"enable_thinking\": false}}\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
      "\"tools\": \"[{\\\"name\\\": \\\"f\\\"}, {\\\"name\\\": \\\"g\\\"}]\"}\n",
      DocumentFormat::jsonl, "chat.jsonl", &chat);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0].text, "<nothink><user>hi</user>");
  EXPECT_EQ(docs[1].text, "[2 tools]<user>hi</user>");
  expect_error(
      [&] {
        split_documents(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": \"f\"}\n",
            DocumentFormat::jsonl, "chat.jsonl", &chat);
      },
      {"chat.jsonl line 1", "\"tools\"", "not a JSON list"});
  expect_error(
      [&] {
        split_documents(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
            "\"chat_template_kwargs\": true}\n",
            DocumentFormat::jsonl, "chat.jsonl", &chat);
      },
      {"chat.jsonl line 1", "\"chat_template_kwargs\"", "an object"});
}

// Gemma 3's shape of template (the corpus's): the system text opens the first user turn and a
// message's content may be a list of parts with images among them. The replies are the model's
// turns with their end marker, in a conversation of parts as in one of strings.
TEST(Conversations, RepliesOfAGemma3StyleTemplate) {
  std::ifstream in(std::string(STRATA_CHAT_TEMPLATE_DIR) + "/families/gemma3.jinja");
  std::stringstream source;
  source << in.rdbuf();
  ASSERT_FALSE(source.str().empty());
  const ChatOptions chat = chat_options(source.str().c_str());
  const std::vector<Document> docs = split_documents(
      "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": \"user\", "
      "\"content\": [{\"type\": \"image\"}, {\"type\": \"text\", \"text\": \"what is it?\"}]}, "
      "{\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": \"a cat\"}]}, "
      "{\"role\": \"user\", \"content\": \"and?\"}, {\"role\": \"assistant\", \"content\": "
      "\"a mat\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &chat);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0].text,
            "<start_of_turn>user\nbe brief\n\n<start_of_image>what is it?<end_of_turn>\n"
            "<start_of_turn>model\na cat<end_of_turn>\n<start_of_turn>user\nand?<end_of_turn>\n"
            "<start_of_turn>model\na mat<end_of_turn>\n");
  EXPECT_EQ(reply_texts(docs[0]),
            (std::vector<std::string>{"a cat<end_of_turn>\n", "a mat<end_of_turn>\n"}));
}

// A template that writes a reply differently once another turn follows (as Qwen3's drops the
// empty <think></think> of all but the last): the last reply is found by the turns-before rule,
// the earlier ones by their content, each with the end of its turn ("</a>\n"). A content that
// begins or ends like the marker strata swaps in is found too.
TEST(Conversations, RepliesOfATemplateThatRewritesEarlierTurnsAreFoundByTheirContent) {
  const ChatOptions chat = chat_options(
      "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% if loop.last %}<t></t>"
      "{% endif %}{{ m.content }}</a>\n{% else %}<u>{{ m.content }}</u>\n{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}<a>{% endif %}");
  const std::vector<Document> docs = split_documents(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
      "\"content\": \"QuiZ\"}, {\"role\": \"user\", \"content\": \"bye\"}, {\"role\": "
      "\"assistant\", \"content\": \"Whee X\"}, {\"role\": \"user\", \"content\": \"and?\"}, "
      "{\"role\": \"assistant\", \"content\": \"ciao\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &chat);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0].text,
            "<u>hi</u>\n<a>QuiZ</a>\n<u>bye</u>\n<a>Whee X</a>\n<u>and?</u>\n<a><t></t>ciao</a>\n");
  EXPECT_EQ(reply_texts(docs[0]),
            (std::vector<std::string>{"QuiZ</a>\n", "Whee X</a>\n", "<t></t>ciao</a>\n"}));
  ASSERT_EQ(docs[0].replies.size(), 3u);
  EXPECT_EQ(docs[0].replies[0].first, 13u);  // right after the "<a>" of the first reply
}

// A template with TRL's {% generation %} markers says itself which text is the assistant's:
// the replies are what its blocks wrote (here without the newline after each end marker, which
// the turns-before rule would count), in one rendering.
TEST(Conversations, GenerationMarkersAreTheReplies) {
  const ChatOptions chat = chat_options(
      "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
      "{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}</u>{% endif %}{{ '\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
  const std::vector<Document> docs = split_documents(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
      "\"content\": \"yo\"}, {\"role\": \"user\", \"content\": \"q\"}, {\"role\": "
      "\"assistant\", \"content\": \"a\"}]}\n",
      DocumentFormat::jsonl, "chat.jsonl", &chat);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0].text, "<user>hi</u>\n<assistant>yo</a>\n<user>q</u>\n<assistant>a</a>\n");
  EXPECT_EQ(reply_texts(docs[0]), (std::vector<std::string>{"yo</a>", "a</a>"}));
  expect_error(
      [&] {
        split_documents("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
                        DocumentFormat::jsonl, "chat.jsonl", &chat);
      },
      {"chat.jsonl line 1", "marks no text", "generation", "--chat-loss all"});
}

// ShareGPT's "conversations" rows (turns of "from" and "value") are the messages they stand
// for: human is the user, gpt the assistant, as axolotl and LLaMA-Factory map them.
TEST(Conversations, ShareGptTurnsAreMessages) {
  const ChatOptions chat = chat_options(kTurns);
  const auto split = [&](const std::string& row) {
    return split_documents(row, DocumentFormat::jsonl, "chat.jsonl", &chat);
  };
  const std::vector<Document> shared = split(
      "{\"conversations\": [{\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"human\", "
      "\"value\": \"hi\"}, {\"from\": \"gpt\", \"value\": \"yo\"}]}\n");
  const std::vector<Document> messages = split(
      "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", "
      "\"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n");
  ASSERT_EQ(shared.size(), 1u);
  EXPECT_EQ(shared[0], messages[0]);
  EXPECT_EQ(reply_texts(shared[0]), std::vector<std::string>{"yo</assistant>\n"});
  expect_error(
      [&] { split("{\"conversations\": [{\"from\": \"narrator\", \"value\": \"x\"}]}\n"); },
      {"chat.jsonl line 1", "turn 0", "\"narrator\"", "\"messages\""});
  expect_error([&] { split("{\"conversations\": [{\"from\": \"human\"}]}\n"); },
               {"chat.jsonl line 1", "turn 0", "\"value\""});
  expect_error(
      [&] {
        split("{\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}], \"messages\": []}\n");
      },
      {"chat.jsonl line 1", "both \"conversations\" and \"messages\""});
}

// Conversations that cannot be trained on as asked are refused, naming the line and why.
TEST(Conversations, BadConversationsAreNamed) {
  const ChatOptions chat = chat_options(kTurns);
  const auto split = [](const std::string& rows, const ChatOptions& c) {
    return split_documents(rows, DocumentFormat::jsonl, "chat.jsonl", &c);
  };
  expect_error([&] { split("{\"text\": \"x\"}\n{\"messages\": []}\n", chat); },
               {"chat.jsonl line 2", "\"messages\" is an empty list"});
  expect_error([&] { split("{\"messages\": [{\"content\": \"hi\"}]}\n", chat); },
               {"chat.jsonl line 1", "message 0", "no \"role\""});
  expect_error(
      [&] { split("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", chat); },
      {"chat.jsonl line 1", "no assistant message", "--chat-loss all"});
  expect_error(
      [&] {
        split("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"text\": \"t\"}\n",
              chat);
      },
      {"chat.jsonl line 1", "give one of them"});
  // A template that writes each turn differently when another follows, and whose reply is not
  // found by its content either: ended otherwise when another turn follows ("!" last, ";"
  // before another), or printed twice.
  const std::string qar =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": "
      "\"assistant\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"r\"}]}\n";
  for (const char* shifty :
       {"{% for m in messages %}{{ m.content }}{% if loop.last %}!{% else %};{% endif %}"
        "{% endfor %}",
        "{% for m in messages %}{% if loop.last %}[{% endif %}{{ m.content }}{% endfor %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{% endif %}"
        "{% endfor %}"})
    expect_error([&] { split(qar, chat_options(shifty)); },
                 {"chat.jsonl line 1", "turns.jinja", "does not begin the whole",
                  "not found there once", "--chat-loss all"});
  // A template that prints no message: each reply would be the same text, the second inside the
  // first.
  expect_error(
      [&] {
        split(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": "
            "\"assistant\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"r\"}, "
            "{\"role\": \"assistant\", \"content\": \"b\"}]}\n",
            chat_options("head{% if not add_generation_prompt %} tail{% endif %}"));
      },
      {"chat.jsonl line 1", "message 3", "ends inside the reply before it", "--chat-loss all"});
  // The template's own refusal, with its message.
  const ChatOptions strict = chat_options(
      "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') "
      "}}{% endif %}{{ m.content }}{% endfor %}");
  expect_error(
      [&] {
        split(
            "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": "
            "\"assistant\", \"content\": \"a\"}]}\n",
            strict);
      },
      {"chat.jsonl line 1", "turns.jinja", "no system role"});
  expect_error(
      [&] {
        split("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", ChatOptions{});
      },
      {"chat.jsonl line 1", "conversation needs the model's chat template", "--chat-template"});
  // A template file given alone, printing a special token only a tokenizer_config.json names.
  const ChatOptions bare = chat_options("{{ bos_token + messages[0].content }}");
  expect_error(
      [&] { split("{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\"}]}\n", bare); },
      {"chat.jsonl line 1", "'bos_token' is undefined", "tokenizer_config.json",
       "--tokenizer with the model's directory"});
}

// Encoded whole with the byte tokenizer: only the replies count; no end-of-text follows a
// conversation (its template writes each turn's end, and TRL adds none to a conversation), and
// after a plain document one does, and counts.
TEST(Conversations, OnlyRepliesCountWhenEncoded) {
  const auto t = make_byte_tokenizer();
  Document chat;
  chat.rendered = true;
  chat.text = "<u>q</u><a>ok</a>";
  chat.replies = {{11, 17}};  // "ok</a>"
  const TokenStream s = encode_documents(*t, {chat, {"", "p"}}, true);
  std::vector<uint32_t> want(chat.text.begin(), chat.text.end());
  std::vector<uint8_t> counts(11, 0);
  counts.insert(counts.end(), 6, 1);
  want.push_back('p');
  counts.push_back(1);
  want.push_back(256);
  counts.push_back(1);
  EXPECT_TRUE(s.prompted);
  EXPECT_EQ(s.tokens, want);
  EXPECT_EQ(s.counts, counts);
  // No replies (--chat-loss all): every token counts, the end-of-text too.
  chat.replies.clear();
  const TokenStream all = encode_documents(*t, {chat, {"", "p"}}, false);
  EXPECT_FALSE(all.prompted);
  EXPECT_EQ(all.counts, std::vector<uint8_t>(all.tokens.size(), 1));
}

// With a BPE tokenizer whose merges cross a reply's edge, the whole is still encoded as one
// text (as apply_chat_template does) and the token spanning the edge counts where it holds the
// reply's first byte, not where it holds its last. No tokenizer prefix: the template writes its
// own. No end-of-text follows a conversation, whether or not it ends with one.
TEST(Conversations, ATokenAcrossAReplysEdge) {
  test::TempDir tmp("strata-chat-edge");
  test::write_tokenizer_json(tmp.path, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const auto hf = open_tokenizer(tmp.path.string());
  const uint32_t eos = *hf->eos_id();
  Document d;
  d.rendered = true;
  d.text = "ab the the";  // a b Ġthe Ġthe
  const std::vector<uint32_t> ids = hf->encode(d.text);
  ASSERT_EQ(ids.size(), 4u);
  d.replies = {{4, 8}};  // "he t": inside the first " the" and the second
  const TokenStream s = encode_documents(*hf, {d, {"", "the"}}, false);
  std::vector<uint32_t> want = ids;
  const std::vector<uint32_t> bos = hf->prefix_ids();
  want.insert(want.end(), bos.begin(), bos.end());
  for (uint32_t id : hf->encode("the")) want.push_back(id);
  EXPECT_EQ(s.tokens, want);
  ASSERT_GE(s.counts.size(), 4u);
  EXPECT_EQ(std::vector<uint8_t>(s.counts.begin(), s.counts.begin() + 4),
            (std::vector<uint8_t>{0, 0, 1, 0}));
  EXPECT_FALSE(std::count(s.tokens.begin(), s.tokens.end(), eos)) << "none after the conversation";

  Document ended;
  ended.rendered = true;
  ended.text = "the<|endoftext|>";
  ended.replies = {{0, ended.text.size()}};
  const TokenStream e = encode_documents(*hf, {ended, ended}, true);
  const std::vector<uint32_t> once = hf->encode(ended.text);
  ASSERT_EQ(once.back(), eos);
  std::vector<uint32_t> twice = once;
  twice.insert(twice.end(), once.begin(), once.end());
  EXPECT_EQ(e.tokens, twice);
  EXPECT_EQ(e.counts, std::vector<uint8_t>(twice.size(), 1));
}

// A prompt and its completion are encoded together, as TRL encodes them (and as the model
// reads them when it answers), and as many tokens as the prompt alone makes are not trained on:
// "a" + " the" is a, Ġthe with Ġthe counted; "a " + "the" is a, Ġthe too, where encoding them
// apart made a, Ġ, t, h, e; there the prompt's two tokens are its count (Ġthe masked, as TRL
// masks it) and the row is counted as straddling. Text that already ends with end-of-text gets
// no second one, as TRL's add_eos checks.
TEST(PromptCompletion, EncodedTogetherAsTrlDoes) {
  test::TempDir tmp("strata-prompt-joint");
  test::write_tokenizer_json(tmp.path, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const auto hf = open_tokenizer(tmp.path.string());
  const uint32_t eos = *hf->eos_id();
  const std::vector<uint32_t> bos = hf->prefix_ids();
  const std::vector<uint32_t> joint = hf->encode("a the");
  ASSERT_EQ(joint.size(), 2u);             // a Ġthe
  ASSERT_EQ(hf->encode("a ").size(), 2u);  // a Ġ
  for (const auto& [prompt, completion, straddling] :
       {std::tuple{"a", " the", 0}, std::tuple{"a ", "the", 1}}) {
    SCOPED_TRACE(prompt);
    const TokenStream s = encode_documents(*hf, {Document{prompt, completion}}, true);
    std::vector<uint32_t> want = bos;
    want.insert(want.end(), joint.begin(), joint.end());
    want.push_back(eos);
    EXPECT_EQ(s.tokens, want);
    std::vector<uint8_t> counts(bos.size() + 1, 0);
    counts.push_back(straddling ? 0 : 1);  // Ġthe
    counts.push_back(1);                   // end-of-text
    EXPECT_EQ(s.counts, counts);
    EXPECT_EQ(s.straddling, uint64_t(straddling));
  }
  // Already ended: one end-of-text between the two documents, not two.
  const TokenStream e =
      encode_documents(*hf, {Document{"q", " the<|endoftext|>"}, Document{"", "the"}}, false);
  EXPECT_EQ(std::count(e.tokens.begin(), e.tokens.end(), eos), 1) << "one end-of-text";
}

// tokenize_files renders conversations a batch at a time on every core: for any batch size the
// stream and masks of rendering each as it is read, and the first bad conversation in order named
// however the work was spread.
TEST(Conversations, RenderedInBatchesAsWhenRead) {
  test::TempDir tmp("strata-chat-batches");
  const fs::path a = tmp.path / "a.txt", b = tmp.path / "b.jsonl";
  std::ofstream(a) << "plain first\n";
  std::string rows;
  for (int i = 0; i < 6; ++i)
    rows += fmt::format(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"q{0}\"}}, {{\"role\": "
        "\"assistant\", \"content\": \"a{0}\"}}]}}\n{{\"prompt\": \"P{0}\", \"completion\": "
        "\"C{0}\"}}\n",
        i);
  std::ofstream(b) << rows;
  const ChatOptions chat = chat_options(kTurns);
  std::vector<Document> docs = {{"", "plain first\n"}};
  for (Document& d : split_documents(rows, DocumentFormat::jsonl, b.string(), &chat))
    docs.push_back(std::move(d));
  ASSERT_EQ(docs.size(), 13u);
  const auto t = make_byte_tokenizer();
  const TokenStream want = encode_documents(*t, docs, false);
  for (const uint64_t batch : {uint64_t{1}, uint64_t{60}, uint64_t{1} << 20}) {
    SCOPED_TRACE(batch);
    const fs::path out = tmp.path / fmt::format("out{}.bin", batch);
    const TokenizedFiles r = tokenize_files(*t, {a, b}, out, {.batch_bytes = batch, .chat = &chat});
    EXPECT_EQ(r.documents, 13u);
    EXPECT_EQ(r.conversations, 6u);
    EXPECT_EQ(r.prompted, 12u);
    EXPECT_EQ(read_all(r.files), want.tokens);
    EXPECT_EQ(read_masks(r.files), want.counts);
  }
  const fs::path bad = tmp.path / "bad.jsonl";
  std::ofstream(bad) << rows.substr(0, rows.find('\n') + 1)
                     << "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n"
                        "{\"messages\": [{\"role\": \"user\", \"content\": \"y\"}]}\n";
  for (const uint64_t batch : {uint64_t{1}, uint64_t{1} << 20})
    expect_error(
        [&] {
          tokenize_files(*t, {bad}, tmp.path / "bad.bin", {.batch_bytes = batch, .chat = &chat});
        },
        {"bad.jsonl line 2", "no assistant message"});
  EXPECT_FALSE(fs::exists(tmp.path / "bad.bin"));
}

// Where the template comes from: the tokenizer's directory (chat_template.jinja before
// tokenizer_config.json's), named templates ("default", and "tool_use" when tools are given),
// --chat-template; the special tokens it prints from tokenizer_config.json, each one token.
TEST(Conversations, TheTemplateAndItsTokensAreFound) {
  test::TempDir tmp("strata-chat-format");
  test::write_tokenizer_json(tmp.path, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const auto hf = open_tokenizer(tmp.path.string());
  EXPECT_EQ(hf->special_piece(259), "<|endoftext|>");
  EXPECT_FALSE(hf->special_piece(258).has_value());
  EXPECT_FALSE(open_chat_format(*hf, tmp.path.string()).has_value());
  const nlohmann::json msgs = nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}});
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(msgs.dump());

  nlohmann::json config = {{"bos_token", "<|begin_of_text|>"},
                           {"eos_token", {{"content", "<|endoftext|>"}, {"special", true}}},
                           {"chat_template",
                            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}"
                            "{% endfor %}"}};
  std::ofstream(tmp.path / "tokenizer_config.json") << config.dump();
  const std::optional<ChatFormat> f = open_chat_format(*hf, (tmp.path / "tokenizer.json").string());
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->source, (tmp.path / "tokenizer_config.json").string());
  EXPECT_EQ(f->render(messages, nullptr, false), "<|begin_of_text|>hi<|endoftext|>");

  config["chat_template"] =
      nlohmann::json::array({{{"name", "default"}, {"template", "D{{ messages|length }}"}},
                             {{"name", "tool_use"}, {"template", "T{{ tools|length }}"}}});
  std::ofstream(tmp.path / "tokenizer_config.json") << config.dump();
  const std::optional<ChatFormat> named = open_chat_format(*hf, tmp.path.string());
  ASSERT_TRUE(named.has_value());
  EXPECT_EQ(named->render(messages, nullptr, false), "D1");
  EXPECT_EQ(named->render(messages, nlohmann::ordered_json::parse("[{\"name\": \"f\"}]"), false),
            "T1");

  std::ofstream(tmp.path / "chat_template.jinja") << "J{{ bos_token }}\n";
  const std::optional<ChatFormat> jinja = open_chat_format(*hf, tmp.path.string());
  ASSERT_TRUE(jinja.has_value());
  EXPECT_EQ(jinja->render(messages, nullptr, false), "J<|begin_of_text|>");

  const fs::path other = tmp.path / "other.jinja";
  std::ofstream(other) << "O{{ eos_token }}";
  const std::optional<ChatFormat> given = open_chat_format(*hf, tmp.path.string(), other.string());
  ASSERT_TRUE(given.has_value());
  EXPECT_EQ(given->render(messages, nullptr, false), "O<|endoftext|>");

  // A special token the tokenizer reads as several: no matter where no template prints it (a pad
  // token the vocabulary lacks), refused, naming it, where one does.
  config["pad_token"] = "<pad>";
  std::ofstream(tmp.path / "tokenizer_config.json") << config.dump();
  EXPECT_TRUE(open_chat_format(*hf, tmp.path.string()).has_value());
  config["bos_token"] = "<s>";
  std::ofstream(tmp.path / "tokenizer_config.json") << config.dump();
  expect_error([&] { open_chat_format(*hf, tmp.path.string()); },
               {"bos_token", "\"<s>\"", "3 tokens", "use the model's tokenizer.json"});
  // A template that does not parse: named with its line.
  std::ofstream(tmp.path / "chat_template.jinja") << "line one\n{% if x %}never closed";
  expect_error([&] { open_chat_format(*hf, tmp.path.string()); },
               {"chat_template.jinja line 2", "never closed"});
}

}  // namespace
}  // namespace strata
