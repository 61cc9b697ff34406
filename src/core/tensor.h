// tensor.h: a non-owning view of a dense, row-major tensor.
//
// A view never frees memory. `device` is null for ordinary host memory; otherwise the
// pointer lives in that device's arena and must only be touched through the Device.
#pragma once

#include "core/dtype.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace strata {

class Device;

struct Shape {
  static constexpr int kMaxDims = 4;
  std::array<int64_t, kMaxDims> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);  // throws Error past kMaxDims or on negatives
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[4096, 11008]"
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Device* device = nullptr;

  int64_t numel() const { return shape.numel(); }
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }
  std::string str() const;  // "bf16[4096, 11008] on cuda:0"
};

}  // namespace strata
