// tokens.h: token files, mapped read-only.
//
// Two layouts: llm.c's shards (a header of 256 little-endian int32: magic 20240520 with version
// 1 for uint16 tokens, or magic 20240801 with version 7 for uint32 tokens; header[2] the token
// count; then the tokens), and raw headerless uint16/uint32 files whose width the user names.
// Sequence i of length T reads tokens [i*T, i*T + T] inclusive: T inputs and the same window
// shifted by one as targets, so consecutive sequences share one boundary token and a file of
// T + 1 tokens holds exactly one sequence.
#pragma once

#include "model/file_io.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class TokenWidth : uint8_t { u16, u32 };

// "uint16"/"u16" or "uint32"/"u32"; empty text is no width (an llm.c file is expected).
std::optional<TokenWidth> parse_token_width(std::string_view text);

class TokenFile {
 public:
  // Without a raw width the file must be an llm.c shard; with one, it is read as headerless
  // tokens of that width.
  static TokenFile open(const std::filesystem::path& path, std::optional<TokenWidth> raw);
  static TokenFile open(const std::filesystem::path& path, std::string_view raw_dtype = {});

  const std::string& path() const { return file_.path(); }
  TokenWidth width() const { return width_; }
  bool llmc() const { return llmc_; }  // has an llm.c header
  int64_t size() const { return size_; }
  // Token i; throws naming the file when i is out of range.
  uint32_t get(int64_t i) const;

  // Every token below vocab_size; otherwise an error naming the file, the first position
  // holding a larger id, and that id.
  void validate(int64_t vocab_size) const;

  // Sequences of length T (each needs T + 1 tokens, neighbours share one): (size - 1) / T.
  int64_t num_sequences(int64_t T) const;
  // inputs[j] = token[i*T + j], targets[j] = token[i*T + j + 1], for j in [0, T).
  void sequence(int64_t i, int64_t T, int32_t* inputs, int32_t* targets) const;
  // The tokens as stored (after the header, at their width): what a loss mask is bound to.
  std::span<const uint8_t> stored() const {
    return {tokens_, static_cast<size_t>(size_) * (width_ == TokenWidth::u16 ? 2u : 4u)};
  }

 private:
  uint32_t at(int64_t i) const {
    return width_ == TokenWidth::u16 ? reinterpret_cast<const uint16_t*>(tokens_)[i]
                                     : reinterpret_cast<const uint32_t*>(tokens_)[i];
  }

  MappedFile file_;
  const uint8_t* tokens_ = nullptr;
  int64_t size_ = 0;
  TokenWidth width_ = TokenWidth::u16;
  bool llmc_ = false;
};

// Writes an llm.c shard atomically: magic 20240520/version 1 for u16, 20240801/version 7 for
// u32. A token that does not fit the width is an error naming its position.
void write_llmc_tokens(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                       TokenWidth width);

// Shard i of `path` as llm.c's data scripts name shards: data.bin gives data_000000.bin, ...
std::filesystem::path llmc_shard_path(const std::filesystem::path& path, uint64_t i);

// Writes a token stream as it comes, without holding it, into llm.c shards of at most
// `shard_tokens` tokens each: `path` itself when shard_tokens is 0 (then at most 2^31 - 1
// tokens, llm.c's int32 count), else `path` with _000000, _000001, ... before its extension
// (data.bin: data_000000.bin), as llm.c's own data scripts name shards. Each file is written
// atomically (AtomicFile) and appears only when complete; the header's count is written last.
// A token that does not fit the width is an Error naming its position in the stream.
class LlmcTokenWriter {
 public:
  LlmcTokenWriter(std::filesystem::path path, TokenWidth width, uint64_t shard_tokens);
  LlmcTokenWriter(const LlmcTokenWriter&) = delete;
  LlmcTokenWriter& operator=(const LlmcTokenWriter&) = delete;
  ~LlmcTokenWriter();

  void write(std::span<const uint32_t> tokens);
  // Completes the last shard; returns every file written, in order. A stream of no tokens
  // writes one empty file without shards, none with them.
  std::vector<std::filesystem::path> finish();
  uint64_t tokens() const { return total_; }
  // The name of shard i (`path` itself when not sharding).
  std::filesystem::path shard_path(uint64_t i) const;

 private:
  void open_shard();
  void close_shard();

  std::filesystem::path path_;
  TokenWidth width_;
  uint64_t shard_tokens_;
  uint64_t total_ = 0, in_shard_ = 0;
  std::unique_ptr<AtomicFile> file_;
  std::vector<std::filesystem::path> done_;
  std::vector<uint16_t> narrow_;
};

// Loss masks: which tokens of a token file are targets whose loss counts, for fine-tuning on
// prompts and completions (the prompt's tokens are read but not trained on, as label -100 does
// in PyTorch). A mask lives beside its token file, named by loss_mask_path(): a header of 256
// little-endian int32 (magic 20261127, version 1, header[2] the token count, header[3] and
// header[4] the low and high words of the XXH3-64 of the token file's stored tokens), then one
// byte per token: 1 where that token counts as a target, 0 where it does not. The hash binds a
// mask to its tokens: a token file rewritten since is caught, never read with a stale mask.
std::filesystem::path loss_mask_path(const std::filesystem::path& tokens);

class LossMask {
 public:
  // The mask beside `tokens`, if there is one; an Error naming the mask when it is damaged or
  // written for other tokens.
  static std::optional<LossMask> open_beside(const TokenFile& tokens);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return size_; }
  int64_t counted() const { return counted_; }  // tokens marked 1
  bool counts(int64_t i) const { return flags_[i] != 0; }
  // Sets targets[j] to kIgnoreIndex where token i*T + j + 1 does not count (TokenFile::sequence's
  // targets of sequence i).
  void apply(int64_t i, int64_t T, int32_t* targets) const;

 private:
  MappedFile file_;
  const uint8_t* flags_ = nullptr;
  int64_t size_ = 0, counted_ = 0;
};

// Writes the masks of an LlmcTokenWriter's files as they come: the same shards (each mask
// shard of `shard_tokens` flags, loss_mask_path of the token shard), each written atomically
// and bound to its token shard, which must be complete on disk when its mask is closed: write
// each span of tokens before its flags, and finish() the token writer first.
class LossMaskWriter {
 public:
  LossMaskWriter(std::filesystem::path tokens_path, uint64_t shard_tokens);
  LossMaskWriter(const LossMaskWriter&) = delete;
  LossMaskWriter& operator=(const LossMaskWriter&) = delete;
  ~LossMaskWriter();
  void write(std::span<const uint8_t> flags);  // each 0 or 1
  void write_ones(uint64_t n);                 // n tokens that all count
  std::vector<std::filesystem::path> finish();

 private:
  std::filesystem::path tokens_path(uint64_t i) const;  // token shard i (path_ unsharded)
  void open_shard();
  void close_shard();
  std::filesystem::path path_;
  uint64_t shard_tokens_;
  uint64_t total_ = 0, in_shard_ = 0;
  std::unique_ptr<AtomicFile> file_;
  std::vector<std::filesystem::path> done_;
};

// Document indexes: where each document of a token file starts, so that sequences can hold one
// document each instead of windows cut across them (TokenSequences, `--packing none`). An
// index lives beside its token file, named by document_index_path(): a header of 256
// little-endian int32 (magic 20261128, version 1, header[2] the token count, header[3] and
// header[4] the low and high words of the XXH3-64 of the token file's stored tokens, header[5]
// the number of starts), then each start as a little-endian uint64, strictly increasing and
// below the token count. A document runs from its start to the next one, or to the end of the
// file; where the next file's first start is not 0 (a document cut by `--shard-tokens`), it
// continues into that file. Bound to its tokens by the hash, as a loss mask is.
std::filesystem::path document_index_path(const std::filesystem::path& tokens);

class DocumentIndex {
 public:
  // The index beside `tokens`, if there is one; an Error naming it when it is damaged or was
  // written for other tokens.
  static std::optional<DocumentIndex> open_beside(const TokenFile& tokens);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return size_; }  // documents starting in the file
  int64_t start(int64_t d) const;         // token position of document d's first token

 private:
  MappedFile file_;
  const uint8_t* starts_ = nullptr;
  int64_t size_ = 0;
};

// Writes the document indexes of an LlmcTokenWriter's files: add() each document's start, as a
// position in the whole stream, in increasing order and after the tokens up to it were written;
// finish() with the token writer's files, once it has finished, writes each file's index
// atomically and bound to it (an empty one for a shard in which no document starts).
class DocumentIndexWriter {
 public:
  DocumentIndexWriter(std::filesystem::path tokens_path, uint64_t shard_tokens);
  void add(uint64_t start);
  std::vector<std::filesystem::path> finish(const std::vector<std::filesystem::path>& token_files);

 private:
  void close_shard(const std::filesystem::path& tokens);
  std::filesystem::path path_;
  uint64_t shard_tokens_;
  uint64_t last_ = 0;
  bool any_ = false;
  std::vector<std::vector<uint64_t>> starts_;  // per shard, positions within it
  std::vector<std::filesystem::path> done_;
};

}  // namespace strata
