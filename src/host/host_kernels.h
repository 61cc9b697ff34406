// host_kernels.h: the host backend's kernel table (core/kernels.h) over the reference ops of
// host/ops.h.
//
// Every call checks shapes and that each tensor, id and target array lies in the device's
// memory when it is made (so an error points at the caller), then queues the reference op as
// a host task on the stream. The table holds views by value; the memory must stay allocated
// until the stream has run the op, as with any device.
#pragma once

#include "core/device.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace strata::host {

// What the kernel table needs from its device.
struct KernelQueue {
  // Throws Error unless [ptr, ptr + bytes) lies in the device's memory; `what` names it.
  std::function<void(const void* ptr, uint64_t bytes, const std::string& what)> check_memory;
  // Queues `task` in order on `stream`; throws Error when the stream is not the device's.
  std::function<void(Stream& stream, std::function<void()> task)> enqueue;
};

std::unique_ptr<Kernels> make_kernels(KernelQueue queue);

}  // namespace strata::host
