// fuzz_tokens.cpp: the token-file reader on arbitrary bytes.
//
// Input layout: byte 0 picks how the file is opened (bits 0-1: 0 or 3 an llm.c shard, 1 raw
// uint16, 2 raw uint32), byte 1 the sequence length (1 + byte % 16), byte 2 the vocabulary
// (odd: 2^17, every id of a uint16 file fits; even: 257, the byte tokenizer's); the remaining
// bytes are the token file. When TokenFile::open accepts the file, its tokens are validated
// and read as sequences, then the same file goes through DataLoader (two epochs' worth of
// batches) and EvalSequences, as `strata train` and `strata eval` read it. A strata::Error is
// the file being refused; anything else is a finding.
#include "core/error.h"
#include "fuzz_input.h"
#include "model/tokens.h"
#include "train/data_loader.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

void read_as_tokens(const std::string& path, std::optional<strata::TokenWidth> raw, int64_t T,
                    int64_t vocab) {
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  std::optional<strata::TokenWidth> raw;
  if ((data[0] & 3) == 1) raw = strata::TokenWidth::u16;
  if ((data[0] & 3) == 2) raw = strata::TokenWidth::u32;
  const int64_t T = 1 + data[1] % 16;
  const int64_t vocab = (data[2] & 1) != 0 ? int64_t{1} << 17 : 257;
  const strata::fuzz::MemoryFile file(data + 3, size - 3);
  try {
    read_as_tokens(file.path(), raw, T, vocab);
  } catch (const strata::Error&) {
    // The file (or a sequence of it) was refused: expected for most inputs.
  }
  return 0;
}
