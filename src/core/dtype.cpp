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

namespace {
float load(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(src)[i];
    case DType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
  }
  return 0.0f;
}
void store(void* dst, DType t, size_t i, float v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(dst)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
      break;
  }
}
}  // namespace

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  if (dst_type == src_type) {
    std::memmove(dst, src, n * dtype_size(dst_type));
    return;
  }
  for (size_t i = 0; i < n; ++i) store(dst, dst_type, i, load(src, src_type, i));
}

}  // namespace strata
