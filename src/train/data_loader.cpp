// data_loader.cpp: see data_loader.h. The generator constants are splitmix64's and
// xoshiro256**'s published ones; changing any of them changes every run's batches.
#include "train/data_loader.h"

#include "core/error.h"
#include "core/kernels.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

namespace strata {

namespace {

uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

void open_checked(TokenFile& file, const std::filesystem::path& path, int64_t seq_len,
                  int64_t vocab_size, std::optional<TokenWidth> raw, std::string_view what,
                  Packing packing) {
  file = TokenFile::open(path, raw);
  file.validate(vocab_size);
  if (packing == Packing::wrapped && file.num_sequences(seq_len) < 1)
    fail(
        "{} {}: {} tokens make no sequence of --seq-len {} (one needs {} tokens: the inputs "
        "and the targets shifted by one); use a larger file, a shorter --seq-len, or leave the "
        "file out",
        what, file.path(), file.size(), seq_len, seq_len + 1);
}

// `files`, unless there are none: then an Error saying which flag takes them.
const std::vector<std::filesystem::path>& given(const std::vector<std::filesystem::path>& files,
                                                std::string_view what, std::string_view flag) {
  if (files.empty()) fail("{}: no token file was given; pass {} FILE[,FILE...]", what, flag);
  return files;
}

void check_rows(int64_t batch, int64_t seq_len, std::span<int32_t> ids, std::span<int32_t> targets,
                std::string_view what) {
  if (batch < 0) fail("{}: batch {} must be >= 0", what, batch);
  const uint64_t need = static_cast<uint64_t>(batch) * static_cast<uint64_t>(seq_len);
  if (ids.size() < need || targets.size() < need)
    fail("{}: a batch of {} x {} tokens needs {} ids and targets; got {} and {}", what, batch,
         seq_len, need, ids.size(), targets.size());
}

const nlohmann::json& field(const nlohmann::json& json, const char* key, std::string_view source) {
  if (!json.contains(key))
    fail("{}: the data position has no \"{}\"; the checkpoint is damaged or from another version",
         source, key);
  return json.at(key);
}

int64_t whole(const nlohmann::json& json, const char* key, int64_t lo, std::string_view source) {
  const nlohmann::json& v = field(json, key, source);
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() &&
       v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) ||
      v.get<int64_t>() < lo)
    fail("{}: data position \"{}\" is {}; expected a whole number >= {}", source, key, v.dump(),
         lo);
  return v.get<int64_t>();
}

}  // namespace

uint64_t SplitMix64::mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t SplitMix64::next() {
  state_ += 0x9e3779b97f4a7c15ull;
  return mix(state_);
}

Xoshiro256::Xoshiro256(uint64_t seed) {
  SplitMix64 sm(seed);
  for (uint64_t& s : s_) s = sm.next();
}

uint64_t Xoshiro256::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

uint64_t Xoshiro256::below(uint64_t n) {
  if (n == 0) fail("Xoshiro256::below: the range is empty (n = 0)");
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  for (;;) {
    const uint64_t r = next();
    if (r >= threshold) return r % n;
  }
}

std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch, int64_t n) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  Xoshiro256 rng(SplitMix64::mix(seed) + static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

std::string_view packing_name(Packing packing) {
  return packing == Packing::none ? "none" : packing == Packing::bfd ? "bfd" : "wrapped";
}

Packing parse_packing(std::string_view text, std::string_view flag) {
  if (text == "wrapped") return Packing::wrapped;
  if (text == "none") return Packing::none;
  if (text == "bfd") return Packing::bfd;
  fail(
      "{} {}: expected wrapped (documents end to end, cut into --seq-len windows), none (one "
      "document per sequence, padded) or bfd (whole documents packed into sequences, each "
      "attending to itself alone)",
      flag, text);
}

Packing auto_packing(const std::vector<std::filesystem::path>& files, bool loss_masks) {
  if (!loss_masks) return Packing::wrapped;
  bool masked = false;
  for (const std::filesystem::path& f : files) {
    std::error_code ec;
    if (!std::filesystem::exists(document_index_path(f), ec)) return Packing::wrapped;
    masked = masked || std::filesystem::exists(loss_mask_path(f), ec);
  }
  return masked ? Packing::none : Packing::wrapped;
}

nlohmann::json DataPosition::to_json() const {
  nlohmann::json j = {{"seed", seed},
                      {"epoch", epoch},
                      {"position", position},
                      {"sequences", sequences},
                      {"seq_len", seq_len}};
  if (counted_targets >= 0) j["counted_targets"] = counted_targets;
  j["packing"] = packing_name(packing);
  return j;
}

DataPosition DataPosition::from_json(const nlohmann::json& json, std::string_view source) {
  if (!json.is_object())
    fail("{}: the data position is {}; expected an object; the checkpoint is damaged", source,
         json.dump());
  DataPosition p;
  const nlohmann::json& seed = field(json, "seed", source);
  if (!seed.is_number_unsigned() && !(seed.is_number_integer() && seed.get<int64_t>() >= 0))
    fail("{}: data position \"seed\" is {}; expected a whole number >= 0", source, seed.dump());
  p.seed = seed.get<uint64_t>();
  p.epoch = whole(json, "epoch", 0, source);
  p.position = whole(json, "position", 0, source);
  p.sequences = whole(json, "sequences", 1, source);
  p.seq_len = whole(json, "seq_len", 1, source);
  if (json.contains("counted_targets"))
    p.counted_targets = whole(json, "counted_targets", 0, source);
  if (json.contains("packing")) {
    const nlohmann::json& v = json.at("packing");
    if (!v.is_string() || (v != "wrapped" && v != "none" && v != "bfd"))
      fail("{}: data position \"packing\" is {}; expected \"wrapped\", \"none\" or \"bfd\"", source,
           v.dump());
    p.packing = parse_packing(v.get<std::string>());
  }
  if (p.position >= p.sequences)
    fail(
        "{}: data position {} is not below the {} sequences of an epoch; the checkpoint is "
        "damaged",
        source, p.position, p.sequences);
  return p;
}

TokenSequences::TokenSequences(const std::vector<std::filesystem::path>& files, int64_t seq_len,
                               int64_t vocab_size, std::optional<TokenWidth> raw,
                               std::string_view what, bool loss_masks, Packing packing)
    : packing_(packing), seq_len_(seq_len) {
  if (seq_len < 1) fail("{}: sequence length {} must be at least 1", what, seq_len);
  files_.resize(files.size());
  masks_.resize(files.size());
  first_.push_back(0);
  for (size_t f = 0; f < files.size(); ++f) {
    open_checked(files_[f], files[f], seq_len, vocab_size, raw, what, packing);
    if (loss_masks) masks_[f] = LossMask::open_beside(files_[f]);
    masked_files_ += masks_[f] ? 1 : 0;
  }
  if (packing == Packing::wrapped) {
    wrap_sequences();
  } else {
    index_documents(what);
    if (packing == Packing::bfd) pack_documents();
  }
  if (counted_ == 0)
    fail(
        "{}s: every target of their {} sequences is masked out by their loss masks ({}, ...); "
        "nothing would be learned or measured: tokenize completions, not only prompts, or pass "
        "--loss-mask off",
        what, size(), masks_.front() ? masks_.front()->path() : files_.front().path());
}

void TokenSequences::wrap_sequences() {
  for (size_t f = 0; f < files_.size(); ++f) {
    const int64_t n = files_[f].num_sequences(seq_len_);
    first_.push_back(first_.back() + n);
    // The targets of the file's sequences are its tokens 1 .. n*T.
    if (!masks_[f]) {
      counted_ += n * seq_len_;
      continue;
    }
    // The mask counted its flags when it opened: all but token 0 and the tail past the last
    // sequence (fewer than T tokens).
    const LossMask& m = *masks_[f];
    counted_ += m.counted() - (m.size() > 0 && m.counts(0) ? 1 : 0);
    for (int64_t i = n * seq_len_ + 1; i < m.size(); ++i) counted_ -= m.counts(i) ? 1 : 0;
  }
  size_ = first_.back();
}

void TokenSequences::index_documents(std::string_view what) {
  // Every document start, as a position in the files' tokens end to end. A file that does not
  // begin with a document continues the one before it (a document cut by --shard-tokens).
  offset_.push_back(0);
  std::vector<int64_t> starts;
  for (size_t f = 0; f < files_.size(); ++f) {
    const std::optional<DocumentIndex> index = DocumentIndex::open_beside(files_[f]);
    if (!index)
      fail(
          "{} {}: --packing {} reads whole documents, but there is no document index ({}) "
          "beside it to say where they start; tokenize the data again with strata tokenize, "
          "which writes one, or pass --packing wrapped",
          what, files_[f].path(), packing_name(packing_),
          document_index_path(files_[f].path()).filename().string());
    for (int64_t d = 0; d < index->size(); ++d) starts.push_back(offset_.back() + index->start(d));
    offset_.push_back(offset_.back() + files_[f].size());
  }
  if (starts.empty() || starts.front() != 0) starts.insert(starts.begin(), 0);
  starts.push_back(offset_.back());
  const int64_t T = seq_len_;
  int64_t shortest = 0;
  for (size_t d = 0; d + 1 < starts.size(); ++d) {
    const int64_t a = starts[d], length = starts[d + 1] - a;
    if (length < 2) {
      ++shortest;
      continue;
    }
    longest_ = std::max(longest_, length);
    const int64_t n = std::min(length, T + 1);
    truncated_ += length > T + 1 ? 1 : 0;
    document_inputs_ += n - 1;
    const int64_t counted_before = counted_;
    for (int64_t p = a + 1; p < a + n;) {  // the targets: tokens 1 .. n-1 of the document
      const size_t f = file_of(p);
      const int64_t end = std::min(a + n, offset_[f + 1]);
      if (!masks_[f]) {
        counted_ += end - p;
      } else {
        for (; p < end; ++p) counted_ += masks_[f]->counts(p - offset_[f]) ? 1 : 0;
      }
      p = end;
    }
    uncounted_ += counted_ == counted_before ? 1 : 0;
    doc_.push_back(a);
    doc_.push_back(a + n);
  }
  size_ = static_cast<int64_t>(doc_.size() / 2);
  if (size_ == 0)
    fail(
        "{}s ({}, ...): none of their {} documents has 2 tokens or more, so none has a target; "
        "check that the data was tokenized with documents, or pass --packing wrapped",
        what, files_.front().path(), shortest);
}

void TokenSequences::pack_documents() {
  // Best fit decreasing over the documents' positions (n - 1 of a cut document of n tokens):
  // longest first (the earlier document on a tie), each into the open row with the least room
  // that holds it (the earliest opened on a tie: a multimap keeps equal keys in insertion
  // order), else into a new row.
  const int64_t D = documents(), T = seq_len_;
  std::vector<int64_t> order(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) order[static_cast<size_t>(d)] = d;
  const auto positions = [&](int64_t d) {
    return doc_[2 * static_cast<size_t>(d) + 1] - doc_[2 * static_cast<size_t>(d)] - 1;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return positions(a) > positions(b); });
  std::vector<std::vector<int64_t>> rows;
  std::multimap<int64_t, int64_t> room;  // room left -> row
  for (const int64_t d : order) {
    const int64_t need = positions(d);
    auto it = room.lower_bound(need);
    int64_t row = 0, left = 0;
    if (it == room.end()) {
      row = static_cast<int64_t>(rows.size());
      rows.emplace_back();
      left = T;
    } else {
      row = it->second;
      left = it->first;
      room.erase(it);
    }
    rows[static_cast<size_t>(row)].push_back(d);
    if (left - need > 0) room.emplace(left - need, row);
  }
  row_first_.assign(1, 0);
  for (const std::vector<int64_t>& r : rows) {
    row_docs_.insert(row_docs_.end(), r.begin(), r.end());
    row_first_.push_back(static_cast<int64_t>(row_docs_.size()));
  }
  size_ = static_cast<int64_t>(rows.size());
}

size_t TokenSequences::file_of(int64_t p) const {
  return static_cast<size_t>(std::upper_bound(offset_.begin(), offset_.end(), p) - offset_.begin() -
                             1);
}

void TokenSequences::read_document(int64_t d, int64_t at, int32_t* ids, int32_t* targets) const {
  // Document d: its tokens a .. b-1 (at most T + 1), inputs the first n - 1, targets the rest.
  const int64_t a = doc_[2 * static_cast<size_t>(d)], b = doc_[2 * static_cast<size_t>(d) + 1];
  const int64_t n = b - a;
  size_t f = file_of(a);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = a + j;
    while (p >= offset_[f + 1]) ++f;
    const auto token = static_cast<int32_t>(files_[f].get(p - offset_[f]));
    if (j + 1 < n) ids[at + j] = token;
    if (j > 0) {
      const bool counts = !masks_[f] || masks_[f]->counts(p - offset_[f]);
      targets[at + j - 1] = counts ? token : kIgnoreIndex;
    }
  }
}

void TokenSequences::read(int64_t g, int32_t* ids, int32_t* targets, int32_t* doc_start) const {
  if (g < 0 || g >= size())
    fail("token data: sequence {} is out of range (the files hold {})", g, size());
  if (packing_ == Packing::wrapped) {
    const auto f =
        static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), g) - first_.begin() - 1);
    files_[f].sequence(g - first_[f], seq_len_, ids, targets);
    if (masks_[f]) masks_[f]->apply(g - first_[f], seq_len_, targets);
    return;
  }
  int64_t used = 0;  // positions filled
  if (packing_ == Packing::none) {
    read_document(g, 0, ids, targets);
    used = doc_[2 * static_cast<size_t>(g) + 1] - doc_[2 * static_cast<size_t>(g)] - 1;
  } else {
    if (doc_start == nullptr)
      fail("token data: sequence {} packs documents, and its reader gave nowhere to say where", g);
    const auto row = static_cast<size_t>(g);
    for (int64_t i = row_first_[row]; i < row_first_[row + 1]; ++i) {
      const int64_t d = row_docs_[static_cast<size_t>(i)];
      const int64_t n = doc_[2 * static_cast<size_t>(d) + 1] - doc_[2 * static_cast<size_t>(d)];
      read_document(d, used, ids, targets);
      for (int64_t j = used; j < used + n - 1; ++j) doc_start[j] = static_cast<int32_t>(used);
      used += n - 1;
    }
  }
  for (int64_t j = used; j < seq_len_; ++j) {
    ids[j] = 0;
    targets[j] = kIgnoreIndex;
    if (packing_ == Packing::bfd) doc_start[j] = static_cast<int32_t>(used);  // its own
  }
}

std::string describe_documents(const TokenSequences& data) {
  const int64_t T = data.seq_len(), n = data.size();
  const double padding =
      1.0 - static_cast<double>(data.document_inputs()) / (static_cast<double>(n) * T);
  std::string cut = "none longer than --seq-len + 1";
  if (data.truncated() > 0)
    cut = fmt::format(
        "{} cut after --seq-len + 1 = {} tokens, as max_length truncates them (the longest has "
        "{}: --seq-len {} keeps every one whole)",
        data.truncated(), T + 1, data.longest(), data.longest() - 1);
  std::string idle;
  if (data.uncounted() > 0)
    idle = fmt::format(
        "; {} have no target that counts within the cut (a prompt as long as the sequence, or "
        "no reply) and train on nothing",
        data.uncounted());
  const std::string rows =
      data.packing() == Packing::bfd
          ? fmt::format(
                "{} documents packed into {} sequences by best fit decreasing, each "
                "attending to itself alone (--packing bfd)",
                data.documents(), n)
          : fmt::format("{} documents, one per sequence (--packing none)", n);
  return fmt::format("{}; {}{}; {:.0f}% of the inputs are padding", rows, cut, idle,
                     100.0 * padding);
}

DataLoader::DataLoader(const std::vector<std::filesystem::path>& files, int64_t seq_len,
                       int64_t vocab_size, uint64_t seed, std::optional<TokenWidth> raw,
                       bool loss_masks, Packing packing)
    : data_(given(files, "training data", "--data"), seq_len, vocab_size, raw,
            "training token file", loss_masks, packing) {
  position_.seed = seed;
  position_.packing = packing;
  position_.sequences = data_.size();
  position_.seq_len = seq_len;
  position_.counted_targets = data_.counted_targets();
  load_order();
}

void DataLoader::load_order() {
  order_ = epoch_order(position_.seed, position_.epoch, position_.sequences);
}

void DataLoader::read(int64_t g, int32_t* ids, int32_t* targets, int32_t* doc_start) const {
  data_.read(g, ids, targets, doc_start);
}

void DataLoader::next(int64_t batch, std::span<int32_t> ids, std::span<int32_t> targets,
                      std::span<int32_t> doc_start) {
  const int64_t T = position_.seq_len;
  check_rows(batch, T, ids, targets, "training batch");
  const bool docs = data_.packs_documents();
  if (docs) check_rows(batch, T, doc_start, targets, "training batch");
  for (int64_t r = 0; r < batch; ++r) {
    read(order_[static_cast<size_t>(position_.position)], ids.data() + r * T,
         targets.data() + r * T, docs ? doc_start.data() + r * T : nullptr);
    if (++position_.position == position_.sequences) {
      position_.position = 0;
      ++position_.epoch;
      load_order();
    }
  }
}

void DataLoader::restore(const DataPosition& position) {
  if (position.packing != position_.packing)
    fail(
        "training data: the saved position is over sequences cut with --packing {}, but this "
        "run cuts them with --packing {}; resume with --packing {}",
        packing_name(position.packing), packing_name(position_.packing),
        packing_name(position.packing));
  if (position.sequences != position_.sequences || position.seq_len != position_.seq_len)
    fail(
        "training data: the saved position is over {} sequences of length {}, but these files "
        "make {} of length {}; resume with the same --data files and --seq-len",
        position.sequences, position.seq_len, position_.sequences, position_.seq_len);
  if (position.position < 0 || position.position >= position.sequences || position.epoch < 0)
    fail(
        "training data: saved position {} of epoch {} is out of range (0..{}); the checkpoint "
        "is damaged",
        position.position, position.epoch, position.sequences - 1);
  if (position.counted_targets >= 0 && position.counted_targets != position_.counted_targets)
    fail(
        "training data: the saved position is over data of which {} targets count, but {} of "
        "these files' count; their loss masks differ from the run's: resume with the same "
        "--data files, their masks (FILE.mask) and the same --loss-mask",
        position.counted_targets, position_.counted_targets);
  const bool same_order = position.seed == position_.seed && position.epoch == position_.epoch;
  const int64_t counted = position_.counted_targets;
  position_ = position;
  position_.counted_targets = counted;  // recorded from here on, also over an older checkpoint
  if (!same_order) load_order();
}

EvalSequences::EvalSequences(const std::vector<std::filesystem::path>& files, int64_t seq_len,
                             int64_t vocab_size, int64_t max_sequences,
                             std::optional<TokenWidth> raw, bool loss_masks, Packing packing)
    : data_(given(files, "evaluation data", "--eval-data"), seq_len, vocab_size, raw,
            "evaluation token file", loss_masks, packing) {
  if (max_sequences < 0)
    fail("evaluation data: at most {} sequences; expected 0 (all) or more", max_sequences);
  count_ = data_.size();
  if (max_sequences > 0) count_ = std::min(count_, max_sequences);
}

int64_t EvalSequences::next(int64_t batch, std::span<int32_t> ids, std::span<int32_t> targets,
                            std::span<int32_t> doc_start) {
  const int64_t T = data_.seq_len();
  check_rows(batch, T, ids, targets, "evaluation batch");
  const bool docs = data_.packs_documents();
  if (docs) check_rows(batch, T, doc_start, targets, "evaluation batch");
  const int64_t rows = std::min(batch, count_ - next_);
  for (int64_t r = 0; r < rows; ++r)
    data_.read(next_ + r, ids.data() + r * T, targets.data() + r * T,
               docs ? doc_start.data() + r * T : nullptr);
  next_ += rows;
  return rows;
}

}  // namespace strata
