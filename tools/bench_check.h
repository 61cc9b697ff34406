// bench_check.h: what the benchmarks that verify a device against the host backend share:
// reading a tensor back as f32, the normalised error they bound, and the median timing.
#pragma once

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace strata::cli {

// `v` (on `device`) copied to the host and converted to f32; waits for `s`.
inline std::vector<float> fetch_f32(Device& device, const TensorView& v, Stream& s) {
  std::vector<uint8_t> raw(v.bytes());
  device.copy_to_host(raw.data(), v.data, raw.size(), s);
  s.synchronize();
  std::vector<float> f(static_cast<size_t>(v.numel()));
  for (size_t i = 0; i < f.size(); ++i) f[i] = load_f32(raw.data(), v.dtype, i);
  return f;
}

// sqrt(sum (got - want)^2 / sum want^2), with want's elements counted as at least 0.1 (the size
// of the values these benchmarks check; a gradient that is zero up to rounding is measured
// against that, not against its noise). Infinite when any difference is not finite.
inline double normalised_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += std::max(static_cast<double>(want[i]) * want[i], 0.01);
  }
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

// The middle of a benchmark's repeated timings (the upper one of an even count), 0 for none.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace strata::cli
