// fuzz_safetensors.cpp: the safetensors reader on arbitrary bytes.
//
// The input is a whole .safetensors file: the 8-byte header length, the JSON header, the data.
// SafetensorsReader::open checks the header; when it accepts one, every tensor is read back
// (converted to f32 and to bf16, and through read_checked with its own shape), so that offsets
// the header check let through are also dereferenced. A strata::Error is the reader refusing
// the file, which is the expected outcome for most inputs; anything else is a finding.
#include "core/dtype.h"
#include "core/error.h"
#include "fuzz_input.h"
#include "model/safetensors.h"

#include <cstddef>
#include <cstdint>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const strata::fuzz::MemoryFile file(data, size);
  try {
    const strata::SafetensorsReader reader = strata::SafetensorsReader::open(file.path());
    size_t metadata_bytes = 0;
    for (const auto& [key, value] : reader.metadata()) metadata_bytes += key.size() + value.size();
    (void)metadata_bytes;
    for (const strata::SafetensorsEntry& e : reader.tensors()) {
      // Every byte of a tensor lies inside the input (the reader checks data_offsets against
      // the file), so these buffers are at most twice the input's size.
      const auto n = static_cast<size_t>(e.numel());
      std::vector<float> f32(n);
      reader.read(e.name, f32.data(), strata::DType::f32);
      std::vector<uint16_t> half(n);
      reader.read_checked(e.name, half.data(), strata::DType::bf16, e.shape);
      if (reader.find(e.name) != &e) __builtin_trap();  // the lookup must find what it listed
      (void)e.shape_str();
    }
    reader.read("strata-fuzz: no such tensor", nullptr, strata::DType::f32);  // must throw
    __builtin_trap();
  } catch (const strata::Error&) {
    // The reader refused the input (or the missing tensor above): expected.
  }
  return 0;
}
