// fuzz_tokens.cpp: the token-file reader, and the loss mask and document index beside it, on
// arbitrary bytes.
//
// Input layout: byte 0 picks how the file is opened (bits 0-1: 0 or 3 an llm.c shard, 1 raw
// uint16, 2 raw uint32), whether a loss mask goes beside it (bit 2; bit 3: its flags are the
// file's bytes as they are, not each byte's low bit; bit 4: its header is then spoilt by the
// first bytes of the file) and whether a document index does (bit 5: starts a few tokens apart,
// as the file's bytes space them; bit 6: the starts are the file's bytes read as uint64s, most
// of them out of order or range), byte 1 the sequence length (1 + byte % 16), byte 2 the vocabulary
// (odd: 2^17, every id of a uint16 file fits; even: 257, the byte tokenizer's); the remaining
// bytes are the token file. When TokenFile::open accepts the file, its tokens are validated
// and read as sequences, then the same file goes through DataLoader (two epochs' worth of
// batches) and EvalSequences, as `strata train` and `strata eval` read it, with its mask where
// it has one (written, with a correct header unless spoilt, into a temporary directory: a mask
// is found by the token file's name), and where it has an index, through TokenSequences,
// DataLoader and EvalSequences again with --packing none and bfd, every row read with its
// document starts, which must keep the kernels' rule (model/kernels.h). A strata::Error is the
// file being refused; anything else is a finding.
#include "core/error.h"
#include "core/kernels.h"
#include "fuzz_input.h"
#include "model/file_io.h"
#include "model/tokens.h"
#include "train/data_loader.h"

#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

// Whole documents as rows (packing none and bfd), where the file has an index beside it.
void read_as_documents(const std::string& path, std::optional<strata::TokenWidth> raw, int64_t T,
                       int64_t vocab) {
  for (const strata::Packing packing : {strata::Packing::none, strata::Packing::bfd}) {
    try {
      const strata::TokenSequences rows({path}, T, vocab, raw, "fuzz", true, packing);
      std::vector<int32_t> ids(static_cast<size_t>(T)), targets(ids.size()), starts(ids.size());
      for (int64_t g = 0; g < rows.size(); ++g) {
        rows.read(g, ids.data(), targets.data(), starts.data());
        if (packing == strata::Packing::bfd)
          strata::check_doc_start("fuzz", starts.data(), 1, T);  // an Error here is a finding
      }
      (void)strata::describe_documents(rows);
      strata::DataLoader loader({path}, T, vocab, /*seed=*/rows.size(), raw, true, packing);
      std::vector<int32_t> b_ids(ids.size() * 3), b_targets(b_ids.size()), b_starts(b_ids.size());
      for (int64_t done = 0; done < 2 * loader.num_sequences(); done += 3)
        loader.next(3, b_ids, b_targets, b_starts);
      strata::EvalSequences eval({path}, T, vocab, 0, raw, true, packing);
      while (eval.next(3, b_ids, b_targets, b_starts) > 0) {
      }
    } catch (const strata::Error& e) {
      if (std::string_view(e.what()).starts_with("fuzz: doc_start")) __builtin_trap();
    }
  }
}

void read_as_tokens(const std::string& path, std::optional<strata::TokenWidth> raw, int64_t T,
                    int64_t vocab, bool documents) {
  if (documents) read_as_documents(path, raw, T, vocab);
  const strata::TokenFile tokens = strata::TokenFile::open(path, raw);
  if (tokens.size() > 0) (void)tokens.get(tokens.size() - 1);
  const int64_t n = tokens.num_sequences(T);
  std::vector<int32_t> ids(static_cast<size_t>(T) * 3), targets(ids.size());
  if (n > 0) {
    tokens.sequence(0, T, ids.data(), targets.data());
    tokens.sequence(n - 1, T, ids.data(), targets.data());
  }
  tokens.validate(vocab);  // throws on an id >= vocab, naming it

  strata::DataLoader loader({path}, T, vocab, /*seed=*/n, raw);
  for (int64_t done = 0; done < 2 * loader.num_sequences(); done += 3) loader.next(3, ids, targets);

  strata::EvalSequences eval({path}, T, vocab, /*max_sequences=*/0, raw);
  while (eval.next(3, ids, targets) > 0) {
  }
}

// The token file `bytes` in a directory of its own with a loss mask beside it: one flag per
// token of the file as TokenFile reads it (none when it refuses the file), each the byte's low
// bit or the byte itself, under a header bound to the tokens, spoilt on request.
class FilesWithMask {
 public:
  FilesWithMask(const uint8_t* bytes, size_t size, std::optional<strata::TokenWidth> raw,
                uint8_t mode) {
    dir_ =
        std::filesystem::temp_directory_path() / ("strata-fuzz-mask-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "tokens.bin").string();
    std::ofstream(path_, std::ios::binary).write(reinterpret_cast<const char*>(bytes), size);
    int64_t count = 0;
    uint64_t hash = 0;
    try {
      const strata::TokenFile t = strata::TokenFile::open(path_, raw);
      count = t.size();
      hash = strata::xxh3_64(t.stored().data(), t.stored().size());
    } catch (const strata::Error&) {
    }
    std::array<int32_t, 256> header{};
    header[0] = 20261127;
    header[1] = 1;
    header[2] = static_cast<int32_t>(count);
    header[3] = static_cast<int32_t>(static_cast<uint32_t>(hash));
    header[4] = static_cast<int32_t>(static_cast<uint32_t>(hash >> 32));
    if ((mode & 16) != 0)  // spoilt by the first bytes of the file
      std::memcpy(header.data(), bytes, std::min<size_t>(size, 20));
    std::vector<char> flags(static_cast<size_t>(count));
    for (size_t i = 0; i < flags.size(); ++i) {
      const uint8_t b = size > 0 ? bytes[i % size] : 0;
      flags[i] = static_cast<char>((mode & 8) != 0 ? b : (b & 1));
    }
    if ((mode & 4) != 0) {
      std::ofstream m(strata::loss_mask_path(path_), std::ios::binary);
      m.write(reinterpret_cast<const char*>(header.data()), sizeof(header));
      m.write(flags.data(), static_cast<std::streamsize>(flags.size()));
    }
    if ((mode & 32) == 0) return;
    std::vector<uint64_t> starts;
    if ((mode & 64) != 0) {
      for (size_t i = 0; i + 8 <= size && starts.size() < 64; i += 8) {
        uint64_t v;
        std::memcpy(&v, bytes + i, 8);
        starts.push_back(v);
      }
    } else {
      for (uint64_t at = 0, k = 0; at < static_cast<uint64_t>(count); ++k) {
        starts.push_back(at);
        at += 1 + (size > 0 ? bytes[k % size] % 9 : 1);
      }
    }
    header[0] = 20261128;
    header[5] = static_cast<int32_t>(starts.size());
    std::ofstream x(strata::document_index_path(path_), std::ios::binary);
    x.write(reinterpret_cast<const char*>(header.data()), sizeof(header));
    x.write(reinterpret_cast<const char*>(starts.data()),
            static_cast<std::streamsize>(starts.size() * 8));
  }
  FilesWithMask(const FilesWithMask&) = delete;
  FilesWithMask& operator=(const FilesWithMask&) = delete;
  ~FilesWithMask() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::filesystem::path dir_;
  std::string path_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  std::optional<strata::TokenWidth> raw;
  if ((data[0] & 3) == 1) raw = strata::TokenWidth::u16;
  if ((data[0] & 3) == 2) raw = strata::TokenWidth::u32;
  const int64_t T = 1 + data[1] % 16;
  const int64_t vocab = (data[2] & 1) != 0 ? int64_t{1} << 17 : 257;
  try {
    if ((data[0] & (4 | 32)) != 0) {
      const FilesWithMask files(data + 3, size - 3, raw, data[0]);
      read_as_tokens(files.path(), raw, T, vocab, (data[0] & 32) != 0);
    } else {
      const strata::fuzz::MemoryFile file(data + 3, size - 3);
      read_as_tokens(file.path(), raw, T, vocab, false);
    }
  } catch (const strata::Error&) {
    // The file (or a sequence of it, or its mask) was refused: expected for most inputs.
  }
  return 0;
}
