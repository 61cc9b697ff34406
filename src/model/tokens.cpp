#include "model/tokens.h"

#include "core/error.h"
#include "core/kernels.h"
#include "core/log.h"
#include "model/file_io.h"

#include <array>
#include <cstring>
#include <limits>
#include <vector>

namespace strata {

namespace {

constexpr int32_t kMagicU16 = 20240520, kVersionU16 = 1;
constexpr int32_t kMagicU32 = 20240801, kVersionU32 = 7;
constexpr uint64_t kHeaderInts = 256, kHeaderBytes = kHeaderInts * 4;
constexpr int32_t kMaskMagic = 20261127, kMaskVersion = 1;
constexpr int32_t kDocsMagic = 20261128, kDocsVersion = 1;

uint64_t width_bytes(TokenWidth w) {
  return w == TokenWidth::u16 ? 2 : 4;
}
std::string_view width_name(TokenWidth w) {
  return w == TokenWidth::u16 ? "uint16" : "uint32";
}

int32_t header_int(const uint8_t* p, int i) {
  int32_t v;
  std::memcpy(&v, p + 4 * i, 4);  // little-endian hosts only, as llm.c itself
  return v;
}

// Files bound to a token file beside it (a loss mask, a document index) share a header:
// kHeaderInts int32 of magic, version, the token count, the low and high words of the XXH3-64
// of the token file's stored tokens, then the file's own fields.
std::array<int32_t, kHeaderInts> bound_header(int32_t magic, int32_t version,
                                              const TokenFile& tokens) {
  const std::span<const uint8_t> stored = tokens.stored();
  const uint64_t hash = xxh3_64(stored.data(), stored.size());
  std::array<int32_t, kHeaderInts> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  header[3] = static_cast<int32_t>(static_cast<uint32_t>(hash));
  header[4] = static_cast<int32_t>(static_cast<uint32_t>(hash >> 32));
  return header;
}

// `where` (a `what`: "loss mask", "document index"), mapped, with its magic and version
// checked; nullopt when there is no such file.
std::optional<MappedFile> open_bound(const std::filesystem::path& where, const char* what,
                                     int32_t magic, int32_t version, const TokenFile& tokens) {
  std::error_code ec;
  if (!std::filesystem::exists(where, ec)) return std::nullopt;
  MappedFile file = MappedFile::open(where, what);
  if (file.size() < kHeaderBytes || header_int(file.data(), 0) != magic)
    fail(
        "{} {}: not a strata {} (no header with magic {}); it sits beside token file {}, which "
        "it would be read with: remove it, or rewrite both with strata tokenize",
        what, file.path(), what, magic, tokens.path());
  if (header_int(file.data(), 1) != version)
    fail("{} {}: version {}; this strata reads version {}", what, file.path(),
         header_int(file.data(), 1), version);
  return file;
}

// The bound file's hash against the tokens' (after its counts were checked); `noun` is what
// to remove ("mask", "index").
void check_bound_hash(const MappedFile& file, const char* what, const char* noun,
                      const TokenFile& tokens) {
  const uint8_t* data = file.data();
  const uint64_t want = static_cast<uint32_t>(header_int(data, 3)) |
                        static_cast<uint64_t>(static_cast<uint32_t>(header_int(data, 4))) << 32;
  const std::span<const uint8_t> stored = tokens.stored();
  const uint64_t got = xxh3_64(stored.data(), stored.size());
  if (got != want)
    fail(
        "{} {}: written for tokens with XXH3-64 {:016x}, but token file {} hashes to {:016x}; "
        "the token file was rewritten after its {}: rewrite both with strata tokenize, or "
        "remove the {}",
        what, file.path(), want, tokens.path(), got, noun, noun);
}

}  // namespace

std::optional<TokenWidth> parse_token_width(std::string_view text) {
  if (text.empty()) return std::nullopt;
  if (text == "uint16" || text == "u16") return TokenWidth::u16;
  if (text == "uint32" || text == "u32") return TokenWidth::u32;
  fail("token dtype '{}' is not supported; raw token files hold uint16 or uint32", text);
}

TokenFile TokenFile::open(const std::filesystem::path& path, std::string_view raw_dtype) {
  return open(path, parse_token_width(raw_dtype));
}

TokenFile TokenFile::open(const std::filesystem::path& path, std::optional<TokenWidth> raw) {
  TokenFile t;
  t.file_ = MappedFile::open(path, "token file");
  const std::string& name = t.file_.path();
  const uint64_t size = t.file_.size();
  const uint8_t* data = t.file_.data();
  const int32_t magic = size >= 4 ? header_int(data, 0) : 0;
  const bool looks_llmc = magic == kMagicU16 || magic == kMagicU32;

  if (raw.has_value()) {
    if (looks_llmc)
      log_warn("token file {} starts with llm.c's magic {} but is read as raw {} tokens, as asked",
               name, magic, width_name(*raw));
    t.width_ = *raw;
    const uint64_t w = width_bytes(t.width_);
    if (size % w != 0)
      fail(
          "token file {}: {} bytes is not a whole number of raw {} tokens ({} bytes each); check "
          "the token dtype, or that the file is complete",
          name, size, width_name(t.width_), w);
    t.tokens_ = data;
    t.size_ = static_cast<int64_t>(size / w);
    return t;
  }

  if (size < kHeaderBytes)
    fail(
        "token file {}: {} bytes is shorter than llm.c's {}-byte header; pass the token dtype "
        "(uint16 or uint32) if it is a raw token file",
        name, size, kHeaderBytes);
  if (!looks_llmc)
    fail(
        "token file {}: magic {} is not llm.c's ({} for uint16 tokens, {} for uint32); pass the "
        "token dtype (uint16 or uint32) if it is a raw token file",
        name, magic, kMagicU16, kMagicU32);
  t.llmc_ = true;
  t.width_ = magic == kMagicU16 ? TokenWidth::u16 : TokenWidth::u32;
  const int32_t version = header_int(data, 1);
  const int32_t want_version = magic == kMagicU16 ? kVersionU16 : kVersionU32;
  if (version != want_version)
    fail(
        "token file {}: llm.c magic {} with version {}; that magic is written with version {} "
        "only, so the file is damaged or from a newer format",
        name, magic, version, want_version);
  const int32_t count = header_int(data, 2);
  if (count < 0)
    fail("token file {}: the header's token count is {}; the file is damaged", name, count);
  const uint64_t expected = kHeaderBytes + static_cast<uint64_t>(count) * width_bytes(t.width_);
  if (size != expected)
    fail(
        "token file {}: the header says {} {} tokens, so the file should be {} bytes, but it is "
        "{}; the file is truncated or damaged",
        name, count, width_name(t.width_), expected, size);
  t.tokens_ = data + kHeaderBytes;
  t.size_ = count;
  return t;
}

uint32_t TokenFile::get(int64_t i) const {
  if (i < 0 || i >= size_)
    fail("token file {}: position {} is out of range (the file holds {} tokens)", path(), i, size_);
  return at(i);
}

void TokenFile::validate(int64_t vocab_size) const {
  if (vocab_size < 1) fail("token file {}: vocab_size {} must be positive", path(), vocab_size);
  const uint64_t vocab = static_cast<uint64_t>(vocab_size);
  for (int64_t i = 0; i < size_; ++i)
    if (at(i) >= vocab)
      fail(
          "token file {}: position {} holds token id {}, but the model's vocab_size is {}; the "
          "data was tokenized for another model's tokenizer",
          path(), i, at(i), vocab_size);
}

int64_t TokenFile::num_sequences(int64_t T) const {
  if (T < 1) fail("token file {}: sequence length {} must be at least 1", path(), T);
  return size_ > 0 ? (size_ - 1) / T : 0;
}

void TokenFile::sequence(int64_t i, int64_t T, int32_t* inputs, int32_t* targets) const {
  const int64_t n = num_sequences(T);
  if (i < 0 || i >= n)
    fail("token file {}: sequence {} of length {} is out of range: {} tokens make {} sequences",
         path(), i, T, size_, n);
  const int64_t first = i * T;
  for (int64_t j = 0; j < T; ++j) {
    inputs[j] = static_cast<int32_t>(at(first + j));
    targets[j] = static_cast<int32_t>(at(first + j + 1));
  }
}

void write_llmc_tokens(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                       TokenWidth width) {
  if (tokens.size() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
    fail(
        "writing token file {}: {} tokens do not fit llm.c's int32 count; split them into "
        "several shards",
        path.string(), tokens.size());
  LlmcTokenWriter writer(path, width, 0);
  writer.write(tokens);
  writer.finish();
}

LlmcTokenWriter::LlmcTokenWriter(std::filesystem::path path, TokenWidth width,
                                 uint64_t shard_tokens)
    : path_(std::move(path)), width_(width), shard_tokens_(shard_tokens) {
  constexpr uint64_t kMost = std::numeric_limits<int32_t>::max();
  if (shard_tokens_ > kMost)
    fail("--shard-tokens {}: an llm.c shard counts its tokens in an int32; use at most {}",
         shard_tokens_, kMost);
}

LlmcTokenWriter::~LlmcTokenWriter() = default;

std::filesystem::path llmc_shard_path(const std::filesystem::path& path, uint64_t i) {
  std::filesystem::path p = path;
  p.replace_filename(fmt::format("{}_{:06}{}", path.stem().string(), i, path.extension().string()));
  return p;
}

std::filesystem::path LlmcTokenWriter::shard_path(uint64_t i) const {
  return shard_tokens_ == 0 ? path_ : llmc_shard_path(path_, i);
}

void LlmcTokenWriter::open_shard() {
  file_ = std::make_unique<AtomicFile>(shard_path(done_.size()));
  const std::array<int32_t, kHeaderInts> placeholder{};  // the count is written at the end
  file_->write(placeholder.data(), kHeaderBytes);
}

void LlmcTokenWriter::close_shard() {
  std::array<int32_t, kHeaderInts> header{};
  header[0] = width_ == TokenWidth::u16 ? kMagicU16 : kMagicU32;
  header[1] = width_ == TokenWidth::u16 ? kVersionU16 : kVersionU32;
  header[2] = static_cast<int32_t>(in_shard_);
  file_->write_at(0, header.data(), kHeaderBytes);
  file_->commit();
  file_.reset();
  done_.push_back(shard_path(done_.size()));
  in_shard_ = 0;
}

void LlmcTokenWriter::write(std::span<const uint32_t> tokens) {
  constexpr uint64_t kMost = std::numeric_limits<int32_t>::max();
  while (!tokens.empty()) {
    if (!file_) open_shard();
    const uint64_t room = (shard_tokens_ > 0 ? shard_tokens_ : kMost) - in_shard_;
    if (room == 0) {
      if (shard_tokens_ == 0)
        fail(
            "writing token file {}: more than {} tokens do not fit llm.c's int32 count; write "
            "shards with --shard-tokens (e.g. 100000000)",
            path_.string(), kMost);
      close_shard();
      continue;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(room, tokens.size()));
    if (width_ == TokenWidth::u32) {
      file_->write(tokens.data(), n * 4);
    } else {
      narrow_.resize(n);
      for (size_t i = 0; i < n; ++i) {
        if (tokens[i] > 0xffffu)
          fail(
              "writing token file {}: token {} at position {} does not fit uint16; write uint32 "
              "tokens",
              path_.string(), tokens[i], total_ + i);
        narrow_[i] = static_cast<uint16_t>(tokens[i]);
      }
      file_->write(narrow_.data(), n * 2);
    }
    in_shard_ += n;
    total_ += n;
    tokens = tokens.subspan(n);
  }
}

std::vector<std::filesystem::path> LlmcTokenWriter::finish() {
  if (!file_ && done_.empty() && shard_tokens_ == 0) open_shard();  // an empty file, not none
  if (file_) close_shard();
  return done_;
}

std::filesystem::path loss_mask_path(const std::filesystem::path& tokens) {
  std::filesystem::path p = tokens;
  p += ".mask";
  return p;
}

std::optional<LossMask> LossMask::open_beside(const TokenFile& tokens) {
  std::optional<MappedFile> file =
      open_bound(loss_mask_path(tokens.path()), "loss mask", kMaskMagic, kMaskVersion, tokens);
  if (!file) return std::nullopt;
  LossMask m;
  m.file_ = std::move(*file);
  const std::string& name = m.file_.path();
  const uint64_t size = m.file_.size();
  const uint8_t* data = m.file_.data();
  const int64_t count = header_int(data, 2);
  if (count != tokens.size() || size != kHeaderBytes + static_cast<uint64_t>(tokens.size()))
    fail(
        "loss mask {}: {} flags in {} bytes, but token file {} holds {} tokens; the two were not "
        "written together: rewrite both with strata tokenize, or remove the mask",
        name, count, size, tokens.path(), tokens.size());
  check_bound_hash(m.file_, "loss mask", "mask", tokens);
  m.flags_ = data + kHeaderBytes;
  m.size_ = count;
  for (int64_t i = 0; i < count; ++i) {
    if (m.flags_[i] > 1)
      fail("loss mask {}: flag {} at token {} is neither 0 nor 1; the mask is damaged", name,
           m.flags_[i], i);
    m.counted_ += m.flags_[i];
  }
  return m;
}

void LossMask::apply(int64_t i, int64_t T, int32_t* targets) const {
  const int64_t first = i * T + 1;
  if (i < 0 || first + T > size_)
    fail("loss mask {}: sequence {} of length {} is out of range ({} flags)", path(), i, T, size_);
  for (int64_t j = 0; j < T; ++j)
    if (flags_[first + j] == 0) targets[j] = kIgnoreIndex;
}

LossMaskWriter::LossMaskWriter(std::filesystem::path tokens_path, uint64_t shard_tokens)
    : path_(std::move(tokens_path)), shard_tokens_(shard_tokens) {}

LossMaskWriter::~LossMaskWriter() = default;

std::filesystem::path LossMaskWriter::tokens_path(uint64_t i) const {
  return shard_tokens_ == 0 ? path_ : llmc_shard_path(path_, i);
}

void LossMaskWriter::open_shard() {
  file_ = std::make_unique<AtomicFile>(loss_mask_path(tokens_path(done_.size())));
  const std::array<int32_t, kHeaderInts> placeholder{};  // written when the shard closes
  file_->write(placeholder.data(), kHeaderBytes);
}

void LossMaskWriter::close_shard() {
  const std::filesystem::path tokens_path = this->tokens_path(done_.size());
  const TokenFile tokens = TokenFile::open(tokens_path, std::nullopt);
  if (static_cast<uint64_t>(tokens.size()) != in_shard_)
    fail("writing loss mask of {}: {} flags for {} tokens; the token file is not complete",
         tokens_path.string(), in_shard_, tokens.size());
  const std::array<int32_t, kHeaderInts> header = bound_header(kMaskMagic, kMaskVersion, tokens);
  file_->write_at(0, header.data(), kHeaderBytes);
  file_->commit();
  file_.reset();
  done_.push_back(loss_mask_path(tokens_path));
  in_shard_ = 0;
}

void LossMaskWriter::write(std::span<const uint8_t> flags) {
  constexpr uint64_t kMost = std::numeric_limits<int32_t>::max();
  while (!flags.empty()) {
    const uint64_t room = (shard_tokens_ > 0 ? shard_tokens_ : kMost) - in_shard_;
    if (file_ && room == 0) {
      close_shard();
      continue;
    }
    if (!file_) open_shard();
    const size_t n = static_cast<size_t>(std::min<uint64_t>(room, flags.size()));
    for (size_t i = 0; i < n; ++i)
      if (flags[i] > 1)
        fail("writing loss mask of {}: flag {} at token {} is neither 0 nor 1", path_.string(),
             flags[i], total_ + i);
    file_->write(flags.data(), n);
    in_shard_ += n;
    total_ += n;
    flags = flags.subspan(n);
  }
}

void LossMaskWriter::write_ones(uint64_t n) {
  const std::vector<uint8_t> ones(std::min<uint64_t>(n, 1u << 20), 1);
  for (uint64_t left = n; left > 0;) {
    const uint64_t k = std::min<uint64_t>(left, ones.size());
    write(std::span<const uint8_t>(ones.data(), k));
    left -= k;
  }
}

std::vector<std::filesystem::path> LossMaskWriter::finish() {
  if (!file_ && done_.empty() && shard_tokens_ == 0) open_shard();  // empty, for an empty file
  if (file_) close_shard();
  return done_;
}

std::filesystem::path document_index_path(const std::filesystem::path& tokens) {
  std::filesystem::path p = tokens;
  p += ".docs";
  return p;
}

std::optional<DocumentIndex> DocumentIndex::open_beside(const TokenFile& tokens) {
  std::optional<MappedFile> file = open_bound(document_index_path(tokens.path()), "document index",
                                              kDocsMagic, kDocsVersion, tokens);
  if (!file) return std::nullopt;
  DocumentIndex x;
  x.file_ = std::move(*file);
  const std::string& name = x.file_.path();
  const uint64_t size = x.file_.size();
  const uint8_t* data = x.file_.data();
  const int64_t count = header_int(data, 2), n = header_int(data, 5);
  if (count != tokens.size() || n < 0 || size != kHeaderBytes + 8 * static_cast<uint64_t>(n))
    fail(
        "document index {}: {} starts in {} bytes for {} tokens, but token file {} holds {} "
        "tokens; the two were not written together: rewrite both with strata tokenize, or "
        "remove the index",
        name, n, size, count, tokens.path(), tokens.size());
  check_bound_hash(x.file_, "document index", "index", tokens);
  x.starts_ = data + kHeaderBytes;
  x.size_ = n;
  for (int64_t d = 0; d < n; ++d) {
    const int64_t s = x.start(d);
    if (s < 0 || s >= count || (d > 0 && s <= x.start(d - 1)))
      fail(
          "document index {}: start {} of document {} is not above the one before it and "
          "below the {} tokens; the index is damaged",
          name, s, d, count);
  }
  return x;
}

int64_t DocumentIndex::start(int64_t d) const {
  if (d < 0 || d >= size_)
    fail("document index {}: document {} is out of range ({} documents)", path(), d, size_);
  uint64_t v;
  std::memcpy(&v, starts_ + 8 * d, 8);
  return v > uint64_t(std::numeric_limits<int64_t>::max()) ? -1 : static_cast<int64_t>(v);
}

DocumentIndexWriter::DocumentIndexWriter(std::filesystem::path tokens_path, uint64_t shard_tokens)
    : path_(std::move(tokens_path)), shard_tokens_(shard_tokens) {}

void DocumentIndexWriter::add(uint64_t start) {
  if (any_ && start <= last_)
    fail("writing the document index of {}: document start {} is not above the last, {}",
         path_.string(), start, last_);
  any_ = true;
  last_ = start;
  const uint64_t shard = shard_tokens_ > 0 ? start / shard_tokens_ : 0;
  if (starts_.size() <= shard) starts_.resize(shard + 1);
  starts_[shard].push_back(shard_tokens_ > 0 ? start % shard_tokens_ : start);
}

void DocumentIndexWriter::close_shard(const std::filesystem::path& tokens_path) {
  const TokenFile tokens = TokenFile::open(tokens_path, std::nullopt);
  const size_t i = done_.size();
  const std::vector<uint64_t> none;
  const std::vector<uint64_t>& starts = i < starts_.size() ? starts_[i] : none;
  if (!starts.empty() && starts.back() >= static_cast<uint64_t>(tokens.size()))
    fail("writing the document index of {}: a document starts at {}, past its {} tokens",
         tokens_path.string(), starts.back(), tokens.size());
  std::array<int32_t, kHeaderInts> header = bound_header(kDocsMagic, kDocsVersion, tokens);
  header[5] = static_cast<int32_t>(starts.size());
  AtomicFile file(document_index_path(tokens_path));
  file.write(header.data(), kHeaderBytes);
  file.write(starts.data(), starts.size() * 8);  // little-endian hosts only, as the header
  file.commit();
  done_.push_back(document_index_path(tokens_path));
}

std::vector<std::filesystem::path> DocumentIndexWriter::finish(
    const std::vector<std::filesystem::path>& token_files) {
  if (starts_.size() > token_files.size())
    fail("writing the document index of {}: documents start in shard {} of {} written",
         path_.string(), starts_.size() - 1, token_files.size());
  for (const std::filesystem::path& f : token_files) close_shard(f);
  return done_;
}

}  // namespace strata
