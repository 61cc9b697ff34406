// test_data_loader.cpp: the training data loader over token files whose every token is its own
// position (plus an offset per file), so each batch row names the sequence it came from:
// determinism, seeds, every sequence once per epoch across batch and epoch boundaries, resume
// from saved JSON equal to the uninterrupted run, several files, the eval sequences in order,
// the generator pinned to published and recorded values, and bad inputs named.
#include "testing.h"
#include "core/kernels.h"
#include "train/data_loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

namespace strata {
namespace {

namespace fs = std::filesystem;
using test::expect_error;

constexpr int64_t kT = 4;

class DataLoaderTest : public ::testing::Test {
 protected:
  // A file of `count` tokens: offset, offset + 1, ...
  fs::path tokens(const std::string& name, uint32_t offset, uint32_t count) {
    std::vector<uint32_t> t(count);
    for (uint32_t i = 0; i < count; ++i) t[i] = offset + i;
    const fs::path p = dir_ / name;
    write_llmc_tokens(p, t, TokenWidth::u16);
    return p;
  }

  test::TempDir tmp_{"strata-data-loader"};
  const fs::path& dir_ = tmp_.path;
};

struct Batch {
  std::vector<int32_t> ids, targets;
};

Batch next(DataLoader& d, int64_t batch) {
  Batch b{std::vector<int32_t>(batch * kT), std::vector<int32_t>(batch * kT)};
  d.next(batch, b.ids, b.targets);
  return b;
}

// The first token of each row: the sequence's identity in these files.
std::vector<int32_t> firsts(const Batch& b) {
  std::vector<int32_t> f;
  for (size_t r = 0; r < b.ids.size() / kT; ++r) f.push_back(b.ids[r * kT]);
  return f;
}

TEST(DataGenerator, SplitMix64MatchesItsPublishedOutputAndTheOrderIsPinned) {
  SplitMix64 sm(0);
  EXPECT_EQ(sm.next(), 0xe220a8397b1dcdafull);
  EXPECT_EQ(sm.next(), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(sm.next(), 0x06c45d188009454full);
  // Recorded from this definition (xoshiro256** over splitmix64, Fisher-Yates, rejection):
  // a change here changes every run's batches, and resumed runs would no longer match.
  Xoshiro256 x(0);
  EXPECT_EQ(x.next(), 0x99ec5f36cb75f2b4ull);
  EXPECT_EQ(x.next(), 0xbf6e1f784956452aull);
  EXPECT_EQ(x.next(), 0x1a5f849d4933e6e0ull);
  EXPECT_EQ(epoch_order(1234, 0, 10), (std::vector<int64_t>{5, 1, 3, 4, 2, 6, 0, 9, 7, 8}));
  EXPECT_EQ(epoch_order(1234, 1, 10), (std::vector<int64_t>{8, 7, 3, 9, 4, 5, 2, 6, 1, 0}));
  EXPECT_EQ(epoch_order(~0ull, 7, 12),
            (std::vector<int64_t>{4, 6, 9, 0, 10, 3, 7, 1, 2, 5, 8, 11}));
  EXPECT_TRUE(epoch_order(1, 0, 0).empty());
  EXPECT_EQ(epoch_order(1, 0, 1), std::vector<int64_t>{0});
}

TEST(DataGenerator, BelowStaysInRangeAndCoversIt) {
  Xoshiro256 x(42);
  std::map<uint64_t, int> seen;
  for (int i = 0; i < 6000; ++i) {
    const uint64_t v = x.below(6);
    ASSERT_LT(v, 6u);
    ++seen[v];
  }
  EXPECT_EQ(seen.size(), 6u);
  for (const auto& [v, n] : seen) EXPECT_NEAR(n, 1000, 150) << v;
  EXPECT_EQ(x.below(1), 0u);
  const uint64_t big = (1ull << 63) + 12345;  // rejection matters most here
  for (int i = 0; i < 100; ++i) EXPECT_LT(x.below(big), big);
}

TEST_F(DataLoaderTest, EverySequenceOncePerEpochAcrossBatchAndEpochBoundaries) {
  // 10 sequences of 4: 41 tokens; batches of 3 straddle the epoch ends.
  DataLoader d({tokens("a.bin", 0, 41)}, kT, 1000, 7);
  EXPECT_EQ(d.num_sequences(), 10);
  std::vector<int32_t> all;
  for (int b = 0; b < 10; ++b) {
    const Batch x = next(d, 3);
    for (size_t r = 0; r < 3; ++r)
      for (int64_t j = 0; j < kT; ++j) {
        EXPECT_EQ(x.ids[r * kT + j], x.ids[r * kT] + j);  // a whole sequence
        EXPECT_EQ(x.targets[r * kT + j], x.ids[r * kT + j] + 1);
      }
    const std::vector<int32_t> f = firsts(x);
    all.insert(all.end(), f.begin(), f.end());
  }
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<int32_t> s(all.begin() + epoch * 10, all.begin() + epoch * 10 + 10);
    EXPECT_EQ(s.size(), 10u) << "epoch " << epoch;
    for (int32_t v : s) EXPECT_EQ(v % kT, 0);
  }
  // Epochs are shuffled differently.
  EXPECT_NE(std::vector<int32_t>(all.begin(), all.begin() + 10),
            std::vector<int32_t>(all.begin() + 10, all.begin() + 20));
  EXPECT_EQ(d.position().epoch, 3);
  EXPECT_EQ(d.position().position, 0);
}

TEST_F(DataLoaderTest, TheSameSeedGivesTheSameBatchesAndAnotherSeedOthers) {
  const fs::path a = tokens("a.bin", 0, 401);
  DataLoader d1({a}, kT, 1000, 99), d2({a}, kT, 1000, 99), d3({a}, kT, 1000, 100);
  bool differ = false;
  for (int b = 0; b < 30; ++b) {
    const Batch x = next(d1, 8), y = next(d2, 8), z = next(d3, 8);
    EXPECT_EQ(x.ids, y.ids);
    EXPECT_EQ(x.targets, y.targets);
    differ = differ || x.ids != z.ids;
  }
  EXPECT_TRUE(differ);
  // The first batch is already shuffled, not the files' order.
  DataLoader d4({a}, kT, 1000, 99);
  EXPECT_NE(firsts(next(d4, 8)), (std::vector<int32_t>{0, 4, 8, 12, 16, 20, 24, 28}));
}

TEST_F(DataLoaderTest, ResumingFromSavedJsonSeesTheSameBatches) {
  const fs::path a = tokens("a.bin", 0, 53), b = tokens("b.bin", 2000, 29);
  DataLoader whole({a, b}, kT, 4000, 5);
  std::vector<Batch> expected;
  for (int i = 0; i < 12; ++i) expected.push_back(next(whole, 5));

  for (int stop : {0, 1, 3, 4, 11}) {
    DataLoader first({a, b}, kT, 4000, 5);
    for (int i = 0; i < stop; ++i) next(first, 5);
    const std::string saved = first.position().to_json().dump();
    DataLoader resumed({a, b}, kT, 4000, 0);  // the seed comes from the saved position
    resumed.restore(DataPosition::from_json(nlohmann::json::parse(saved), "trainer.json"));
    EXPECT_EQ(resumed.position(), first.position());
    for (int i = stop; i < 12; ++i) {
      const Batch x = next(resumed, 5);
      EXPECT_EQ(x.ids, expected[i].ids) << "stop " << stop << " batch " << i;
      EXPECT_EQ(x.targets, expected[i].targets);
    }
  }
}

TEST_F(DataLoaderTest, SeveralFilesFormOneIndexSpace) {
  // 13 + 7 + 1 sequences; the last file holds exactly T + 1 tokens.
  DataLoader d({tokens("a.bin", 0, 53), tokens("b.bin", 1000, 29), tokens("c.bin", 3000, 5)}, kT,
               4000, 3);
  EXPECT_EQ(d.num_sequences(), 21);
  EXPECT_EQ(d.files().size(), 3u);
  std::set<int32_t> seen;
  for (int32_t f : firsts(next(d, 21))) seen.insert(f);
  std::set<int32_t> want;
  for (int32_t i = 0; i < 13; ++i) want.insert(i * kT);
  for (int32_t i = 0; i < 7; ++i) want.insert(1000 + i * kT);
  want.insert(3000);
  EXPECT_EQ(seen, want);
  // read() maps global indices across the files.
  std::vector<int32_t> ids(kT), targets(kT);
  d.read(13, ids.data(), targets.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1000, 1001, 1002, 1003}));
  d.read(20, ids.data(), targets.data());
  EXPECT_EQ(targets, (std::vector<int32_t>{3001, 3002, 3003, 3004}));
}

TEST_F(DataLoaderTest, EvalSequencesComeInOrder) {
  const fs::path e = tokens("eval.bin", 0, 29);  // 7 sequences
  EvalSequences ev({e}, kT, 100);
  EXPECT_EQ(ev.size(), 7);
  std::vector<int32_t> ids(3 * kT), targets(3 * kT);
  std::vector<int32_t> got;
  for (int64_t n; (n = ev.next(3, ids, targets)) > 0;)
    for (int64_t r = 0; r < n; ++r) got.push_back(ids[r * kT]);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 4, 8, 12, 16, 20, 24}));
  EXPECT_EQ(ev.next(3, ids, targets), 0);
  ev.rewind();
  EXPECT_EQ(ev.next(3, ids, targets), 3);
  EXPECT_EQ(targets[0], 1);
  EvalSequences capped({e}, kT, 100, 2);
  EXPECT_EQ(capped.size(), 2);
  EXPECT_EQ(capped.next(3, ids, targets), 2);
  // Several files: each one's sequences in turn, in the order given (a shard's leftover
  // tokens, too few for a sequence, are dropped at its end).
  const fs::path f = tokens("eval2.bin", 50, 9);  // 2 sequences
  EvalSequences both({f, e}, kT, 100);
  EXPECT_EQ(both.size(), 9);
  std::vector<int32_t> all(9 * kT), all_targets(9 * kT);
  EXPECT_EQ(both.next(9, all, all_targets), 9);
  std::vector<int32_t> firsts;
  for (int r = 0; r < 9; ++r) firsts.push_back(all[size_t(r) * kT]);
  EXPECT_EQ(firsts, (std::vector<int32_t>{50, 54, 0, 4, 8, 12, 16, 20, 24}));
  EXPECT_EQ(all_targets[size_t(kT) - 1], 54);
}

// A loss mask beside a file turns the targets it does not count into kIgnoreIndex, in the
// training batches and the evaluation sequences alike, and only in its own file; with masks off,
// or without a mask, every target is kept.
TEST_F(DataLoaderTest, LossMasksIgnoreTheTargetsTheyDoNotCount) {
  const fs::path a = tokens("a.bin", 0, 13), b = tokens("b.bin", 100, 9);  // 3 + 2 sequences
  std::vector<uint8_t> flags(13, 1);
  for (int i : {0, 1, 2, 6, 12}) flags[size_t(i)] = 0;  // token 0 is never a target
  {
    LossMaskWriter w(a, 0);
    w.write(flags);
    w.finish();
  }
  TokenSequences seq({a, b}, kT, 1000, std::nullopt, "token file");
  EXPECT_EQ(seq.masked_files(), 1);
  // a's targets are its tokens 1..12, of which 1, 2, 6 and 12 do not count; b's 8 all do.
  EXPECT_EQ(seq.counted_targets(), 8 + 8);
  std::vector<int32_t> ids(kT), targets(kT);
  seq.read(0, ids.data(), targets.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(targets, (std::vector<int32_t>{kIgnoreIndex, kIgnoreIndex, 3, 4}));
  seq.read(1, ids.data(), targets.data());
  EXPECT_EQ(targets, (std::vector<int32_t>{5, kIgnoreIndex, 7, 8}));
  seq.read(2, ids.data(), targets.data());
  EXPECT_EQ(targets, (std::vector<int32_t>{9, 10, 11, kIgnoreIndex}));
  seq.read(3, ids.data(), targets.data());
  EXPECT_EQ(targets, (std::vector<int32_t>{101, 102, 103, 104}));

  TokenSequences off({a, b}, kT, 1000, std::nullopt, "token file", false);
  EXPECT_EQ(off.masked_files(), 0);
  EXPECT_EQ(off.counted_targets(), 5 * kT);
  off.read(0, ids.data(), targets.data());
  EXPECT_EQ(targets, (std::vector<int32_t>{1, 2, 3, 4}));

  // The loader and the evaluation sequences read through the same masks.
  DataLoader d({a, b}, kT, 1000, 7);
  std::vector<int32_t> all_ids(5 * kT), all_targets(5 * kT);
  d.next(5, all_ids, all_targets);
  EXPECT_EQ(std::count(all_targets.begin(), all_targets.end(), kIgnoreIndex), 4);
  EvalSequences ev({a}, kT, 1000);
  EXPECT_EQ(ev.next(3, all_ids, all_targets), 3);
  EXPECT_EQ(std::count(all_targets.begin(), all_targets.begin() + 3 * kT, kIgnoreIndex), 4);
  DataLoader unmasked({a, b}, kT, 1000, 7, std::nullopt, false);
  unmasked.next(5, all_ids, all_targets);
  EXPECT_EQ(std::count(all_targets.begin(), all_targets.end(), kIgnoreIndex), 0);
  // A run saved over the masks does not resume without them (the same sequences, other targets),
  // and does with them; a position saved before masks existed (no count) resumes either way.
  const DataPosition saved = DataPosition::from_json(d.position().to_json(), "ckpt");
  EXPECT_EQ(saved.counted_targets, 16);
  expect_error([&] { unmasked.restore(saved); },
               {"16 targets count", "20 of these files'", "--loss-mask"});
  DataLoader again({a, b}, kT, 1000, 7);
  again.restore(saved);
  EXPECT_EQ(again.position(), d.position());
  nlohmann::json older = saved.to_json();
  older.erase("counted_targets");
  unmasked.restore(DataPosition::from_json(older, "old ckpt"));
  EXPECT_EQ(unmasked.position().counted_targets, 20);

  // A mask that counts none of a file's targets (its tokens 1..12) leaves nothing to learn.
  const fs::path c = tokens("c.bin", 0, 13);
  {
    std::vector<uint8_t> none(13, 0);
    none[0] = 1;  // the first token is never a target
    LossMaskWriter w(c, 0);
    w.write(none);
    w.finish();
  }
  expect_error([&] { DataLoader({c}, kT, 1000, 1); },
               {"training token files", "every target", "c.bin.mask", "--loss-mask off"});
  EXPECT_NO_THROW(DataLoader({c}, kT, 1000, 1, std::nullopt, false));
  EXPECT_NO_THROW(DataLoader({c, b}, kT, 1000, 1));
}

TEST_F(DataLoaderTest, BadInputsAreNamed) {
  const fs::path a = tokens("a.bin", 0, 41);
  expect_error([&] { DataLoader({a}, kT, 40, 1); }, {"a.bin", "position 40", "vocab_size is 40"});
  const fs::path short_file = tokens("short.bin", 0, 4);
  expect_error(
      [&] {
        DataLoader({a, short_file}, kT, 1000, 1);
      },
      {"short.bin", "4 tokens make no sequence of --seq-len 4", "needs 5"});
  expect_error([&] { DataLoader({a, dir_ / "missing.bin"}, kT, 1000, 1); }, {"missing.bin"});
  expect_error([&] { DataLoader({}, kT, 1000, 1); }, {"no token file", "--data"});
  expect_error([&] { EvalSequences({short_file}, kT, 1000); }, {"evaluation token file", "short"});
  expect_error([&] { EvalSequences({}, kT, 1000); }, {"no token file", "--eval-data"});

  DataLoader d({a}, kT, 1000, 1);
  std::vector<int32_t> small(kT);
  expect_error([&] { d.next(2, small, small); }, {"needs 8"});
  DataLoader other({a}, 5, 1000, 1);  // 8 sequences of 5
  expect_error([&] { d.restore(other.position()); },
               {"8 sequences of length 5", "10 of length 4", "--seq-len"});
  expect_error(
      [] {
        DataPosition::from_json(nlohmann::json::parse(R"({"seed": 1, "epoch": 0, "position": 3})"),
                                "ckpt/trainer.json");
      },
      {"ckpt/trainer.json", "\"sequences\""});
  expect_error(
      [] {
        DataPosition::from_json(nlohmann::json::parse(R"({"seed": 1, "epoch": -1, "position": 3,
                                                          "sequences": 10, "seq_len": 4})"),
                                "t.json");
      },
      {"\"epoch\" is -1"});
  expect_error(
      [] {
        DataPosition::from_json(nlohmann::json::parse(R"({"seed": 1, "epoch": 0, "position": 10,
                                                          "sequences": 10, "seq_len": 4})"),
                                "t.json");
      },
      {"position 10", "10 sequences"});
}

// Where documents start in a file, written as strata tokenize writes it.
void index(const fs::path& file, const std::vector<uint64_t>& starts) {
  DocumentIndexWriter w(file, 0);
  for (uint64_t s : starts) w.add(s);
  w.finish({file});
}

struct Row {
  std::vector<int32_t> ids, targets;
  bool operator==(const Row&) const = default;
};

Row row(const TokenSequences& s, int64_t g) {
  Row r{std::vector<int32_t>(size_t(s.seq_len())), std::vector<int32_t>(size_t(s.seq_len()))};
  s.read(g, r.ids.data(), r.targets.data());
  return r;
}

constexpr int32_t kX = kIgnoreIndex;

// --packing none: each document is a row of its own, its first T + 1 tokens, padded with id 0
// and ignored targets; a one-token document is left out; a document at the end of a file goes
// on into the next file where that one does not start with a document (a cut shard); loss masks
// still apply. The counts (targets, cuts, padding) follow from the same documents.
TEST_F(DataLoaderTest, WithoutPackingEachDocumentIsARowOfItsOwn) {
  const fs::path a = tokens("a.bin", 0, 20), b = tokens("b.bin", 100, 6);
  index(a, {0, 3, 4, 17});  // [0,3) [3,4) [4,17) [17,20)+b[0,2)
  index(b, {2});            // [102,106)
  std::vector<uint8_t> flags(20, 1);
  flags[1] = flags[18] = 0;
  {
    LossMaskWriter w(a, 0);
    w.write(flags);
    w.finish();
  }
  const TokenSequences s({a, b}, kT, 1000, std::nullopt, "token file", true, Packing::none);
  ASSERT_EQ(s.size(), 4);
  EXPECT_EQ(row(s, 0), (Row{{0, 1, 0, 0}, {kX, 2, kX, kX}}));
  EXPECT_EQ(row(s, 1), (Row{{4, 5, 6, 7}, {5, 6, 7, 8}}));  // cut after T + 1 tokens
  EXPECT_EQ(row(s, 2), (Row{{17, 18, 19, 100}, {kX, 19, 100, 101}}));
  EXPECT_EQ(row(s, 3), (Row{{102, 103, 104, 0}, {103, 104, 105, kX}}));
  EXPECT_EQ(s.counted_targets(), 1 + 4 + 3 + 3);
  EXPECT_EQ(s.truncated(), 1);
  EXPECT_EQ(s.longest(), 13);
  EXPECT_EQ(s.document_inputs(), 2 + 4 + 4 + 3);
  EXPECT_EQ(s.uncounted(), 0);
  EXPECT_EQ(s.masked_files(), 1);
  const std::string line = describe_documents(s);
  for (const char* want : {"4 documents", "1 cut after --seq-len + 1 = 5 tokens",
                           "--seq-len 12 keeps every one whole", "19% of the inputs are padding"})
    EXPECT_NE(line.find(want), std::string::npos) << line;
  // Without masks every target of the cut counts; wrapped packing reads the same files as before.
  const TokenSequences all({a, b}, kT, 1000, std::nullopt, "token file", false, Packing::none);
  EXPECT_EQ(all.counted_targets(), 13);
  EXPECT_EQ(row(all, 0), (Row{{0, 1, 0, 0}, {1, 2, kX, kX}}));
  const TokenSequences wrapped({a, b}, kT, 1000, std::nullopt, "token file", false);
  EXPECT_EQ(wrapped.size(), 4 + 1);
  EXPECT_EQ(row(wrapped, 1), (Row{{4, 5, 6, 7}, {5, 6, 7, 8}}));

  // A longer sequence keeps every document whole; a prompt that fills the cut trains on nothing.
  const TokenSequences whole({a, b}, 12, 1000, std::nullopt, "token file", true, Packing::none);
  EXPECT_EQ(whole.truncated(), 0);
  EXPECT_EQ(row(whole, 1).targets[11], 16);
  std::vector<uint8_t> prompt(20, 0);
  prompt[10] = prompt[19] = 1;
  {
    LossMaskWriter w(a, 0);
    w.write(prompt);
    w.finish();
  }
  const TokenSequences cut({a}, kT, 1000, std::nullopt, "token file", true, Packing::none);
  EXPECT_EQ(cut.size(), 3);
  EXPECT_EQ(cut.counted_targets(), 1);  // token 19; token 10 lies past the cut of [4,17)
  EXPECT_EQ(cut.uncounted(), 2);
  EXPECT_NE(describe_documents(cut).find("2 have no target that counts"), std::string::npos);
}

// --packing bfd: the same documents packed whole by best fit decreasing, each row with where
// each position's document starts (the padding its own), worked out by hand; the loader hands
// each row out once per epoch with its starts, and a reader that gives nowhere for them is
// refused.
TEST_F(DataLoaderTest, BestFitDecreasingPacksWholeDocumentsWithTheirStarts) {
  const fs::path a = tokens("a.bin", 0, 20), b = tokens("b.bin", 100, 6);
  index(a, {0, 3, 4, 17});
  index(b, {2});
  std::vector<uint8_t> flags(20, 1);
  flags[1] = flags[18] = 0;
  {
    LossMaskWriter w(a, 0);
    w.write(flags);
    w.finish();
  }
  // At T = 6 the documents take 2 ([0,3)), 6 ([4,17) cut after 7 tokens), 4 ([17,20) + b's
  // [100,102)) and 3 ([102,106)) positions. Longest first: 6 fills row 0; 4 opens row 1 (2
  // left); 3 fits nowhere and opens row 2 (3 left); 2 goes to row 1, the least room holding it.
  const int64_t T = 6;
  const TokenSequences s({a, b}, T, 1000, std::nullopt, "token file", true, Packing::bfd);
  ASSERT_EQ(s.size(), 3);
  EXPECT_EQ(s.documents(), 4);
  EXPECT_TRUE(s.packs_documents());
  const auto packed = [&](int64_t g) {
    std::vector<int32_t> ids(T), targets(T), starts(T);
    s.read(g, ids.data(), targets.data(), starts.data());
    return std::tuple{ids, targets, starts};
  };
  using V = std::vector<int32_t>;
  EXPECT_EQ(packed(0), std::tuple(V{4, 5, 6, 7, 8, 9}, V{5, 6, 7, 8, 9, 10}, V{0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(packed(1),
            std::tuple(V{17, 18, 19, 100, 0, 1}, V{kX, 19, 100, 101, kX, 2}, V{0, 0, 0, 0, 4, 4}));
  EXPECT_EQ(packed(2), std::tuple(V{102, 103, 104, 0, 0, 0}, V{103, 104, 105, kX, kX, kX},
                                  V{0, 0, 0, 3, 3, 3}));
  EXPECT_EQ(s.counted_targets(), 6 + 3 + 1 + 3);
  EXPECT_EQ(s.document_inputs(), 15);
  EXPECT_EQ(s.truncated(), 1);
  const std::string line = describe_documents(s);
  for (const char* want : {"4 documents packed into 3 sequences by best fit decreasing",
                           "--packing bfd", "17% of the inputs are padding"})
    EXPECT_NE(line.find(want), std::string::npos) << line;
  std::vector<int32_t> ids(T), targets(T);
  expect_error([&] { s.read(0, ids.data(), targets.data()); }, {"sequence 0 packs documents"});

  // Each row once per epoch, with its starts; the position records the packing.
  DataLoader d({a, b}, T, 1000, 5, std::nullopt, true, Packing::bfd);
  std::vector<int32_t> all_ids(3 * T), all_targets(3 * T), all_starts(3 * T);
  d.next(3, all_ids, all_targets, all_starts);
  std::multiset<int32_t> firsts;
  for (int r = 0; r < 3; ++r) {
    firsts.insert(all_ids[size_t(r * T)]);
    if (all_ids[size_t(r * T)] == 17) {
      EXPECT_EQ(std::vector<int32_t>(all_starts.begin() + r * T, all_starts.begin() + r * T + T),
                (V{0, 0, 0, 0, 4, 4}));
    }
  }
  EXPECT_EQ(firsts, (std::multiset<int32_t>{4, 17, 102}));
  EXPECT_EQ(d.position().packing, Packing::bfd);
  expect_error([&] { d.next(1, all_ids, all_targets); }, {"training batch", "needs 6"});
  EXPECT_EQ(parse_packing("bfd"), Packing::bfd);
  expect_error([] { parse_packing("packed", "--packing"); }, {"--packing packed", "bfd"});
}

// The index of a sharded stream has a file per shard (empty where no document starts), is bound
// to its tokens, and what is wrong with it is named; --packing none over files without one is
// refused, saying how to get one; auto picks none only for indexed files with loss masks; the
// loader hands out every document once per epoch, and a position saved with one packing does
// not resume with the other.
TEST_F(DataLoaderTest, DocumentIndexesAreBoundToTheirTokensAndBadOnesNamed) {
  std::vector<uint32_t> stream(20);
  for (uint32_t i = 0; i < 20; ++i) stream[i] = 500 + i;
  LlmcTokenWriter tw(dir_ / "s.bin", TokenWidth::u16, 8);
  DocumentIndexWriter dw(dir_ / "s.bin", 8);
  tw.write(stream);
  for (uint64_t at : {0, 5, 17}) dw.add(at);
  expect_error([&] { dw.add(17); }, {"s.bin", "start 17 is not above the last, 17"});
  const std::vector<fs::path> shards = tw.finish();
  ASSERT_EQ(shards.size(), 3u);
  const std::vector<fs::path> indexes = dw.finish(shards);
  ASSERT_EQ(indexes.size(), 3u);
  EXPECT_EQ(indexes[1], dir_ / "s_000001.bin.docs");
  const auto open = [](const fs::path& f) {
    return DocumentIndex::open_beside(TokenFile::open(f, std::nullopt));
  };
  EXPECT_EQ(open(shards[0])->size(), 2);
  EXPECT_EQ(open(shards[1])->size(), 0);
  EXPECT_EQ(open(shards[2])->start(0), 1);
  const TokenSequences s(shards, kT, 1000, std::nullopt, "token file", true, Packing::none);
  ASSERT_EQ(s.size(), 3);
  EXPECT_EQ(row(s, 0), (Row{{500, 501, 502, 503}, {501, 502, 503, 504}}));
  EXPECT_EQ(row(s, 1), (Row{{505, 506, 507, 508}, {506, 507, 508, 509}}));  // 5..16, cut
  EXPECT_EQ(row(s, 2), (Row{{517, 518, 0, 0}, {518, 519, kX, kX}}));

  // Every document once per epoch, and a position over other packing is refused.
  DataLoader d(shards, kT, 1000, 3, std::nullopt, true, Packing::none);
  EXPECT_EQ(d.num_sequences(), 3);
  Batch b{std::vector<int32_t>(3 * kT), std::vector<int32_t>(3 * kT)};
  d.next(3, b.ids, b.targets);
  std::vector<int32_t> got = firsts(b);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int32_t>{500, 505, 517}));
  const DataPosition saved = DataPosition::from_json(d.position().to_json(), "ckpt");
  EXPECT_EQ(saved.packing, Packing::none);
  DataLoader wrapped(shards, 3, 1000, 3);
  expect_error([&] { wrapped.restore(saved); },
               {"--packing none", "this run cuts them with --packing wrapped"});
  nlohmann::json older = wrapped.position().to_json();
  older.erase("packing");
  EXPECT_EQ(DataPosition::from_json(older, "old").packing, Packing::wrapped);
  older["packing"] = "packed";
  expect_error([&] { DataPosition::from_json(older, "t.json"); }, {"t.json", "\"packed\""});

  // auto: none where every file is indexed and one has a mask.
  const fs::path plain = tokens("plain.bin", 0, 30);
  EXPECT_EQ(auto_packing(shards, true), Packing::wrapped);  // no mask
  {
    LossMaskWriter w(shards[0], 0);
    w.write_ones(8);
    w.finish();
  }
  EXPECT_EQ(auto_packing(shards, true), Packing::none);
  EXPECT_EQ(auto_packing(shards, false), Packing::wrapped);
  EXPECT_EQ(auto_packing({shards[0], plain}, true), Packing::wrapped);  // plain has no index
  expect_error(
      [&] {
        TokenSequences({shards[0], plain}, kT, 1000, std::nullopt, "training token file", true,
                       Packing::none);
      },
      {"training token file", "plain.bin", "no document index (plain.bin.docs)", "strata tokenize",
       "--packing wrapped"});
  // Only one-token documents: nothing to train on.
  const fs::path ones = tokens("ones.bin", 0, 3);
  index(ones, {0, 1, 2});
  expect_error(
      [&] { TokenSequences({ones}, kT, 1000, std::nullopt, "token file", true, Packing::none); },
      {"ones.bin", "none of their 3 documents has 2 tokens"});

  // Bound to the tokens: rewritten tokens, another count, a damaged start, not an index.
  const fs::path docs = document_index_path(shards[2]);
  const fs::path keep = dir_ / "keep.docs";
  fs::copy_file(docs, keep);
  write_llmc_tokens(shards[2], std::vector<uint32_t>{1, 2, 3, 4}, TokenWidth::u16);
  expect_error([&] { open(shards[2]); }, {docs.string(), "XXH3-64", "rewritten after its index"});
  write_llmc_tokens(shards[2], std::vector<uint32_t>{1, 2, 3}, TokenWidth::u16);
  expect_error([&] { open(shards[2]); }, {docs.string(), "holds 3 tokens", "not written together"});
  write_llmc_tokens(shards[2], std::vector<uint32_t>{516, 517, 518, 519}, TokenWidth::u16);
  fs::copy_file(keep, docs, fs::copy_options::overwrite_existing);
  EXPECT_EQ(open(shards[2])->start(0), 1);
  {
    std::fstream f(docs, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1024);
    f.put(char{9});  // start 9 of 4 tokens
  }
  expect_error([&] { open(shards[2]); }, {docs.string(), "start 9 of document 0", "damaged"});
  std::ofstream(docs) << "not an index";
  expect_error([&] { open(shards[2]); }, {docs.string(), "not a strata document index"});
}

TEST_F(DataLoaderTest, LargeSeedsRoundTripThroughJson) {
  DataLoader d({tokens("a.bin", 0, 41)}, kT, 1000, ~0ull - 5);
  next(d, 13);
  const DataPosition p =
      DataPosition::from_json(nlohmann::json::parse(d.position().to_json().dump()), "t.json");
  EXPECT_EQ(p, d.position());
  EXPECT_EQ(p.seed, ~0ull - 5);
}

}  // namespace
}  // namespace strata
