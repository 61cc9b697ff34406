#include "core/device.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "gpu/runtime.h"
#include "host/host_device.h"

#include <charconv>

namespace strata {
namespace {
constexpr const char* kForms = "use host:N (N simulated devices), cuda (all GPUs) or cuda:0,1";

int parse_int(std::string_view all, std::string_view s) {
  int v = -1;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size() || v < 0)
    fail("--devices '{}': '{}' is not a non-negative integer; {}", all, s, kForms);
  return v;
}
}  // namespace

TensorView DeviceBuffer::view(DType dtype, const Shape& shape) const {
  TensorView v{data_, dtype, shape, device_};
  if (v.bytes() > bytes_)
    fail("buffer of {} on {}: a view {} needs {}; allocate a larger buffer", format_bytes(bytes_),
         device_ ? device_->name() : "no device", v.str(), format_bytes(v.bytes()));
  return v;
}

void DeviceBuffer::reset() noexcept {
  if (device_ != nullptr && data_ != nullptr) {
    try {
      device_->release(data_);
    } catch (const Error& e) {
      log_error("{}", e.what());
    }
  }
  data_ = nullptr;
  bytes_ = 0;
}

DeviceSpec parse_device_spec(std::string_view text) {
  DeviceSpec spec;
  const auto colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  const std::string_view rest = colon == std::string_view::npos ? "" : text.substr(colon + 1);
  if (kind == "host") {
    spec.backend = Backend::host;
    const int n = rest.empty() ? 1 : parse_int(text, rest);
    if (n < 1 || n > 64)
      fail("--devices '{}': host device count {} is not in 1..64; {}", text, n, kForms);
    for (int i = 0; i < n; ++i) spec.indices.push_back(i);
  } else if (kind == "cuda") {
    spec.backend = Backend::cuda;
    if (colon != std::string_view::npos) {
      size_t pos = 0;
      while (pos <= rest.size()) {
        const size_t comma = rest.find(',', pos);
        const std::string_view item =
            rest.substr(pos, comma == std::string_view::npos ? rest.npos : comma - pos);
        const int idx = parse_int(text, item);
        for (int seen : spec.indices)
          if (seen == idx) fail("--devices '{}': GPU {} is listed twice", text, idx);
        spec.indices.push_back(idx);
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
      }
    }
  } else {
    fail("--devices '{}' is not understood; {}", text, kForms);
  }
  return spec;
}

std::vector<std::unique_ptr<Device>> open_devices(const DeviceSpec& spec, uint64_t device_memory) {
  std::vector<std::unique_ptr<Device>> devices;
  if (spec.backend == Backend::host) {
    if (device_memory == 0)
      fail("host devices need a memory cap; pass --device-memory (for example 256MiB)");
    for (int i : spec.indices) devices.push_back(open_host_device(i, device_memory));
    return devices;
  }
  const CudaRuntime& rt = cuda_runtime();
  if (!rt.compiled)
    fail(
        "--devices cuda: this strata was built without the CUDA backend; rebuild on a machine "
        "with the CUDA toolkit (STRATA_CUDA=ON) or use --devices host:N");
  if (rt.gpus.empty())
    fail("--devices cuda: no usable GPU ({}{}{}); check nvidia-smi, or use --devices host:N",
         rt.status, rt.detail.empty() ? "" : ": ", rt.detail);
  std::vector<int> indices = spec.indices;
  if (indices.empty())
    for (const CudaGpu& g : rt.gpus) indices.push_back(g.index);
  for (int i : indices) {
    if (i >= static_cast<int>(rt.gpus.size()))
      fail("--devices cuda:{}: GPU {} does not exist; this machine has {} (cuda:0..{})", i, i,
           rt.gpus.size(), rt.gpus.size() - 1);
    devices.push_back(open_cuda_device(i, device_memory));
  }
  return devices;
}

}  // namespace strata
