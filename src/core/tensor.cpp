#include "core/tensor.h"

#include "core/device.h"
#include "core/error.h"

namespace strata {

Shape::Shape(std::initializer_list<int64_t> d) {
  if (d.size() > kMaxDims) fail("tensor rank {} exceeds the supported {}", d.size(), kMaxDims);
  for (int64_t v : d) {
    if (v < 0) fail("tensor dimension {} is negative", v);
    dims[static_cast<size_t>(rank++)] = v;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[static_cast<size_t>(i)] != o.dims[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i)
    s += (i ? ", " : "") + std::to_string(dims[static_cast<size_t>(i)]);
  return s + "]";
}

std::string TensorView::str() const {
  return std::string(dtype_name(dtype)) + shape.str() + " on " +
         (device ? device->name() : std::string("host memory"));
}

}  // namespace strata
