// host_device.h: the host backend, a device simulated on the CPU.
#pragma once

#include "core/device.h"

#include <memory>

namespace strata {

// A simulated device `host:index` whose arena holds `arena_bytes`. Each stream is a worker
// thread with an in-order queue; kernels are the plain C++ reference code.
std::unique_ptr<Device> open_host_device(int index, uint64_t arena_bytes);

}  // namespace strata
