#include "core/dtype.h"

#include "core/error.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>

namespace strata {

DType parse_dtype(std::string_view text) {
  std::string t(text);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "f32" || t == "fp32" || t == "float32" || t == "float") return DType::f32;
  if (t == "bf16" || t == "bfloat16") return DType::bf16;
  if (t == "f16" || t == "fp16" || t == "float16" || t == "half") return DType::f16;
  fail("dtype '{}' is not supported; use f32, bf16 or f16", text);
}

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  if (dst_type == src_type) {
    std::memmove(dst, src, n * dtype_size(dst_type));
    return;
  }
  for (size_t i = 0; i < n; ++i) store_f32(dst, dst_type, i, load_f32(src, src_type, i));
}

}  // namespace strata
