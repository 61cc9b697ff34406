// cuda_device.cpp: strata::Device for one GPU (DESIGN §4), with its streams and events.
//
// One process drives every GPU, and the current CUDA device is per host thread, so every
// call that touches CUDA first sets this device (`use()`). The arena is one cudaMalloc made
// when the device is opened and carved by strata::Arena; every device pointer passed in is
// checked to lie inside it. A host task runs on CUDA's callback thread (cudaLaunchHostFunc)
// and must make no CUDA call. Errors follow the host backend (host_device.cpp): the first
// exception of a host task is kept and later host tasks of that stream are skipped until the
// next synchronize() of the stream (or of the device) rethrows it once. Copies and kernels
// queued after it still run: the GPU cannot skip them. Streams share the device's state
// through a shared_ptr, so a stream may outlive its Device. Each stream owns a workspace for
// cuBLASLt and the kernels' scratch (cuda_kernels.h), outside the arena, freed with it. The
// kernel table (cuda_kernels.cpp) reaches the device through CudaDeviceAccess.
#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "gpu/convert.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/cuda_stream.h"
#include "gpu/runtime.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <vector>

namespace strata {
namespace {

constexpr uint64_t kAlignment = 256;
constexpr uint64_t kGiB = uint64_t{1} << 30;

class CudaStream;

// What a device and its streams share; it outlives whichever of them goes last.
struct GpuState {
  int index;
  std::string name;  // "cuda:0"
  std::mutex streams_mutex;
  std::vector<CudaStream*> streams;
  void use() const { CUDA_CHECK(cudaSetDevice(index)); }
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    CUDA_CHECK(cudaSetDevice(device_));
    // Blocking sync: a thread waiting in synchronize() sleeps instead of spinning a core that
    // CPU Adam and the I/O lanes need.
    CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  ~CudaEvent() override {
    if (const cudaError_t err = cudaEventDestroy(event_); err != cudaSuccess) {
      (void)cudaGetLastError();
      log_error("cuda:{}: cudaEventDestroy failed: {}", device_, cuda_error_text(err));
    }
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  // A never-recorded CUDA event reports cudaSuccess: complete, as the interface asks.
  bool query() override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      // Not an error; make sure it is not left as the thread's last error either.
      if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
      return false;
    }
    cuda_fail(err, "cudaEventQuery(event_)", __FILE__, __LINE__);
  }
  void synchronize() override { CUDA_CHECK(cudaEventSynchronize(event_)); }

  int device() const { return device_; }
  cudaEvent_t handle() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

CudaEvent& cuda_event(Event& event, std::string_view stream_name) {
  auto* e = dynamic_cast<CudaEvent*>(&event);
  if (e == nullptr)
    fail(
        "stream '{}': the event was not created by a CUDA device; use the device's "
        "create_event()",
        stream_name);
  return *e;
}

class CudaStream final : public Stream {
 public:
  CudaStream(std::shared_ptr<GpuState> gpu, std::string name);
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  const std::string& name() const override { return name_; }
  void record(Event& event) override;
  void wait(Event& event) override;
  void host_task(std::function<void()> fn) override;
  void synchronize() override;

  const GpuState* gpu() const { return gpu_.get(); }
  cudaStream_t handle() const { return stream_; }
  // kStreamWorkspaceBytes of device memory for work queued on this stream, allocated on first
  // use and freed with the stream.
  void* workspace();
  // The first host-task failure since the last call, as a full message; cleared.
  std::optional<std::string> take_error();

 private:
  struct HostTask {
    std::function<void()> fn;
    CudaStream* stream;
  };
  static void run_host_task(void* data);
  bool failed();
  void keep_error(std::string what);

  std::shared_ptr<GpuState> gpu_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  CudaEvent idle_;  // synchronize()'s: a blocking-sync event, so waiting sleeps
  std::mutex error_mutex_;
  std::optional<std::string> error_;
  std::mutex workspace_mutex_;
  void* workspace_ = nullptr;
};

class CudaDevice final : public Device, private CudaDeviceAccess {
 public:
  CudaDevice(int index, uint64_t arena_bytes);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  Backend backend() const override { return Backend::cuda; }
  int index() const override { return gpu_->index; }
  std::string name() const override { return gpu_->name; }

  using Device::allocate;
  void* allocate(uint64_t bytes, std::string_view what, MemoryKind kind) override {
    return base_ + arena_->allocate(bytes, what, kind);
  }
  void release(void* ptr) override;
  ArenaStats memory() const override { return arena_->stats(); }
  bool owns(const void* p, uint64_t bytes) const override { return in_arena(p, bytes); }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CudaStream>(gpu_, std::move(name));
  }
  std::unique_ptr<Event> create_event() override {
    return std::make_unique<CudaEvent>(gpu_->index);
  }
  void synchronize() override;

  void copy_to_device(void* dst, const void* src, uint64_t bytes, Stream& s) override;
  void copy_to_host(void* dst, const void* src, uint64_t bytes, Stream& s) override;
  void copy_on_device(void* dst, const void* src, uint64_t bytes, Stream& s) override;
  void fill_zero(void* dst, uint64_t bytes, Stream& s) override;
  void copy_from_peer(void* dst, Device& src_device, const void* src, uint64_t bytes,
                      Stream& s) override;
  Kernels& kernels() override { return *kernels_; }
  void convert(const TensorView& dst, const TensorView& src, Stream& s) override;

  // For cuda_stream_handle (cuda_stream.h).
  cudaStream_t stream_handle(Stream& s) const { return enter(s); }

 private:
  // CudaDeviceAccess, for the kernel table.
  const std::string& device_name() const override { return gpu_->name; }
  int device_index() const override { return gpu_->index; }
  cudaStream_t enter(Stream& s) const override {
    CudaStream& cs = own(s);
    use();
    return cs.handle();
  }
  void* workspace(Stream& s) const override { return own(s).workspace(); }
  void check_in_arena(const char* op, const char* which, const void* ptr,
                      uint64_t bytes) const override;

  void use() const { gpu_->use(); }
  CudaStream& own(Stream& s) const;
  bool in_arena(const void* ptr, uint64_t bytes) const;
  void check_host(const char* op, const char* which, const void* ptr, uint64_t bytes) const;
  void copy(const char* op, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind,
            Stream& s);

  std::shared_ptr<GpuState> gpu_;
  const std::string& name_ = gpu_->name;
  char* base_ = nullptr;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Kernels> kernels_ = make_cuda_kernels(*this);  // makes no CUDA call
};

// ---- CudaStream ----

CudaStream::CudaStream(std::shared_ptr<GpuState> gpu, std::string name)
    : gpu_(std::move(gpu)), name_(std::move(name)), idle_(gpu_->index) {
  gpu_->use();
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  std::lock_guard lock(gpu_->streams_mutex);
  gpu_->streams.push_back(this);
}

CudaStream::~CudaStream() {
  {
    std::lock_guard lock(gpu_->streams_mutex);
    std::erase(gpu_->streams, this);
  }
  // Host tasks still queued point at this stream: let them finish first.
  cudaError_t err = cudaSetDevice(gpu_->index);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  if (err == cudaSuccess && workspace_ != nullptr) err = cudaFree(workspace_);
  if (err == cudaSuccess) err = cudaStreamDestroy(stream_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    log_error("stream '{}' on {}: teardown failed: {}", name_, gpu_->name, cuda_error_text(err));
  }
  if (error_) log_error("stream '{}' on {}: unreported: {}", name_, gpu_->name, *error_);
}

void CudaStream::record(Event& event) {
  CudaEvent& e = cuda_event(event, name_);
  if (e.device() != gpu_->index)
    fail(
        "stream '{}' on {}: cannot record an event of cuda:{}; record events created by the "
        "stream's own device (any stream may wait on any event)",
        name_, gpu_->name, e.device());
  gpu_->use();
  CUDA_CHECK(cudaEventRecord(e.handle(), stream_));
}

void CudaStream::wait(Event& event) {
  CudaEvent& e = cuda_event(event, name_);
  gpu_->use();
  CUDA_CHECK(cudaStreamWaitEvent(stream_, e.handle(), 0));
}

void CudaStream::run_host_task(void* data) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(data));
  if (task->stream->failed()) return;  // skipped until the error is reported
  try {
    task->fn();
  } catch (const std::exception& e) {
    task->stream->keep_error(e.what());
  } catch (...) {
    task->stream->keep_error("a host task threw an exception that is not a std::exception");
  }
}

void CudaStream::host_task(std::function<void()> fn) {
  auto task = std::make_unique<HostTask>(HostTask{std::move(fn), this});
  gpu_->use();
  CUDA_CHECK(cudaLaunchHostFunc(stream_, &CudaStream::run_host_task, task.get()));
  (void)task.release();  // run_host_task owns it now
}

bool CudaStream::failed() {
  std::lock_guard lock(error_mutex_);
  return error_.has_value();
}

void CudaStream::keep_error(std::string what) {
  std::lock_guard lock(error_mutex_);
  if (!error_)
    error_ = fmt::format("stream '{}' on {}: host task failed: {}", name_, gpu_->name, what);
}

void* CudaStream::workspace() {
  std::lock_guard lock(workspace_mutex_);
  if (workspace_ == nullptr) {
    gpu_->use();
    if (const cudaError_t err = cudaMalloc(&workspace_, kStreamWorkspaceBytes);
        err != cudaSuccess) {
      (void)cudaGetLastError();
      workspace_ = nullptr;
      fail(
          "stream '{}' on {}: cannot allocate its {} workspace (cuBLASLt, reductions) outside "
          "the arena: {}; pass a smaller --device-memory",
          name_, gpu_->name, format_bytes(kStreamWorkspaceBytes), cuda_error_text(err));
    }
  }
  return workspace_;
}

std::optional<std::string> CudaStream::take_error() {
  std::lock_guard lock(error_mutex_);
  std::optional<std::string> e;
  e.swap(error_);
  return e;
}

// Every executor task ends here. cudaStreamSynchronize would spin (CUDA's default scheduling
// spins while a process has no more contexts than CPUs), taking a core from CPU Adam and the
// I/O lanes for each waiting lane; an event of the stream's own, with blocking sync, sleeps.
void CudaStream::synchronize() {
  record(idle_);
  idle_.synchronize();
  if (auto e = take_error()) throw Error(*e);
}

// ---- CudaDevice ----

CudaDevice::CudaDevice(int index, uint64_t arena_bytes)
    : gpu_(std::make_shared<GpuState>(index, fmt::format("cuda:{}", index))) {
  use();
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (arena_bytes == 0) {
    // cuBLASLt workspaces, NCCL buffers and the CUDA context live outside the arena.
    const uint64_t reserve = std::max<uint64_t>(kGiB, total_bytes / 20);
    if (free_bytes <= reserve + kGiB)
      fail(
          "{}: only {} of {} is free, too little for an arena after the {} kept for cuBLASLt "
          "and NCCL; free the GPU (nvidia-smi lists its processes) or pick another GPU",
          name_, format_bytes(free_bytes), format_bytes(total_bytes), format_bytes(reserve));
    arena_bytes = (free_bytes - reserve) & ~((uint64_t{2} << 20) - 1);  // whole 2 MiB pages
  } else if (arena_bytes > free_bytes) {
    fail(
        "{}: --device-memory {} exceeds the GPU's free memory {} (total {}); pass a smaller "
        "--device-memory, or free the GPU (nvidia-smi lists its processes)",
        name_, format_bytes(arena_bytes), format_bytes(free_bytes), format_bytes(total_bytes));
  }
  void* base = nullptr;
  if (const cudaError_t err = cudaMalloc(&base, arena_bytes); err != cudaSuccess) {
    (void)cudaGetLastError();
    fail("{}: cannot allocate its {} arena ({} free of {}): {}; pass a smaller --device-memory",
         name_, format_bytes(arena_bytes), format_bytes(free_bytes), format_bytes(total_bytes),
         cuda_error_text(err));
  }
  base_ = static_cast<char*>(base);
  arena_ = std::make_unique<Arena>(
      arena_bytes, kAlignment, "device " + name_,
      "lower the micro-batch, offload more state, or pass a smaller --device-memory");
}

CudaDevice::~CudaDevice() {
  cudaError_t err = cudaSetDevice(gpu_->index);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  kernels_.reset();  // frees the cuBLASLt handle, with the GPU current and idle
  if (err == cudaSuccess) err = cudaFree(base_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    log_error("{}: teardown failed: {}", name_, cuda_error_text(err));
  }
}

void CudaDevice::release(void* ptr) {
  if (ptr == nullptr) return;
  if (!in_arena(ptr, 1))
    fail("{}: release of {} which is not in this device's memory (arena {} + {})", name_, ptr,
         static_cast<const void*>(base_), format_bytes(arena_->stats().capacity));
  arena_->release(reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(base_));
}

void CudaDevice::synchronize() {
  use();
  CUDA_CHECK(cudaDeviceSynchronize());
  // Rethrows the first stream error and logs the others, which are reported now too.
  std::optional<std::string> first;
  std::lock_guard lock(gpu_->streams_mutex);
  for (CudaStream* s : gpu_->streams) {
    if (auto e = s->take_error(); e && !first)
      first = std::move(e);
    else if (e)
      log_error("{}", *e);
  }
  if (first) throw Error(*first);
}

CudaStream& CudaDevice::own(Stream& s) const {
  auto* cs = dynamic_cast<CudaStream*>(&s);
  if (cs == nullptr || cs->gpu() != gpu_.get())
    fail("{}: stream '{}' belongs to {}; queue work on a stream this device created", name_,
         s.name(), cs == nullptr ? std::string("another backend") : cs->gpu()->name);
  return *cs;
}

bool CudaDevice::in_arena(const void* ptr, uint64_t bytes) const {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  const auto base = reinterpret_cast<uintptr_t>(base_);
  const uint64_t capacity = arena_->stats().capacity;
  return p >= base && p - base <= capacity && bytes <= capacity - (p - base);
}

void CudaDevice::check_in_arena(const char* op, const char* which, const void* ptr,
                                uint64_t bytes) const {
  if (!in_arena(ptr, bytes))
    fail(
        "{}: {}: {} {} (+{}) is not in this device's memory (arena {} + {}); pass memory from "
        "this device's allocate()",
        name_, op, which, ptr, format_bytes(bytes), static_cast<const void*>(base_),
        format_bytes(arena_->stats().capacity));
}

void CudaDevice::check_host(const char* op, const char* which, const void* ptr,
                            uint64_t bytes) const {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  const auto base = reinterpret_cast<uintptr_t>(base_);
  if (ptr == nullptr || (p < base + arena_->stats().capacity && p + bytes > base))
    fail(
        "{}: {}: {} {} (+{}) is not host memory; use copy_on_device for device-to-device "
        "copies",
        name_, op, which, ptr, format_bytes(bytes));
}

void CudaDevice::copy(const char* op, void* dst, const void* src, uint64_t bytes,
                      cudaMemcpyKind kind, Stream& s) {
  CudaStream& cs = own(s);
  if (bytes == 0) return;
  if (kind == cudaMemcpyHostToDevice) check_host(op, "source", src, bytes);
  if (kind == cudaMemcpyDeviceToHost) check_host(op, "destination", dst, bytes);
  if (kind != cudaMemcpyHostToDevice) check_in_arena(op, "source", src, bytes);
  if (kind != cudaMemcpyDeviceToHost) check_in_arena(op, "destination", dst, bytes);
  use();
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cs.handle()));
}

void CudaDevice::copy_to_device(void* dst, const void* src, uint64_t bytes, Stream& s) {
  copy("copy_to_device", dst, src, bytes, cudaMemcpyHostToDevice, s);
}
void CudaDevice::copy_to_host(void* dst, const void* src, uint64_t bytes, Stream& s) {
  copy("copy_to_host", dst, src, bytes, cudaMemcpyDeviceToHost, s);
}
void CudaDevice::copy_on_device(void* dst, const void* src, uint64_t bytes, Stream& s) {
  copy("copy_on_device", dst, src, bytes, cudaMemcpyDeviceToDevice, s);
}

void CudaDevice::fill_zero(void* dst, uint64_t bytes, Stream& s) {
  CudaStream& cs = own(s);
  if (bytes == 0) return;
  check_in_arena("fill_zero", "destination", dst, bytes);
  use();
  CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cs.handle()));
}

// Two CudaDevice objects may share one GPU (virtual ranks in tests): a plain device-to-device
// copy then; between GPUs cudaMemcpyPeerAsync, which works with or without peer access.
void CudaDevice::copy_from_peer(void* dst, Device& src_device, const void* src, uint64_t bytes,
                                Stream& s) {
  CudaStream& cs = own(s);
  if (bytes == 0) return;
  check_in_arena("copy_from_peer", "destination", dst, bytes);
  if (dynamic_cast<CudaDevice*>(&src_device) == nullptr)
    fail(
        "{}: copy_from_peer from {}, a device of another backend; peer copies join CUDA "
        "devices only (copy through host memory otherwise)",
        name_, src_device.name());
  if (!src_device.owns(src, bytes))
    fail(
        "{}: copy_from_peer source {} (+{}) is not in {}'s memory; pass memory from {}'s "
        "allocate()",
        name_, src, format_bytes(bytes), src_device.name(), src_device.name());
  use();
  if (src_device.index() == gpu_->index)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cs.handle()));
  else
    CUDA_CHECK(cudaMemcpyPeerAsync(dst, gpu_->index, src, src_device.index(), bytes, cs.handle()));
}

void CudaDevice::convert(const TensorView& dst, const TensorView& src, Stream& s) {
  CudaStream& cs = own(s);
  if (dst.numel() != src.numel())
    fail("{}: convert {} -> {}: the element counts differ ({} vs {})", name_, src.str(), dst.str(),
         src.numel(), dst.numel());
  if (dst.numel() == 0) return;
  check_in_arena("convert", "source", src.data, src.bytes());
  check_in_arena("convert", "destination", dst.data, dst.bytes());
  use();
  launch_convert(dst.data, dst.dtype, src.data, src.dtype, static_cast<uint64_t>(dst.numel()),
                 cs.handle());
}

}  // namespace

cudaStream_t cuda_stream_handle(Device& device, Stream& s) {
  auto* cuda = dynamic_cast<CudaDevice*>(&device);
  if (cuda == nullptr)
    fail("{} is not a CUDA device; a CUDA stream handle exists only for CUDA devices' streams",
         device.name());
  return cuda->stream_handle(s);
}

std::unique_ptr<Device> open_cuda_device(int index, uint64_t arena_bytes) {
  const CudaRuntime& rt = cuda_runtime();
  if (rt.gpus.empty())
    fail("cuda:{}: no usable GPU ({}{}{}); check nvidia-smi, or use --devices host:N", index,
         rt.status, rt.detail.empty() ? "" : ": ", rt.detail);
  if (index < 0 || index >= static_cast<int>(rt.gpus.size()))
    fail("cuda:{}: no such GPU; this machine has {} (cuda:0..{})", index, rt.gpus.size(),
         rt.gpus.size() - 1);
  return std::make_unique<CudaDevice>(index, arena_bytes);
}

}  // namespace strata
