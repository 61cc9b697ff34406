// test_hf_tokenizer.cpp: Hugging Face tokenizer.json files (train/hf_tokenizer.cpp).
// - Small files written here whose ids are worked out by hand: GPT-2's byte-level alphabet and
//   merge order, Llama 2's normalizers and byte fallback, added tokens, prefixes, end-of-text.
// - Bad and unsupported files, each refused naming its place in the file.
// - Files in the layouts of Llama 3, Llama 2, GPT-2 and Mistral with vocabularies trained by
//   tests/reference/bpe_reference.py, against that script's independent encoder and decoder
//   (Python's regex module, a naive merge loop) over multilingual text: every id, the decoded
//   text, the prefix and end-of-text. Skips, with a message, where Python's regex module is
//   missing (Debian's python3-regex).
#include "hf_tokenizer_testing.h"
#include "testing.h"
#include "train/tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::expect_error;

class HfTokenizerTest : public ::testing::Test {
 protected:
  test::TempDir tmp_{"strata-hf-tokenizer"};

  std::string write(const std::string& name, const json& tokenizer, const json& config = json()) {
    const fs::path dir = tmp_.path / name;
    fs::create_directories(dir);
    std::ofstream(dir / "tokenizer.json") << tokenizer.dump(1);
    if (!config.is_null()) std::ofstream(dir / "tokenizer_config.json") << config.dump();
    return (dir / "tokenizer.json").string();
  }

  static json gpt2_like() { return test::gpt2_like_tokenizer(); }

  // Llama 2's fast-tokenizer layout over a vocabulary of a few pieces.
  static json llama2_like() {
    json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
    for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
    const char* sp = "\xe2\x96\x81";  // ▁
    vocab[sp] = 259;
    vocab["h"] = 260;
    vocab["i"] = 261;
    vocab[std::string(sp) + "h"] = 262;
    vocab[std::string(sp) + "hi"] = 263;
    json specials = json::array();
    for (int i = 0; i < 3; ++i)
      specials.push_back({{"id", i},
                          {"content", i == 0   ? "<unk>"
                                      : i == 1 ? "<s>"
                                               : "</s>"},
                          {"special", true}});
    return json{
        {"added_tokens", specials},
        {"normalizer",
         {{"type", "Sequence"},
          {"normalizers",
           json::array({{{"type", "Prepend"}, {"prepend", sp}},
                        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}})}}},
        {"pre_tokenizer", nullptr},
        {"post_processor",
         {{"type", "TemplateProcessing"},
          {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
          {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
        {"decoder",
         {{"type", "Sequence"},
          {"decoders",
           json::array({{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
                        {{"type", "ByteFallback"}},
                        {{"type", "Fuse"}},
                        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
        {"model",
         {{"type", "BPE"},
          {"unk_token", "<unk>"},
          {"byte_fallback", true},
          {"fuse_unk", true},
          {"vocab", vocab},
          {"merges",
           json::array({json::array({sp, "h"}), json::array({std::string(sp) + "h", "i"})})}}}};
  }
};

TEST_F(HfTokenizerTest, ByteLevelBpeMergesInRankOrderOverGpt2sAlphabet) {
  const auto t = open_tokenizer(write("gpt2", gpt2_like()));
  EXPECT_EQ(t->vocab_size(), 260);
  EXPECT_EQ(t->eos_id(), 259u);  // no tokenizer_config.json: <|endoftext|> by name
  EXPECT_TRUE(t->prefix_ids().empty());
  // " the" is one word "Ġthe": Ġ+t (rank 0), h+e (rank 1), then Ġt+he (rank 2).
  EXPECT_EQ(t->encode(" the cat"), (std::vector<uint32_t>{258, ' ', 'c', 'a', 't'}));
  // "the" without its space has no "Ġ t" merge to start from: t, he.
  EXPECT_EQ(t->encode("the"), (std::vector<uint32_t>{'t', 257}));
  // Every byte maps to its own character and back: control bytes, a tab, a newline, UTF-8.
  EXPECT_EQ(t->encode("\t\n"), (std::vector<uint32_t>{'\t', '\n'}));
  EXPECT_EQ(t->encode("\xc3\xa9"), (std::vector<uint32_t>{0xc3, 0xa9}));  // é, two bytes
  EXPECT_EQ(t->decode(std::vector<uint32_t>{258, ' ', 'c', 'a', 't', 259}), " the cat");
  // GPT-2's regex: contractions, letters, digits and punctuation each a word.
  EXPECT_EQ(t->encode("it's 42!"),
            (std::vector<uint32_t>{'i', 't', '\'', 's', ' ', '4', '2', '!'}));
  // The added token is cut out of the raw text first, and skipped when decoding.
  EXPECT_EQ(t->encode("a<|endoftext|> the"), (std::vector<uint32_t>{'a', 259, 258}));
  std::string all;
  for (int b = 1; b < 256; ++b)
    if (b < 0x80) all.push_back(static_cast<char>(b));
  EXPECT_EQ(t->decode(t->encode(all)), all);
  expect_error(
      [&] {
        t->decode(std::vector<uint32_t>{7, 260});
      },
      {"id 260", "position 1", "outside its vocabulary of 260"});
  expect_error([&] { t->encode("ab\xff"); }, {"not valid UTF-8", "byte 2", "0xff"});
}

TEST_F(HfTokenizerTest, Llama2sNormalizersAndByteFallback) {
  const auto t =
      open_tokenizer(write("llama2", llama2_like(), {{"eos_token", {{"content", "</s>"}}}}));
  EXPECT_EQ(t->prefix_ids(), (std::vector<uint32_t>{1}));
  EXPECT_TRUE(t->suffix_ids().empty());
  EXPECT_EQ(t->eos_id(), 2u);
  // "hi" -> "▁hi" -> ▁+h (rank 0) -> ▁h+i (rank 1).
  EXPECT_EQ(t->encode("hi"), (std::vector<uint32_t>{263}));
  // é is not in the vocabulary: its UTF-8 bytes C3 A9 as <0xC3> <0xA9> (3 + byte).
  EXPECT_EQ(t->encode("hi \xc3\xa9"), (std::vector<uint32_t>{263, 259, 3 + 0xc3, 3 + 0xa9}));
  EXPECT_EQ(t->decode(std::vector<uint32_t>{1, 263, 259, 3 + 0xc3, 3 + 0xa9}), "hi \xc3\xa9");
  // A byte run that is not UTF-8 decodes to one U+FFFD per byte, as the library does.
  EXPECT_EQ(t->decode(std::vector<uint32_t>{263, 3 + 0xc3}), "hi\xef\xbf\xbd");
  // <s> in the text is the special token; the text after it is normalized on its own.
  EXPECT_EQ(t->encode("<s>hi"), (std::vector<uint32_t>{1, 263}));
  // Documents: <s> before each, </s> between them.
  EXPECT_EQ(tokenize_documents(*t, {"hi", "hi"}, true),
            (std::vector<uint32_t>{1, 263, 2, 1, 263, 2}));
}

TEST_F(HfTokenizerTest, AddedTokensStripWhitespaceWhereAsked) {
  json j = gpt2_like();
  j["added_tokens"].push_back(
      {{"id", 260}, {"content", "<mask>"}, {"lstrip", true}, {"rstrip", true}, {"special", false}});
  j["added_tokens"].push_back({{"id", 261}, {"content", "<mask>x"}, {"special", true}});
  const auto t = open_tokenizer(write("added", j, {{"eos_token", "<|endoftext|>"}}));
  EXPECT_EQ(t->vocab_size(), 262);
  // lstrip/rstrip take the spaces beside <mask> with it.
  EXPECT_EQ(t->encode("a  <mask>  b"), (std::vector<uint32_t>{'a', 260, 'b'}));
  // The longest added token wins where two start at the same place.
  EXPECT_EQ(t->encode("<mask>x"), (std::vector<uint32_t>{261}));
  // Non-special added tokens decode to their text; special ones to nothing.
  EXPECT_EQ(t->decode(std::vector<uint32_t>{'a', 260, 261, 'b'}), "a<mask>b");
}

TEST_F(HfTokenizerTest, AnUnknownCharacterIsTheUnkTokenOrAnError) {
  json j = llama2_like();
  j["model"]["byte_fallback"] = false;
  const auto t = open_tokenizer(write("unk", j));
  // é and ü are both unknown: fused into one <unk> (fuse_unk).
  EXPECT_EQ(t->encode("hi \xc3\xa9\xc3\xbc"), (std::vector<uint32_t>{263, 259, 0}));
  j["model"]["unk_token"] = nullptr;
  const auto strict = open_tokenizer(write("no-unk", j));
  expect_error([&] { strict->encode("hi \xc3\xa9"); },
               {"\"\xc3\xa9\"", "c3 a9", "not in the vocabulary", "unk_token"});
}

// Split's five behaviours, as the library's SplitDelimiterBehavior cuts "a--b-c" at "-", seen
// through merges that only join characters within one word: a+- (4), -+- (5), -+b (6), -+c (7).
TEST_F(HfTokenizerTest, SplitBehavesAsTheLibraryCuts) {
  const json vocab = {{"a", 0},  {"b", 1},  {"c", 2},  {"-", 3},
                      {"a-", 4}, {"--", 5}, {"-b", 6}, {"-c", 7}};
  const auto ids = [&](const char* behavior, bool invert) {
    const json j = {{"pre_tokenizer",
                     {{"type", "Split"},
                      {"pattern", {{"String", "-"}}},
                      {"behavior", behavior},
                      {"invert", invert}}},
                    {"model",
                     {{"type", "BPE"},
                      {"vocab", vocab},
                      {"merges", json::array({"a -", "- -", "- b", "- c"})}}}};
    return open_tokenizer(write(std::string(behavior) + (invert ? "-inverted" : ""), j))
        ->encode("a--b-c");
  };
  using V = std::vector<uint32_t>;
  EXPECT_EQ(ids("Removed", false), (V{0, 1, 2}));                   // a b c
  EXPECT_EQ(ids("Isolated", false), (V{0, 3, 3, 1, 3, 2}));         // a - - b - c
  EXPECT_EQ(ids("MergedWithPrevious", false), (V{4, 3, 1, 3, 2}));  // a- - b- c
  EXPECT_EQ(ids("MergedWithNext", false), (V{0, 3, 6, 7}));         // a - -b -c
  EXPECT_EQ(ids("Contiguous", false), (V{0, 5, 1, 3, 2}));          // a -- b - c
  EXPECT_EQ(ids("Removed", true), (V{3, 3, 3}));                    // the matches kept: - - -
  EXPECT_EQ(ids("Isolated", true), (V{0, 3, 3, 1, 3, 2}));
}

TEST_F(HfTokenizerTest, AModelDirectoryGivesItsTokenizer) {
  const std::string file = write("model", llama2_like(), {{"eos_token", "</s>"}});
  const fs::path dir = fs::path(file).parent_path();
  const auto t = open_tokenizer(dir.string());
  EXPECT_EQ(t->name(), (dir / "tokenizer.json").string());
  EXPECT_EQ(t->encode("hi"), (std::vector<uint32_t>{263}));
  fs::create_directories(tmp_.path / "empty");
  expect_error([&] { open_tokenizer((tmp_.path / "empty").string()); },
               {"empty", "neither tokenizer.json nor tokenizer.model"});
}

TEST_F(HfTokenizerTest, BadOrUnsupportedFilesAreNamedByTheirPlace) {
  const auto refused = [&](const std::string& name, const json& j,
                           std::initializer_list<std::string> parts) {
    const std::string path = write(name, j);
    SCOPED_TRACE(name);
    expect_error([&] { open_tokenizer(path); }, parts);
  };
  json j = gpt2_like();
  j["model"]["type"] = "WordPiece";
  refused("wordpiece", j, {"/model/type", "\"WordPiece\"", "tokenizer.model"});
  j = gpt2_like();
  j["normalizer"] = {{"type", "BertNormalizer"}};
  refused("bert", j, {"/normalizer/type", "\"BertNormalizer\"", "not supported", "NFKC"});
  j = gpt2_like();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({{{"type", "ByteLevel"}}, {{"type", "BertPreTokenizer"}}})}};
  refused("bert", j, {"/pre_tokenizer/pretokenizers/1/type", "BertPreTokenizer"});
  j = gpt2_like();
  j["model"]["merges"].push_back("h zz");
  refused("merge", j, {"/model/merges/3", "\"zz\"", "not in the vocabulary"});
  j = gpt2_like();
  j["model"]["merges"][1] = "h e x";
  refused("merge-form", j, {"/model/merges/1", "two pieces"});
  j = gpt2_like();
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  refused("regex", j, {"/pre_tokenizer/pattern", "does not compile", "(unclosed"});
  j = gpt2_like();
  j["model"]["dropout"] = 0.1;
  refused("dropout", j, {"/model/dropout", "0.1"});
  j = gpt2_like();
  j["decoder"] = {{"type", "WordPiece"}};
  refused("decoder", j, {"/decoder/type", "WordPiece"});
  j = gpt2_like();
  j.erase("model");
  refused("no-model", j, {"no \"model\""});
  j = gpt2_like();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", 5}};
  refused("sequence", j, {"/normalizer", "\"normalizers\" is number, not an array"});
  j = gpt2_like();  // a value of an unexpected type deep inside: still an Error naming the file
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", 5}}}}})}};
  refused("type", j, {"type/tokenizer.json", "not a tokenizer.json strata can read"});
  const std::string file = write("config", gpt2_like(), {{"eos_token", "<|im_end|>"}});
  expect_error([&] { open_tokenizer(file); },
               {"tokenizer_config.json", "eos_token \"<|im_end|>\"", "not a token"});
  const fs::path junk = tmp_.path / "junk" / "tokenizer.json";
  fs::create_directories(junk.parent_path());
  std::ofstream(junk) << "{\"model\": ";
  expect_error([&] { open_tokenizer(junk.string()); }, {"junk/tokenizer.json", "not valid JSON"});
}

// ---- against tests/reference/bpe_reference.py ------------------------------------------------

class HfTokenizerReference : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string script = std::string(STRATA_REFERENCE_DIR) + "/bpe_reference.py";
    python_ = std::string("'") + STRATA_PYTHON + "' '" + script + "'";
    const test::CommandResult probe =
        test::run_command(python_ + " texts '" + (tmp_.path / "texts.json").string() + "'");
    if (probe.status == 77)
      GTEST_SKIP() << "Python's regex module is missing; install python3-regex to compare "
                      "with the reference";
    ASSERT_EQ(probe.status, 0) << probe.out;
  }
  std::string python_;
  test::TempDir tmp_{"strata-bpe-reference"};
};

TEST_P(HfTokenizerReference, EveryIdAndDecodedTextAgree) {
  const std::string style = GetParam();
  const fs::path dir = tmp_.path / style;
  const test::CommandResult made =
      test::run_command(python_ + " make '" + dir.string() + "' " + style + " 2>&1");
  ASSERT_EQ(made.status, 0) << made.out;
  const fs::path texts_path = tmp_.path / "texts.json", out_path = tmp_.path / (style + ".json");
  const test::CommandResult ran =
      test::run_command(python_ + " encode '" + dir.string() + "' '" + texts_path.string() + "' '" +
                        out_path.string() + "' 2>&1");
  ASSERT_EQ(ran.status, 0) << ran.out;
  const json texts = json::parse(std::ifstream(texts_path));
  const json ref = json::parse(std::ifstream(out_path));

  const auto t = open_tokenizer(dir.string());
  EXPECT_EQ(t->vocab_size(), ref["vocab_size"].get<int64_t>());
  EXPECT_EQ(t->prefix_ids(), ref["prefix"].get<std::vector<uint32_t>>());
  EXPECT_EQ(t->suffix_ids(), ref["suffix"].get<std::vector<uint32_t>>());
  ASSERT_FALSE(ref["eos"].is_null());
  EXPECT_EQ(t->eos_id(), ref["eos"].get<uint32_t>());
  size_t tokens = 0, merged = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    SCOPED_TRACE(style + " text " + std::to_string(i) + ": " + json(text).dump());
    const std::vector<uint32_t> ids = t->encode(text);
    EXPECT_EQ(ids, ref["ids"][i].get<std::vector<uint32_t>>());
    EXPECT_EQ(t->decode(ids), ref["decoded"][i].get<std::string>());
    tokens += ids.size();
    merged += text.size();
  }
  // The trained merges do their work: fewer tokens than bytes overall.
  EXPECT_LT(tokens, merged * 3 / 4) << tokens << " tokens for " << merged << " bytes";
}

INSTANTIATE_TEST_SUITE_P(Layouts, HfTokenizerReference,
                         ::testing::Values("llama3", "llama2", "gpt2", "gpt2_nfkc", "qwen2",
                                           "metaspace", "metaspace_split"));

}  // namespace
}  // namespace strata
