// runtime.cpp: the CUDA runtime API (cuda_runtime_api.h) on the CPU, for the emulator.
//
// A stream is a FIFO of tasks run in order by the stream's own worker thread, with the stream's
// device current there. Its progress is two counters: tasks queued and tasks done. An event
// records a mark (stream, tasks queued so far) and is complete once that stream has done that
// many; so recording queues nothing, re-recording cannot disturb an earlier wait (the wait took
// the mark by value), and a never-recorded event is complete. Waiting, by a host thread or by a
// worker (cudaStreamWaitEvent queues a task that waits for the mark), sleeps on the stream's
// condition variable: nothing spins.
//
// Where CUDA's semantics are subtle, the emulator chooses:
// - The default stream (0, cudaStreamLegacy, cudaStreamPerThread) is one more stream per device,
//   with no implicit synchronisation with the other streams: strata makes non-blocking streams.
// - cudaStreamDestroy returns at once; the queued work still runs, then the worker exits (CUDA
//   releases the stream "once the device has completed all work in stream").
// - cudaFree first waits for every stream of the allocation's device, as CUDA's does, so that
//   queued work never touches unmapped pages. cudaMalloc does not wait.
// - A task that throws makes the device's error sticky (cudaErrorLaunchFailure, what() printed
//   once). From then on the device runs no task of any stream (they still count as done, so
//   no wait hangs), and its calls return the error: everything that queues or waits, cudaMalloc,
//   cudaFree, cudaMemGetInfo, cudaGetLastError. Device queries and cudaSetDevice still answer.
// - cudaErrorNotReady from a query is not kept as the thread's last error (it is no failure).
// - A host function may make no CUDA call (CUDA: cudaErrorNotPermitted), and no task may make a
//   call that blocks (it would deadlock): both return cudaErrorNotPermitted.
// - Device memory is mmap'ed (page-aligned, so 256-aligned), and its pages cost nothing until
//   touched; it is not filled with a pattern, which would touch them. Free memory is the
//   capacity less the live allocations (each rounded up to 256 bytes).
// - Nothing here is destroyed at exit: the state is leaked on purpose, so that workers still
//   asleep (or running) when the process exits find it intact.
#include "emu_internal.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

struct CUstream_st {
  int device = 0;
  bool is_default = false;
  bool destroyed = false;  // by cudaStreamDestroy; guarded by Runtime::handle_mutex
  std::mutex mutex;
  std::condition_variable work_cv;  // the worker's: a task was queued, or the stream closed
  std::condition_variable done_cv;  // waiters': `wake_at` tasks were done
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0, done = 0;
  // The fewest done tasks a waiter waits for: the worker wakes the waiters once that many are
  // done rather than after every task (each wake-up a context switch); a waiter still short of
  // its own count sets it again.
  uint64_t wake_at = ~uint64_t{0};
  bool closing = false;  // destroyed: the worker drains the queue, then exits
};

struct CUevent_st {
  int device = 0;
  std::mutex mutex;
  std::shared_ptr<CUstream_st> stream;  // of the last record; null: never recorded
  uint64_t seq = 0;                     // complete once stream->done >= seq
};

namespace {

constexpr size_t kAllocAlignment = 256;
constexpr int kSharedPerBlock = 48 * 1024;

struct Device {
  size_t used = 0;  // live cudaMalloc bytes; guarded by Runtime::mem_mutex
  std::atomic<int> sticky{cudaSuccess};
  std::shared_ptr<CUstream_st> default_stream;  // guarded by Runtime::handle_mutex
};

struct Alloc {
  size_t size;  // as asked
  int device;
};

struct Runtime {
  int count = 1;
  size_t capacity = size_t{4} << 30;
  int shared_optin = 232448;
  std::vector<Device> devices;
  // Lock order: handle_mutex, then a stream's mutex; an event's mutex, then a stream's.
  std::shared_mutex handle_mutex;
  // Streams being destroyed stay here, marked, until their worker has drained them.
  std::unordered_map<CUstream_st*, std::shared_ptr<CUstream_st>> streams;
  std::unordered_map<CUevent_st*, std::shared_ptr<CUevent_st>> events;
  std::shared_mutex mem_mutex;
  std::map<uintptr_t, Alloc> allocs;   // by base address
  std::map<uintptr_t, size_t> pinned;  // cudaHostAlloc: base -> size
  std::mutex attr_mutex;
  std::map<std::pair<int, const void*>, int> max_dynamic_shared;  // (device, function)
  Runtime();
};

[[noreturn]] void bad_setting(const char* name, const char* value, const char* want) {
  std::fprintf(stderr, "cuda emulator: %s=\"%s\" is not %s\n", name, value, want);
  std::abort();
}

// A byte count with an optional binary suffix: 4G, 4GiB, 512M, 64KiB, 1000.
size_t env_bytes(const char* name, size_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(text, &end, 10);
  std::string suffix(end);
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int shift = -1;
  if (suffix.empty() || suffix == "b") shift = 0;
  static constexpr std::pair<char, int> kUnits[] = {{'k', 10}, {'m', 20}, {'g', 30}, {'t', 40}};
  for (const auto& [letter, bits] : kUnits)
    if (suffix == std::string(1, letter) || suffix == std::string(1, letter) + "ib") shift = bits;
  if (end == text || shift < 0 || n == 0 || n > (~0ull >> shift))
    bad_setting(name, text, "a byte count such as 4G, 4GiB, 512MiB or 1048576");
  return static_cast<size_t>(n << shift);
}

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || n < lo || n > hi) bad_setting(name, text, "a valid count");
  return static_cast<int>(n);
}

Runtime::Runtime()
    : count(env_int("STRATA_EMU_GPUS", 1, 0, 64)),
      capacity(env_bytes("STRATA_EMU_GPU_MEMORY", size_t{4} << 30)),
      shared_optin(env_int("STRATA_EMU_SHARED_OPTIN", 232448, kSharedPerBlock, 1 << 30)),
      devices(static_cast<size_t>(count)) {}

// Never destroyed: see the top of the file.
Runtime& rt() {
  static Runtime* const runtime = new Runtime();
  return *runtime;
}

thread_local int tl_device = 0;
thread_local cudaError_t tl_last = cudaSuccess;
thread_local bool tl_worker = false;   // a stream's worker thread
thread_local bool tl_host_fn = false;  // running a cudaLaunchHostFunc function

// Every failed call leaves its error as the thread's last error.
cudaError_t result(cudaError_t err) {
  if (err != cudaSuccess) tl_last = err;
  return err;
}

cudaError_t check_device(int device) {
  if (rt().count == 0) return cudaErrorNoDevice;
  return device >= 0 && device < rt().count ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t sticky(int device) {
  return static_cast<cudaError_t>(rt().devices[static_cast<size_t>(device)].sticky.load());
}

// For a call that works on the current device: the device, or why it cannot.
cudaError_t current(int* device) {
  if (tl_host_fn) return cudaErrorNotPermitted;
  if (rt().count == 0) return cudaErrorNoDevice;
  *device = tl_device;
  return sticky(*device);
}

// A call that would block cannot be made by a task: its stream would wait for itself.
cudaError_t may_block() {
  return tl_worker ? cudaErrorNotPermitted : cudaSuccess;
}

void fault(int device, const char* what) {
  int expected = cudaSuccess;
  if (rt().devices[static_cast<size_t>(device)].sticky.compare_exchange_strong(
          expected, cudaErrorLaunchFailure))
    std::fprintf(stderr, "cuda emulator: cuda:%d: %s (cudaErrorLaunchFailure from now on)\n",
                 device, what);
}

void run_task(int device, const std::function<void()>& task) {
  if (sticky(device) != cudaSuccess) return;  // a faulted GPU runs nothing more
  try {
    task();
  } catch (const std::exception& e) {
    fault(device, e.what());
  } catch (...) {
    fault(device, "a task threw an exception that is not a std::exception");
  }
}

void work(std::shared_ptr<CUstream_st> s) {
  tl_device = s->device;
  tl_worker = true;
  std::unique_lock lock(s->mutex);
  for (;;) {
    s->work_cv.wait(lock, [&] { return !s->queue.empty() || s->closing; });
    if (s->queue.empty()) break;
    std::function<void()> task = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    run_task(s->device, task);
    task = nullptr;  // what it holds (a staging buffer) goes before it counts as done
    lock.lock();
    if (++s->done >= s->wake_at) {
      s->wake_at = ~uint64_t{0};
      s->done_cv.notify_all();
    }
  }
  lock.unlock();
  std::unique_lock registry(rt().handle_mutex);
  rt().streams.erase(s.get());
}

// A stream with its worker running, not yet registered.
std::shared_ptr<CUstream_st> start_stream(int device, bool is_default) {
  auto s = std::make_shared<CUstream_st>();
  s->device = device;
  s->is_default = is_default;
  std::thread(work, s).detach();  // it exits by itself once the stream is destroyed and drained
  return s;
}

std::shared_ptr<CUstream_st> default_stream(int device) {
  Device& d = rt().devices[static_cast<size_t>(device)];
  {
    std::shared_lock lock(rt().handle_mutex);
    if (d.default_stream) return d.default_stream;
  }
  std::unique_lock lock(rt().handle_mutex);
  if (!d.default_stream) {
    d.default_stream = start_stream(device, true);
    rt().streams.emplace(d.default_stream.get(), d.default_stream);
  }
  return d.default_stream;
}

bool is_default_handle(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// The live stream behind a handle (the current device's default stream for 0), or null.
std::shared_ptr<CUstream_st> find_stream(cudaStream_t handle) {
  if (is_default_handle(handle)) return rt().count == 0 ? nullptr : default_stream(tl_device);
  std::shared_lock lock(rt().handle_mutex);
  const auto it = rt().streams.find(handle);
  return it == rt().streams.end() || it->second->destroyed ? nullptr : it->second;
}

// For a call on a stream: the stream, or why it cannot take the call (sticky error included
// unless `with_sticky` is false).
cudaError_t use_stream(cudaStream_t handle, std::shared_ptr<CUstream_st>* s,
                       bool with_sticky = true) {
  if (tl_host_fn) return cudaErrorNotPermitted;
  *s = find_stream(handle);
  if (!*s) return rt().count == 0 ? cudaErrorNoDevice : cudaErrorInvalidResourceHandle;
  return with_sticky ? sticky((*s)->device) : cudaSuccess;
}

std::shared_ptr<CUevent_st> find_event(cudaEvent_t handle) {
  std::shared_lock lock(rt().handle_mutex);
  const auto it = rt().events.find(handle);
  return it == rt().events.end() ? nullptr : it->second;
}

uint64_t push(CUstream_st& s, std::function<void()> task) {
  uint64_t seq = 0;
  {
    std::lock_guard lock(s.mutex);
    s.queue.push_back(std::move(task));
    seq = ++s.queued;
  }
  s.work_cv.notify_one();
  return seq;
}

void wait_done(CUstream_st& s, uint64_t seq) {
  std::unique_lock lock(s.mutex);
  while (s.done < seq) {
    s.wake_at = std::min(s.wake_at, seq);
    s.done_cv.wait(lock);
  }
}

uint64_t queued(CUstream_st& s) {
  std::lock_guard lock(s.mutex);
  return s.queued;
}

struct Mark {
  std::shared_ptr<CUstream_st> stream;
  uint64_t seq = 0;
};

Mark mark_of(CUevent_st& e) {
  std::lock_guard lock(e.mutex);
  return {e.stream, e.seq};
}

bool reached(const Mark& m) {
  if (!m.stream) return true;
  std::lock_guard lock(m.stream->mutex);
  return m.stream->done >= m.seq;
}

// Waits for all the work queued so far on the device's streams, the default one included.
void sync_device(int device) {
  std::vector<Mark> marks;
  {
    std::shared_lock lock(rt().handle_mutex);
    for (const auto& [handle, s] : rt().streams)
      if (s->device == device) marks.push_back({s, queued(*s)});
  }
  for (const Mark& m : marks) wait_done(*m.stream, m.seq);
}

// [p, p + bytes) within one entry of `map` (base -> entry); the entry, or null.
template <typename Map>
const typename Map::value_type* find_range(const Map& map, const void* p, size_t bytes) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto it = map.upper_bound(at);
  if (p == nullptr || it == map.begin()) return nullptr;
  --it;
  size_t size = 0;
  if constexpr (std::is_same_v<typename Map::mapped_type, Alloc>)
    size = it->second.size;
  else
    size = it->second;
  const size_t offset = at - it->first;
  return offset <= size && bytes <= size - offset ? &*it : nullptr;
}

size_t rounded(size_t bytes) {
  return (bytes + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
}

void* map_pages(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// What the pointers of a copy must be, checked at the call as CUDA does; resolves
// cudaMemcpyDefault from them.
cudaError_t check_copy(void* dst, const void* src, size_t count, cudaMemcpyKind* kind) {
  int device = 0;
  const bool dst_dev = cuda_emu::device_range(dst, count, &device);
  const bool src_dev = cuda_emu::device_range(src, count, &device);
  switch (*kind) {
    case cudaMemcpyHostToHost:
      return dst != nullptr && src != nullptr ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToDevice:
      return dst_dev && src != nullptr ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost:
      return src_dev && dst != nullptr ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice:
      return dst_dev && src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault:
      if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
      *kind = src_dev ? (dst_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                      : (dst_dev ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
      return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

// cudaMemcpyAsync, and cudaMemcpy with `sync`. A pageable source is staged at the call, so that
// the caller may reuse it at once; a pageable destination makes the call wait for the copy (both
// as in CUDA).
cudaError_t copy_async(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                       cudaStream_t stream, bool sync) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  if (count == 0) return cudaSuccess;
  if (cudaError_t err = check_copy(dst, src, count, &kind); err != cudaSuccess) return result(err);
  const bool src_host = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
  const bool dst_host = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
  const bool wait = sync || (dst_host && !cuda_emu::pinned_range(dst, count));
  if (wait && may_block() != cudaSuccess) return result(cudaErrorNotPermitted);
  uint64_t seq = 0;
  if (src_host && !wait && !cuda_emu::pinned_range(src, count)) {
    std::shared_ptr<char[]> staged(new (std::nothrow) char[count]);
    if (!staged) return result(cudaErrorMemoryAllocation);
    std::memcpy(staged.get(), src, count);
    seq = push(*s, [dst, staged, count] { std::memcpy(dst, staged.get(), count); });
  } else {
    seq = push(*s, [dst, src, count] { std::memmove(dst, src, count); });
  }
  if (!wait) return cudaSuccess;
  wait_done(*s, seq);
  return result(sticky(s->device));
}

struct ErrorText {
  cudaError_t code;
  const char* name;
  const char* text;
};

constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorCudartUnloading, "cudaErrorCudartUnloading", "driver shutting down"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
    {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice",
     "no kernel image is available for execution on the device"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText* error_text(cudaError_t err) {
  for (const ErrorText& e : kErrors)
    if (e.code == err) return &e;
  return nullptr;
}

// Distinct per device, like the GPUs of one node.
int pci_bus(int device) {
  return 0x18 + 0x10 * device;
}

}  // namespace

// ---- cuda_emu (emu_internal.h) ----

namespace cuda_emu {

void enqueue(cudaStream_t stream, std::function<void()> task) {
  std::shared_ptr<CUstream_st> s;
  // A launch that cannot be queued reports through cudaGetLastError, as a kernel launch does.
  if (const cudaError_t err = use_stream(stream, &s); err != cudaSuccess) {
    tl_last = err;
    return;
  }
  push(*s, std::move(task));
}

int stream_device(cudaStream_t stream) {
  const std::shared_ptr<CUstream_st> s = find_stream(stream);
  return s ? s->device : -1;  // -1: not a live stream
}

int current_device() {
  return tl_device;
}
int device_count() {
  return rt().count;
}
void set_last_error(cudaError_t err) {
  tl_last = err;
}

cudaError_t sticky_error(int device) {
  return check_device(device) == cudaSuccess ? sticky(device) : cudaSuccess;
}

bool device_range(const void* p, size_t bytes, int* device) {
  std::shared_lock lock(rt().mem_mutex);
  const auto* entry = find_range(rt().allocs, p, bytes);
  if (entry != nullptr && device != nullptr) *device = entry->second.device;
  return entry != nullptr;
}

bool pinned_range(const void* p, size_t bytes) {
  std::shared_lock lock(rt().mem_mutex);
  return find_range(rt().pinned, p, bytes) != nullptr;
}

int func_max_dynamic_shared(const void* func) {
  std::lock_guard lock(rt().attr_mutex);
  const auto it = rt().max_dynamic_shared.find({tl_device, func});
  return it == rt().max_dynamic_shared.end() ? 0 : it->second;
}

int max_shared_per_block_optin(int /*device*/) {
  return rt().shared_optin;
}

}  // namespace cuda_emu

// ---- devices ----

cudaError_t cudaGetDeviceCount(int* count) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (count == nullptr) return result(cudaErrorInvalidValue);
  *count = rt().count;
  return result(rt().count == 0 ? cudaErrorNoDevice : cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return result(cudaErrorInvalidValue);
  if (rt().count == 0) return result(cudaErrorNoDevice);
  *device = tl_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (cudaError_t err = check_device(device); err != cudaSuccess) return result(err);
  tl_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return result(cudaErrorInvalidValue);
  if (cudaError_t err = check_device(device); err != cudaSuccess) return result(err);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "strata emulated GPU %d", device);
  prop->totalGlobalMem = rt().capacity;
  prop->sharedMemPerBlock = kSharedPerBlock;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->concurrentKernels = 1;
  prop->pciBusID = pci_bus(device);
  prop->asyncEngineCount = 3;
  prop->unifiedAddressing = 1;
  prop->memoryBusWidth = 5120;
  prop->l2CacheSize = 50 << 20;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerBlockOptin = static_cast<size_t>(rt().shared_optin);
  prop->sharedMemPerMultiprocessor = prop->sharedMemPerBlockOptin + 1024;
  prop->regsPerMultiprocessor = 65536;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return result(cudaErrorInvalidValue);
  cudaDeviceProp p;
  if (cudaError_t err = cudaGetDeviceProperties(&p, device); err != cudaSuccess) return err;
  // clang-format off
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxBlockDimX: *value = p.maxThreadsDim[0]; break;
    case cudaDevAttrMaxBlockDimY: *value = p.maxThreadsDim[1]; break;
    case cudaDevAttrMaxBlockDimZ: *value = p.maxThreadsDim[2]; break;
    case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
    case cudaDevAttrMaxGridDimY: *value = p.maxGridSize[1]; break;
    case cudaDevAttrMaxGridDimZ: *value = p.maxGridSize[2]; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(p.sharedMemPerBlock); break;
    case cudaDevAttrTotalConstantMemory: *value = static_cast<int>(p.totalConstMem); break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = p.regsPerBlock; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrPciBusId: *value = p.pciBusID; break;
    case cudaDevAttrPciDeviceId: *value = p.pciDeviceID; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrUnifiedAddressing: *value = p.unifiedAddressing; break;
    case cudaDevAttrPciDomainId: *value = p.pciDomainID; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = static_cast<int>(p.sharedMemPerMultiprocessor); break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = p.regsPerMultiprocessor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(p.sharedMemPerBlockOptin); break;
    default: return result(cudaErrorInvalidValue);
  }
  // clang-format on
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
  if (pciBusId == nullptr || len <= 0) return result(cudaErrorInvalidValue);
  if (cudaError_t err = check_device(device); err != cudaSuccess) return result(err);
  std::snprintf(pciBusId, static_cast<size_t>(len), "0000:%02x:00.0", pci_bus(device) & 0xff);
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return result(cudaErrorInvalidValue);
  *driverVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  if (runtimeVersion == nullptr) return result(cudaErrorInvalidValue);
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

// Waits even after a fault, so that no task still runs when it returns.
cudaError_t cudaDeviceSynchronize(void) {
  if (tl_host_fn || tl_worker) return result(cudaErrorNotPermitted);
  if (rt().count == 0) return result(cudaErrorNoDevice);
  const int device = tl_device;
  sync_device(device);
  return result(sticky(device));
}

// ---- memory ----

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  int device = 0;
  if (free_bytes == nullptr || total_bytes == nullptr) return result(cudaErrorInvalidValue);
  if (cudaError_t err = current(&device); err != cudaSuccess) return result(err);
  std::shared_lock lock(rt().mem_mutex);
  *free_bytes = rt().capacity - rt().devices[static_cast<size_t>(device)].used;
  *total_bytes = rt().capacity;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  int device = 0;
  if (devPtr == nullptr) return result(cudaErrorInvalidValue);
  if (cudaError_t err = current(&device); err != cudaSuccess) return result(err);
  *devPtr = nullptr;
  if (size == 0) return cudaSuccess;
  std::unique_lock lock(rt().mem_mutex);
  size_t& used = rt().devices[static_cast<size_t>(device)].used;
  if (size > rt().capacity - used || rounded(size) > rt().capacity - used)
    return result(cudaErrorMemoryAllocation);
  void* p = map_pages(size);
  if (p == nullptr) return result(cudaErrorMemoryAllocation);
  rt().allocs.emplace(reinterpret_cast<uintptr_t>(p), Alloc{size, device});
  used += rounded(size);
  *devPtr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* devPtr) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (devPtr == nullptr) return cudaSuccess;
  const auto base = reinterpret_cast<uintptr_t>(devPtr);
  int device = -1;
  {
    std::shared_lock lock(rt().mem_mutex);
    const auto it = rt().allocs.find(base);
    if (it == rt().allocs.end()) return result(cudaErrorInvalidValue);
    device = it->second.device;
  }
  if (cudaError_t err = may_block(); err != cudaSuccess) return result(err);
  sync_device(device);
  if (cudaError_t err = sticky(device); err != cudaSuccess) return result(err);
  std::unique_lock lock(rt().mem_mutex);
  const auto it = rt().allocs.find(base);
  if (it == rt().allocs.end()) return result(cudaErrorInvalidValue);  // freed meanwhile
  munmap(devPtr, it->second.size);
  rt().devices[static_cast<size_t>(device)].used -= rounded(it->second.size);
  rt().allocs.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (pHost == nullptr || (flags & ~0x7u) != 0) return result(cudaErrorInvalidValue);
  if (rt().count == 0) return result(cudaErrorNoDevice);
  *pHost = nullptr;
  if (size == 0) return cudaSuccess;
  void* p = map_pages(size);
  if (p == nullptr) return result(cudaErrorMemoryAllocation);
  std::unique_lock lock(rt().mem_mutex);
  rt().pinned.emplace(reinterpret_cast<uintptr_t>(p), size);
  *pHost = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void* ptr) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (ptr == nullptr) return cudaSuccess;
  std::unique_lock lock(rt().mem_mutex);
  const auto it = rt().pinned.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == rt().pinned.end()) return result(cudaErrorInvalidValue);
  munmap(ptr, it->second);
  rt().pinned.erase(it);
  return cudaSuccess;
}

// ---- copies ----

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy_async(dst, src, count, kind, nullptr, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy_async(dst, src, count, kind, stream, false);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  if (check_device(dstDevice) != cudaSuccess || check_device(srcDevice) != cudaSuccess)
    return result(cudaErrorInvalidDevice);
  if (count == 0) return cudaSuccess;
  int dst_device = -1, src_device = -1;
  if (!cuda_emu::device_range(dst, count, &dst_device) || dst_device != dstDevice ||
      !cuda_emu::device_range(src, count, &src_device) || src_device != srcDevice)
    return result(cudaErrorInvalidValue);
  push(*s, [dst, src, count] { std::memmove(dst, src, count); });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  if (count == 0) return cudaSuccess;
  if (!cuda_emu::device_range(devPtr, count, nullptr)) return result(cudaErrorInvalidValue);
  push(*s, [devPtr, value, count] { std::memset(devPtr, value & 0xff, count); });
  return cudaSuccess;
}

// ---- streams ----

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  int device = 0;
  if (pStream == nullptr || (flags & ~1u) != 0) return result(cudaErrorInvalidValue);
  if (cudaError_t err = current(&device); err != cudaSuccess) return result(err);
  std::shared_ptr<CUstream_st> s;
  try {
    s = start_stream(device, false);
  } catch (const std::exception&) {  // no thread to be had
    return result(cudaErrorMemoryAllocation);
  }
  std::unique_lock lock(rt().handle_mutex);
  rt().streams.emplace(s.get(), s);
  *pStream = s.get();
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  if (is_default_handle(stream)) return result(cudaErrorInvalidResourceHandle);
  std::unique_lock lock(rt().handle_mutex);
  const auto it = rt().streams.find(stream);
  if (it == rt().streams.end() || it->second->destroyed)
    return result(cudaErrorInvalidResourceHandle);
  CUstream_st& s = *it->second;
  s.destroyed = true;
  {
    std::lock_guard stream_lock(s.mutex);
    s.closing = true;
  }
  s.work_cv.notify_one();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s, false); err != cudaSuccess) return result(err);
  if (cudaError_t err = may_block(); err != cudaSuccess) return result(err);
  wait_done(*s, queued(*s));
  return result(sticky(s->device));
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  std::lock_guard lock(s->mutex);
  return s->done == s->queued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  if (flags != cudaEventWaitDefault) return result(cudaErrorInvalidValue);
  const std::shared_ptr<CUevent_st> e = find_event(event);
  if (!e) return result(cudaErrorInvalidResourceHandle);
  // The mark as recorded now: a later cudaEventRecord does not move this wait.
  Mark m = mark_of(*e);
  if (!reached(m)) push(*s, [m = std::move(m)] { wait_done(*m.stream, m.seq); });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  if (fn == nullptr) return result(cudaErrorInvalidValue);
  push(*s, [fn, userData] {
    struct HostFn {
      HostFn() { tl_host_fn = true; }
      ~HostFn() { tl_host_fn = false; }
    } in_host_fn;
    fn(userData);
  });
  return cudaSuccess;
}

// ---- events ----

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

// The flags change nothing here: no wait spins, and no timing is kept.
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  int device = 0;
  if (event == nullptr || (flags & ~0x7u) != 0) return result(cudaErrorInvalidValue);
  if (cudaError_t err = current(&device); err != cudaSuccess) return result(err);
  auto e = std::make_shared<CUevent_st>();
  e->device = device;
  std::unique_lock lock(rt().handle_mutex);
  rt().events.emplace(e.get(), e);
  *event = e.get();
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::shared_ptr<CUstream_st> s;
  if (cudaError_t err = use_stream(stream, &s); err != cudaSuccess) return result(err);
  const std::shared_ptr<CUevent_st> e = find_event(event);
  // CUDA records an event only on a stream of the event's own device.
  if (!e || e->device != s->device) return result(cudaErrorInvalidResourceHandle);
  std::lock_guard lock(e->mutex);
  e->seq = queued(*s);
  e->stream = std::move(s);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  const std::shared_ptr<CUevent_st> e = find_event(event);
  if (!e) return result(cudaErrorInvalidResourceHandle);
  if (!reached(mark_of(*e))) return cudaErrorNotReady;
  return result(sticky(e->device));
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  const std::shared_ptr<CUevent_st> e = find_event(event);
  if (!e) return result(cudaErrorInvalidResourceHandle);
  if (cudaError_t err = may_block(); err != cudaSuccess) return result(err);
  const Mark m = mark_of(*e);
  if (m.stream) wait_done(*m.stream, m.seq);
  return result(sticky(e->device));
}

// Waits already queued on the event keep its mark; nothing else refers to the event.
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (tl_host_fn) return result(cudaErrorNotPermitted);
  std::unique_lock lock(rt().handle_mutex);
  if (rt().events.erase(event) == 0) return result(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}

// ---- errors ----

// A sticky error is returned by every call, and is never cleared.
cudaError_t cudaGetLastError(void) {
  const cudaError_t last = tl_last;
  tl_last = cudaSuccess;
  if (rt().count > 0 && sticky(tl_device) != cudaSuccess) return sticky(tl_device);
  return last;
}

cudaError_t cudaPeekAtLastError(void) {
  if (rt().count > 0 && sticky(tl_device) != cudaSuccess) return sticky(tl_device);
  return tl_last;
}

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* e = error_text(error);
  return e != nullptr ? e->name : "unrecognized error code";
}

const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* e = error_text(error);
  return e != nullptr ? e->text : "unrecognized error code";
}

// ---- kernels ----

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  int device = 0;
  if (cudaError_t err = current(&device); err != cudaSuccess) return result(err);
  if (func == nullptr) return result(cudaErrorInvalidDeviceFunction);
  switch (attr) {
    case cudaFuncAttributeMaxDynamicSharedMemorySize: {
      // CUDA takes the kernel's static shared memory off the limit too; the emulator does not
      // know it.
      if (value < 0 || value > rt().shared_optin) return result(cudaErrorInvalidValue);
      std::lock_guard lock(rt().attr_mutex);
      rt().max_dynamic_shared[{device, func}] = value;
      return cudaSuccess;
    }
    case cudaFuncAttributePreferredSharedMemoryCarveout:
      return result(value >= -1 && value <= 100 ? cudaSuccess : cudaErrorInvalidValue);
  }
  return result(cudaErrorInvalidValue);
}
