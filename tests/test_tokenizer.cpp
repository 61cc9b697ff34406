// test_tokenizer.cpp: the byte tokenizer (every byte, end-of-text, out-of-vocabulary ids named),
// how documents are split (.txt whole or by '%' lines, .jsonl "text" per line, errors naming the
// line), the end-of-text between documents, and a SentencePiece model trained here with the
// library's own trainer on text the test writes: encode/decode round trip and its end-of-text.
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
  EXPECT_EQ(split_documents("one\ndocument\n\nwith a blank line\n", DocumentFormat::text, "a.txt"),
            std::vector<std::string>{"one\ndocument\n\nwith a blank line\n"});
  EXPECT_EQ(split_documents("first\nfortune\n%\nsecond 50%\n%\r\n%\nthird", DocumentFormat::text,
                            "fortunes"),
            (std::vector<std::string>{"first\nfortune\n", "second 50%\n", "third"}));
  EXPECT_TRUE(split_documents("", DocumentFormat::text, "empty.txt").empty());
  EXPECT_TRUE(split_documents("%\n%\n", DocumentFormat::text, "x").empty());
  EXPECT_EQ(document_format_of("data/x.jsonl"), DocumentFormat::jsonl);
  EXPECT_EQ(document_format_of("data/x.txt"), DocumentFormat::text);
  EXPECT_EQ(document_format_of("/usr/share/games/fortunes/art"), DocumentFormat::text);
}

TEST(Documents, JsonlHoldsOneTextPerLine) {
  EXPECT_EQ(split_documents("{\"text\": \"a\\nb\", \"id\": 1}\n\n  \n{\"text\": \"c\"}\r\n"
                            "{\"text\": \"\"}\n{\"text\": \"d\"}",
                            DocumentFormat::jsonl, "d.jsonl"),
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
  const std::vector<uint32_t> stream = tokenize_documents(*t, {"the fox", "the dog"}, true);
  EXPECT_EQ(std::count(stream.begin(), stream.end(), *t->eos_id()), 2);
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
