// host_device.cpp: the host backend, one accelerator simulated on the CPU.
//
// Device memory is one mmap'ed reservation (MAP_NORESERVE: pages are committed only when
// touched) carved by an Arena, so the cap is exact. Each Stream is a worker thread draining
// an in-order queue of std::function tasks. An Event counts its record() calls: record
// enqueues a marker for generation g, and wait() captures the latest g at call time and
// enqueues a task that blocks until that generation's marker has run. Before editing, know:
// - errors: the first exception in a task is kept and every later task on that stream is
//   skipped, until the next synchronize() of the stream (or of the device) rethrows it
//   once; the stream then runs new work again. Event markers are never skipped, so other
//   streams waiting on a failed one do not hang.
// - pointer and stream checks happen at enqueue time, so the error points at the caller.
// - streams share the device's state (arena, mapping, list of live streams) through a
//   shared_ptr, so a stream may outlive its Device without touching freed memory.
#include "host/host_device.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "host/host_kernels.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace strata {
namespace {

class HostStream;

// What a device and its streams share; lives until the last of them is gone.
struct DeviceState {
  std::string name;  // "host:0"
  char* base = nullptr;
  uint64_t bytes = 0;
  Arena arena;
  std::mutex streams_mutex;
  std::set<HostStream*> streams;  // live streams, for Device::synchronize

  DeviceState(int index, uint64_t arena_bytes)
      : name(fmt::format("host:{}", index)),
        bytes(arena_bytes),
        arena(arena_bytes, 256, "device " + name,
              "raise --device-memory or lower the micro-batch") {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      fail(
          "device {}: cannot reserve {} of address space for its memory: {}; lower "
          "--device-memory",
          name, format_bytes(bytes), errno_text(errno));
    base = static_cast<char*>(p);
  }
  ~DeviceState() { munmap(base, bytes); }
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  bool contains(const void* ptr, uint64_t n) const {
    const auto p = reinterpret_cast<uintptr_t>(ptr), b = reinterpret_cast<uintptr_t>(base);
    return p >= b && n <= bytes && p - b <= bytes - n;
  }
};

// Generation g of an event is complete once its marker task has run. Generation 0 (never
// recorded) is always complete.
struct EventState {
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;
  std::set<uint64_t> pending;  // recorded generations whose marker has not run yet

  bool complete(uint64_t generation) const { return pending.count(generation) == 0; }
  void mark_complete(uint64_t generation) {
    {
      std::lock_guard lock(mutex);
      pending.erase(generation);
    }
    cv.notify_all();
  }
  void wait_for(uint64_t generation) {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return complete(generation); });
  }
  uint64_t latest() {
    std::lock_guard lock(mutex);
    return recorded;
  }
};

class HostEvent final : public Event {
 public:
  std::shared_ptr<EventState> state = std::make_shared<EventState>();

  bool query() override {
    std::lock_guard lock(state->mutex);
    return state->complete(state->recorded);
  }
  void synchronize() override { state->wait_for(state->latest()); }
};

class HostStream final : public Stream {
 public:
  HostStream(std::shared_ptr<DeviceState> device, std::string name)
      : device_(std::move(device)), name_(std::move(name)) {
    worker_ = std::thread([this] { run(); });
    std::lock_guard lock(device_->streams_mutex);
    device_->streams.insert(this);
  }

  ~HostStream() override {
    {
      std::lock_guard lock(device_->streams_mutex);
      device_->streams.erase(this);
    }
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_one();
    worker_.join();  // the worker drains the queue before it stops
    if (!error_.empty()) log_error("{} (never reported by a synchronize())", error_);
  }

  const std::string& name() const override { return name_; }
  const DeviceState* device() const { return device_.get(); }

  void record(Event& event) override {
    std::shared_ptr<EventState> e = host_event(event);
    uint64_t generation;
    {
      std::lock_guard lock(e->mutex);
      generation = ++e->recorded;
      e->pending.insert(generation);
    }
    enqueue([e, generation] { e->mark_complete(generation); }, /*always_runs=*/true);
  }

  void wait(Event& event) override {
    std::shared_ptr<EventState> e = host_event(event);
    const uint64_t generation = e->latest();
    if (generation == 0) return;  // never recorded: nothing to wait for, as in CUDA
    enqueue([e, generation] { e->wait_for(generation); });
  }

  void host_task(std::function<void()> fn) override { enqueue(std::move(fn)); }

  void synchronize() override {
    if (std::this_thread::get_id() == worker_.get_id())
      fail(
          "stream '{}' on {}: synchronize() called from one of its own tasks would wait "
          "forever; host tasks must not wait on streams",
          name_, device_->name);
    std::unique_lock lock(mutex_);
    const uint64_t target = submitted_;
    while (finished_ < target) {
      wake_at_ = std::min(wake_at_, target);
      idle_cv_.wait(lock);
    }
    if (!error_.empty()) throw Error(std::exchange(error_, {}));
  }

  void enqueue(std::function<void()> fn, bool always_runs = false) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({std::move(fn), always_runs});
      ++submitted_;
    }
    work_cv_.notify_one();
  }

 private:
  struct Task {
    std::function<void()> fn;
    bool always_runs;
  };

  std::shared_ptr<EventState> host_event(Event& event) const {
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr)
      fail(
          "stream '{}' on {}: the event was not created by a host device; use events from "
          "create_event() of a host device",
          name_, device_->name);
    return e->state;
  }

  void run() {
    for (;;) {
      Task task;
      bool failed;
      {
        std::unique_lock lock(mutex_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        task = std::move(queue_.front());
        queue_.pop_front();
        failed = !error_.empty();
      }
      std::string error;
      if (!failed || task.always_runs) {
        try {
          task.fn();
        } catch (const std::exception& e) {
          error = fmt::format("stream '{}' on {}: {}", name_, device_->name, e.what());
        } catch (...) {
          error = fmt::format("stream '{}' on {}: a task threw a non-standard exception", name_,
                              device_->name);
        }
      }
      bool wake = false;
      {
        std::lock_guard lock(mutex_);
        if (error_.empty()) error_ = std::move(error);
        if (++finished_ >= wake_at_) {
          wake_at_ = kNoWaiter;
          wake = true;
        }
      }
      if (wake) idle_cv_.notify_all();
    }
  }

  std::shared_ptr<DeviceState> device_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<Task> queue_;
  uint64_t submitted_ = 0, finished_ = 0;
  // The fewest finished tasks a synchronize() waits for: the worker wakes the waiters when
  // that many are done, not after every task (a waiter behind 20 queued kernels was woken 20
  // times, each a context switch). Woken waiters still short of their target set it again.
  static constexpr uint64_t kNoWaiter = ~uint64_t{0};
  uint64_t wake_at_ = kNoWaiter;
  std::string error_;  // the first task error since the last synchronize()
  bool stop_ = false;
  std::thread worker_;  // last: started once everything above exists
};

class HostDevice final : public Device {
 public:
  HostDevice(int index, uint64_t arena_bytes)
      : index_(index),
        state_(std::make_shared<DeviceState>(index, arena_bytes)),
        kernels_(
            host::make_kernels({[this](const void* ptr, uint64_t bytes, const std::string& what) {
                                  check_device(ptr, bytes, what);
                                },
                                [this](Stream& s, std::function<void()> task) {
                                  stream(s).enqueue(std::move(task));
                                }})) {}

  Backend backend() const override { return Backend::host; }
  int index() const override { return index_; }
  std::string name() const override { return state_->name; }

  using Device::allocate;
  void* allocate(uint64_t bytes, std::string_view what, MemoryKind kind) override {
    return state_->base + state_->arena.allocate(bytes, what, kind);
  }

  void release(void* ptr) override {
    if (ptr == nullptr) return;
    if (!state_->contains(ptr, 0))
      fail(
          "device {}: release of {} which is not {} memory; release a pointer on the device "
          "that allocated it",
          state_->name, ptr, state_->name);
    state_->arena.release(static_cast<uint64_t>(static_cast<char*>(ptr) - state_->base));
  }

  ArenaStats memory() const override { return state_->arena.stats(); }
  bool owns(const void* p, uint64_t bytes) const override { return state_->contains(p, bytes); }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<HostStream>(state_, std::move(name));
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<HostEvent>(); }

  // Waits for every live stream, then rethrows the first error among them (and logs the
  // others, which are reported now too).
  void synchronize() override {
    std::lock_guard lock(state_->streams_mutex);
    std::string first_error;
    for (HostStream* s : state_->streams) {
      try {
        s->synchronize();
      } catch (const Error& e) {
        if (first_error.empty())
          first_error = e.what();
        else
          log_error("{}", e.what());
      }
    }
    if (!first_error.empty()) throw Error(first_error);
  }

  void copy_to_device(void* dst, const void* src, uint64_t bytes, Stream& s) override {
    if (bytes == 0) return;
    check_device(dst, bytes, "copy_to_device destination");
    check_host(src, bytes, "copy_to_device source");
    stream(s).enqueue([=] { std::memcpy(dst, src, bytes); });
  }
  void copy_to_host(void* dst, const void* src, uint64_t bytes, Stream& s) override {
    if (bytes == 0) return;
    check_host(dst, bytes, "copy_to_host destination");
    check_device(src, bytes, "copy_to_host source");
    stream(s).enqueue([=] { std::memcpy(dst, src, bytes); });
  }
  void copy_on_device(void* dst, const void* src, uint64_t bytes, Stream& s) override {
    if (bytes == 0) return;
    check_device(dst, bytes, "copy_on_device destination");
    check_device(src, bytes, "copy_on_device source");
    stream(s).enqueue([=] { std::memmove(dst, src, bytes); });
  }
  void fill_zero(void* dst, uint64_t bytes, Stream& s) override {
    if (bytes == 0) return;
    check_device(dst, bytes, "fill_zero destination");
    stream(s).enqueue([=] { std::memset(dst, 0, bytes); });
  }

  // The source device's state rides along with the task, so its memory stays mapped until the
  // copy has run even if that device is closed meanwhile.
  void copy_from_peer(void* dst, Device& src_device, const void* src, uint64_t bytes,
                      Stream& s) override {
    HostStream& hs = stream(s);
    if (bytes == 0) return;
    check_device(dst, bytes, "copy_from_peer destination");
    auto* peer = dynamic_cast<HostDevice*>(&src_device);
    if (peer == nullptr)
      fail(
          "device {}: copy_from_peer from {}, a device of another backend; peer copies join "
          "devices of one backend (copy through host memory otherwise)",
          state_->name, src_device.name());
    if (!peer->state_->contains(src, bytes))
      fail(
          "device {}: copy_from_peer source {} ({}) is not inside {}'s memory (base {}, {}); "
          "pass memory from {}'s allocate()",
          state_->name, src, format_bytes(bytes), peer->state_->name,
          static_cast<const void*>(peer->state_->base), format_bytes(peer->state_->bytes),
          peer->state_->name);
    hs.enqueue([dst, src, bytes, keep = peer->state_] { std::memmove(dst, src, bytes); });
  }

  Kernels& kernels() override { return *kernels_; }

  void convert(const TensorView& dst, const TensorView& src, Stream& s) override {
    if (dst.numel() != src.numel())
      fail(
          "device {}: convert from {} to {}: element counts differ ({} vs {}); give both "
          "tensors the same number of elements",
          state_->name, src.str(), dst.str(), src.numel(), dst.numel());
    for (const TensorView* t : {&dst, &src})
      if (!state_->contains(t->data, t->bytes()))
        fail(
            "device {}: convert from {} to {}: {} at {} ({}) is not in {}'s memory; allocate "
            "both tensors on this device",
            state_->name, src.str(), dst.str(), t == &dst ? "destination" : "source", t->data,
            format_bytes(t->bytes()), state_->name);
    const size_t n = static_cast<size_t>(dst.numel());
    stream(s).enqueue([d = dst.data, dt = dst.dtype, sp = src.data, st = src.dtype, n] {
      strata::convert(d, dt, sp, st, n);
    });
  }

 private:
  HostStream& stream(Stream& s) const {
    auto* hs = dynamic_cast<HostStream*>(&s);
    if (hs == nullptr || hs->device() != state_.get())
      fail(
          "device {}: stream '{}' was not created by {}; queue its work on one of its own "
          "streams (create_stream)",
          state_->name, s.name(), state_->name);
    return *hs;
  }
  void check_device(const void* ptr, uint64_t bytes, std::string_view what) const {
    if (!state_->contains(ptr, bytes))
      fail(
          "device {}: {} {} ({}) is not inside {}'s memory (base {}, {}); pass memory from "
          "its allocate()",
          state_->name, what, ptr, format_bytes(bytes), state_->name,
          static_cast<const void*>(state_->base), format_bytes(state_->bytes));
  }
  // Host pointers must not be device memory: the CUDA backend could not read them.
  void check_host(const void* ptr, uint64_t bytes, std::string_view what) const {
    const auto p = reinterpret_cast<uintptr_t>(ptr), b = reinterpret_cast<uintptr_t>(state_->base);
    if (ptr == nullptr || (p < b + state_->bytes && b < p + bytes))
      fail("device {}: {} {} ({}) is {}; pass ordinary host memory, or use copy_on_device",
           state_->name, what, ptr, format_bytes(bytes),
           ptr == nullptr ? "null" : "device memory of " + state_->name);
  }

  int index_;
  std::shared_ptr<DeviceState> state_;
  std::unique_ptr<Kernels> kernels_;  // checks against state_'s memory, queues on its streams
};

}  // namespace

std::unique_ptr<Device> open_host_device(int index, uint64_t arena_bytes) {
  if (index < 0) fail("host device index {} is negative; use host:N with N >= 1", index);
  if (arena_bytes == 0)
    fail("device host:{}: memory cap is 0; pass --device-memory (for example 256MiB)", index);
  auto device = std::make_unique<HostDevice>(index, arena_bytes);
  log_debug("{}: {} of simulated device memory reserved", device->name(),
            format_bytes(arena_bytes));
  return device;
}

}  // namespace strata
