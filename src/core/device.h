// device.h: the interface to one accelerator (DESIGN §4), implemented by the host backend
// (src/host/, simulated on the CPU) and the CUDA backend (src/gpu/).
//
// Everything above this interface (tiers, partitioner, executor) is written once and runs
// on both. Work is queued on Streams, which run in order; Events order work across
// streams. Device memory comes from one arena per device, allocated when the device is
// opened, so a budget is exact and an overflow names the cap.
//
// Errors in queued work: the first exception a host task throws is kept, and the next
// synchronize() of that stream (or of its device) rethrows it once, then clears it. Until
// then later host tasks of that stream are skipped; event markers still complete, so other
// streams never hang on a failed one. (Copies and kernels already queued on a GPU still
// run: a GPU cannot skip them.) A stream may wait on events of other devices of its backend.
#pragma once

#include "core/arena.h"
#include "core/kernels.h"
#include "core/tensor.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class Backend { host, cuda };

class Event {
 public:
  virtual ~Event() = default;
  // True when the work captured by the last record() has finished (or never recorded).
  virtual bool query() = 0;
  // Blocks the calling thread until query() would be true.
  virtual void synchronize() = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
  // `event` completes when all work queued on this stream so far has completed.
  virtual void record(Event& event) = 0;
  // Work queued after this call starts only once `event`'s last record() has completed.
  // Waiting on an event that was never recorded does nothing (as in CUDA).
  virtual void wait(Event& event) = 0;
  // Runs `fn` on a host thread in stream order. It must not queue work on streams, nor wait for
  // another stream's host task: CUDA may run the host tasks of all streams on one thread.
  // An exception it throws is rethrown by synchronize().
  virtual void host_task(std::function<void()> fn) = 0;
  // Blocks until all queued work is done; rethrows the first error raised by it.
  virtual void synchronize() = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual Backend backend() const = 0;
  virtual int index() const = 0;
  virtual std::string name() const = 0;  // "host:0", "cuda:1"

  // ---- memory: one arena per device ----
  // Returns device memory (256-byte aligned), counted in the arena's statistics under `kind`.
  // Throws Error naming the device, `what`, the request and the cap when it does not fit.
  // (Implementations override the three-argument form and say `using Device::allocate;`.)
  virtual void* allocate(uint64_t bytes, std::string_view what, MemoryKind kind) = 0;
  void* allocate(uint64_t bytes, std::string_view what) {
    return allocate(bytes, what, MemoryKind::other);
  }
  virtual void release(void* ptr) = 0;
  virtual ArenaStats memory() const = 0;
  // True when [p, p + bytes) lies inside this device's arena.
  virtual bool owns(const void* p, uint64_t bytes) const = 0;

  // ---- streams and events ----
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  virtual void synchronize() = 0;  // every stream of this device

  // ---- copies, in stream order. Host pointers should be pinned for async copies. ----
  virtual void copy_to_device(void* dst, const void* src, uint64_t bytes, Stream& s) = 0;
  virtual void copy_to_host(void* dst, const void* src, uint64_t bytes, Stream& s) = 0;
  // The ranges must not overlap (CUDA's copies leave that undefined; the host's moves).
  virtual void copy_on_device(void* dst, const void* src, uint64_t bytes, Stream& s) = 0;
  virtual void fill_zero(void* dst, uint64_t bytes, Stream& s) = 0;
  // dst (this device's memory) = src (src_device's memory; src_device of the same backend,
  // possibly this device), queued on s, a stream of this device. Only s orders it: the caller
  // makes s wait for src's producer (an event recorded on src_device's stream). Checks first
  // that s belongs to this device, even when bytes is 0 (which queues nothing).
  virtual void copy_from_peer(void* dst, Device& src_device, const void* src, uint64_t bytes,
                              Stream& s) = 0;

  // ---- kernel table: the model's ops (core/kernels.h), queued on this device's streams ----
  virtual Kernels& kernels() = 0;
  // dst = src cast to dst.dtype (same element count; both in this device's memory),
  // rounding to nearest even exactly as strata::convert does on the host.
  virtual void convert(const TensorView& dst, const TensorView& src, Stream& s) = 0;
};

// Owns one allocation of a Device's arena; released when destroyed. Movable, not copyable.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device& device, uint64_t bytes, std::string_view what,
               MemoryKind kind = MemoryKind::other)
      : device_(&device),
        data_(bytes ? device.allocate(bytes, what, kind) : nullptr),
        bytes_(bytes) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(device_, o.device_);
      std::swap(data_, o.data_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // A view of the buffer's first shape.numel() elements of `dtype` (checked to fit).
  TensorView view(DType dtype, const Shape& shape) const;
  void reset() noexcept;

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// "host:4", "cuda", "cuda:0,1" as given to --devices.
struct DeviceSpec {
  Backend backend = Backend::host;
  std::vector<int> indices;  // host: 0..N-1; cuda: the chosen GPUs (empty = all)
};
// Throws Error naming the text and listing the accepted forms.
DeviceSpec parse_device_spec(std::string_view text);

// Opens the devices of `spec`. `device_memory` caps each arena: required for host devices,
// 0 for CUDA means "all free memory but a reserve for cuBLASLt and NCCL".
std::vector<std::unique_ptr<Device>> open_devices(const DeviceSpec& spec, uint64_t device_memory);

}  // namespace strata
