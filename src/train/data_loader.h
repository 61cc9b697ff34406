// data_loader.h: deterministic training batches from one or more token files, and the held-out
// file's sequences in order for evaluation.
//
// Sequence i of a file of length-T sequences reads tokens [i*T, i*T + T] (model/tokens.h). The
// sequences of all files, in the order the files are given, form one index space 0..N-1; each
// epoch hands out a permutation of it, and a batch that reaches the end of an epoch continues
// with the next one. The permutation is fully specified here, so it is the same on every
// compiler and library: epoch e of seed s shuffles 0..N-1 with Fisher-Yates (i from N-1 down to
// 1, swapping i with j = below(i + 1)) driven by xoshiro256** seeded by four outputs of
// splitmix64 started at splitmix64_mix(s) + e; below(n) draws by rejection (a draw r is kept
// when r >= 2^64 mod n, and gives r mod n), so it is unbiased.
//
// The one thing to know before editing: the loader's whole state is DataPosition (seed, epoch,
// position within the epoch, and the data's shape to catch a resume on other data). Anything
// else the loader keeps must be derived from it, or resumed runs stop seeing the same batches.
#pragma once

#include "model/tokens.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// The generator behind the epoch permutations (see the note above), exposed for its tests.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next();
  static uint64_t mix(uint64_t z);  // splitmix64's output function alone

 private:
  uint64_t state_;
};

class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed);  // four outputs of SplitMix64(seed)
  uint64_t next();                     // xoshiro256**
  uint64_t below(uint64_t n);          // uniform in [0, n), n >= 1, by rejection

 private:
  uint64_t s_[4];
};

// The order in which epoch `epoch` of `seed` visits sequences 0..n-1.
std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch, int64_t n);

// How sequences are cut from token files (`--packing`, named as TRL names its strategies).
//  wrapped: the files' tokens one sequence after another, windows of T inputs cut across
//    documents (model/tokens.h), as pretraining and TRL's "wrapped" packing read them.
//  none: one document per sequence, as TRL's SFT reads rows with packing=False: the document
//    (DocumentIndex: from its start to the next) gives its first min(L, T + 1) tokens, L - 1
//    targets at most T, and the rest of the row is padding (input id 0, target kIgnoreIndex);
//    a longer document is cut after T + 1 tokens, as max_length truncates it. Causal attention
//    keeps the padding out of the document's positions, so each row computes what the document
//    alone would. Documents of fewer than 2 tokens (no target) are left out.
//  bfd: the documents of none (each cut after T + 1 tokens, taking L - 1 positions) packed whole
//    into sequences by best fit decreasing, as TRL packs with its "bfd" strategy: longest
//    first, each into the sequence with the least room that holds it (the first such, on a
//    tie), else a new one; the rest of a sequence is padding. Each row comes with where each
//    position's document starts (doc_start, the padding its own), and attention keeps every
//    document to itself (LlamaModel::forward), so each document still computes what it would
//    alone, as TRL's padding-free packing with position ids does; only the padding is gone.
//    The packing is fixed by the data and T: every epoch shuffles the same sequences.
enum class Packing : uint8_t { wrapped, none, bfd };
std::string_view packing_name(Packing packing);
// "wrapped", "none" or "bfd"; an Error naming `flag` and the value otherwise.
Packing parse_packing(std::string_view text, std::string_view flag = "--packing");
// What `--packing auto` picks for `files`: none where every file has a document index beside it
// and at least one has a loss mask (fine-tuning rows, whose prompts must stay with their
// completions), else wrapped. With loss_masks off (`--loss-mask off`), wrapped.
Packing auto_packing(const std::vector<std::filesystem::path>& files, bool loss_masks);

// Where a loader is: plain data, saved in checkpoints.
struct DataPosition {
  uint64_t seed = 0;
  int64_t epoch = 0;      // epochs completed
  int64_t position = 0;   // sequences of this epoch already handed out, in [0, sequences)
  int64_t sequences = 0;  // N, the index space (checked on restore)
  int64_t seq_len = 0;    // T (checked on restore)
  // The targets that count over the index space (TokenSequences::counted_targets: fewer than
  // N*T where loss masks leave some out), checked on restore; -1 where a checkpoint written
  // before loss masks has none.
  int64_t counted_targets = -1;
  Packing packing = Packing::wrapped;  // checked on restore; wrapped where a checkpoint has none

  bool operator==(const DataPosition&) const = default;
  // {"seed", "epoch", "position", "sequences", "seq_len", "counted_targets", "packing"}
  nlohmann::json to_json() const;
  // `source` names the checkpoint file in errors naming a missing or wrong key.
  static DataPosition from_json(const nlohmann::json& json, std::string_view source);
};

// The length-T sequences of several token files (llm.c shards, or raw tokens of width `raw`)
// as one index space 0..size()-1, each file's in order, the files in the order given, cut as
// `packing` says. Every token is checked below vocab_size; with wrapped packing every file must
// hold a sequence, with none every file needs its document index; errors name the file (`what`
// says what it is for: "training token file", ...). With `loss_masks`, a file's loss mask
// (model/tokens.h), where it has one, turns the targets that do not count into kIgnoreIndex; an
// Error when no target of any sequence counts.
class TokenSequences {
 public:
  TokenSequences(const std::vector<std::filesystem::path>& files, int64_t seq_len,
                 int64_t vocab_size, std::optional<TokenWidth> raw, std::string_view what,
                 bool loss_masks = true, Packing packing = Packing::wrapped);

  int64_t size() const { return size_; }
  int64_t seq_len() const { return seq_len_; }
  Packing packing() const { return packing_; }
  const std::vector<TokenFile>& files() const { return files_; }
  // Files with a loss mask read (0 without masks), and the targets of all sequences that count.
  int64_t masked_files() const { return masked_files_; }
  int64_t counted_targets() const { return counted_; }
  // Packing none or bfd: documents cut after T + 1 tokens, the longest document's tokens, and
  // the inputs that are a document's (the rest of size() x T is padding).
  int64_t truncated() const { return truncated_; }
  int64_t longest() const { return longest_; }
  int64_t document_inputs() const { return document_inputs_; }
  // Packing none or bfd: documents none of whose targets (within the cut) counts: a prompt that
  // fills the sequence, or a conversation without replies. They take room and train on nothing.
  int64_t uncounted() const { return uncounted_; }
  int64_t documents() const { return static_cast<int64_t>(doc_.size() / 2); }
  // Whether rows come with where their documents start (packing bfd).
  bool packs_documents() const { return packing_ == Packing::bfd; }
  // Sequence g as one row of ids and targets (seq_len each), and with packs_documents() the
  // start of each position's document in the row (seq_len; else doc_start is not written).
  void read(int64_t g, int32_t* ids, int32_t* targets, int32_t* doc_start = nullptr) const;

 private:
  void wrap_sequences();                        // packing wrapped
  void index_documents(std::string_view what);  // packing none and bfd
  void pack_documents();                        // packing bfd: doc_ into rows_
  // Document d's tokens (at most T + 1) into ids/targets from position `at` of a row.
  void read_document(int64_t d, int64_t at, int32_t* ids, int32_t* targets) const;
  // The file holding global token p (the files' tokens end to end).
  size_t file_of(int64_t p) const;

  std::vector<TokenFile> files_;
  std::vector<std::optional<LossMask>> masks_;  // per file
  std::vector<int64_t> first_;                  // wrapped: first index of each file, then size()
  std::vector<int64_t> offset_;                 // none: first token of each file, then the total
  std::vector<int64_t> doc_;  // none: document g is global tokens [doc_[2g], doc_[2g + 1])
  // bfd: row g holds documents row_docs_[row_first_[g] .. row_first_[g + 1]), in order.
  std::vector<int64_t> row_first_, row_docs_;
  Packing packing_ = Packing::wrapped;
  int64_t size_ = 0, seq_len_ = 0, masked_files_ = 0, counted_ = 0;
  int64_t truncated_ = 0, longest_ = 0, document_inputs_ = 0, uncounted_ = 0;
};

// One line on `data` cut with packing none: documents, those cut after T + 1 tokens (and the
// --seq-len that keeps every one whole), and the share of the inputs that is padding.
std::string describe_documents(const TokenSequences& data);

class DataLoader {
 public:
  // Opens every file (llm.c shards, or raw tokens of width `raw`), checks each token is below
  // vocab_size, and that each file holds at least one sequence; errors name the file.
  DataLoader(const std::vector<std::filesystem::path>& files, int64_t seq_len, int64_t vocab_size,
             uint64_t seed, std::optional<TokenWidth> raw = std::nullopt, bool loss_masks = true,
             Packing packing = Packing::wrapped);

  int64_t seq_len() const { return position_.seq_len; }
  int64_t num_sequences() const { return position_.sequences; }
  const std::vector<TokenFile>& files() const { return data_.files(); }
  const TokenSequences& data() const { return data_; }

  // The next `batch` sequences: row r of ids/targets (each batch × seq_len, row-major) is the
  // r-th sequence handed out, and of doc_start where the data packs documents (needed then).
  // Advances the position, and the epoch when it is exhausted.
  void next(int64_t batch, std::span<int32_t> ids, std::span<int32_t> targets,
            std::span<int32_t> doc_start = {});
  // Global sequence index g as ids/targets rows (seq_len each).
  void read(int64_t g, int32_t* ids, int32_t* targets, int32_t* doc_start = nullptr) const;

  const DataPosition& position() const { return position_; }
  // Continues from a saved position; an Error when it was saved over other data (another
  // sequence count or length, other loss masks or another packing).
  void restore(const DataPosition& position);

 private:
  void load_order();  // order_ for position_.epoch

  TokenSequences data_;
  DataPosition position_;
  std::vector<int64_t> order_;  // epoch_order(seed, epoch, N)
};

// The held-out files' sequences 0, 1, 2, ... in order (TokenSequences), in batches, for
// evaluation.
class EvalSequences {
 public:
  // At most `max_sequences` of them (0: all); vocabulary and size checked as DataLoader does.
  EvalSequences(const std::vector<std::filesystem::path>& files, int64_t seq_len,
                int64_t vocab_size, int64_t max_sequences = 0,
                std::optional<TokenWidth> raw = std::nullopt, bool loss_masks = true,
                Packing packing = Packing::wrapped);

  int64_t size() const { return count_; }
  int64_t seq_len() const { return data_.seq_len(); }
  const TokenSequences& data() const { return data_; }
  // Fills the next min(batch, remaining) rows of ids/targets (each at least batch × seq_len),
  // and of doc_start where the data packs documents, and returns how many; 0 once every
  // sequence was handed out.
  int64_t next(int64_t batch, std::span<int32_t> ids, std::span<int32_t> targets,
               std::span<int32_t> doc_start = {});
  void rewind() { next_ = 0; }

 private:
  TokenSequences data_;
  int64_t count_ = 0, next_ = 0;
};

}  // namespace strata
