#include "core/dtype.h"

#include "core/error.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace strata {

DType parse_dtype(std::string_view text) {
  std::string t(text);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "f32" || t == "fp32" || t == "float32" || t == "float") return DType::f32;
  if (t == "bf16" || t == "bfloat16") return DType::bf16;
  if (t == "f16" || t == "fp16" || t == "float16" || t == "half") return DType::f16;
  fail("dtype '{}' is not supported; use f32, bf16 or f16", text);
}

namespace {

// One pair of dtypes, its switches folded away.
template <DType D, DType S>
void convert_range(void* dst, const void* src, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) store_f32(dst, D, i, load_f32(src, S, i));
}

template <DType D>
void (*converter_from(DType s))(void*, const void*, size_t, size_t) {
  switch (s) {
    case DType::f32:
      return convert_range<D, DType::f32>;
    case DType::bf16:
      return convert_range<D, DType::bf16>;
    case DType::f16:
      return convert_range<D, DType::f16>;
  }
  return nullptr;
}

}  // namespace

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  if (dst_type == src_type) {
    std::memmove(dst, src, n * dtype_size(dst_type));
    return;
  }
  auto* const range = dst_type == DType::f32    ? converter_from<DType::f32>(src_type)
                      : dst_type == DType::bf16 ? converter_from<DType::bf16>(src_type)
                                                : converter_from<DType::f16>(src_type);
  // A whole unit's parameters (a checkpoint's, a load's) on every core; each element's result
  // is the same wherever it is computed.
  constexpr size_t kGrain = size_t{1} << 16;
  if (n < 16 * kGrain) {
    range(dst, src, 0, n);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, n, kGrain),
      [&](const tbb::blocked_range<size_t>& r) { range(dst, src, r.begin(), r.end()); });
}

}  // namespace strata
