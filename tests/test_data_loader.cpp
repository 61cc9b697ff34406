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
#include <map>
#include <set>

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
