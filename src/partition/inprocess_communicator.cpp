// inprocess_communicator.cpp: collectives by peer copies and the kernel table's add
// (communicator.h), for host devices and for virtual ranks sharing one GPU.
//
// Before editing, know how it stays safe without blocking the caller:
// - Fences on both sides of every collective. Before: each rank's stream waits for the
//   previous collective's "done" event of every rank, then every rank records "ready" and waits
//   for every other rank's, so each rank's part starts after all ranks' producers. After: every
//   rank records "done" and waits for every other rank's, so work queued on a rank's stream
//   after the collective (overwriting a send buffer, the next collective) never runs while a
//   peer still reads that rank's memory. Collectives of one communicator therefore run in call
//   order on every rank, whichever streams they are given.
// - Sums run in rank order 0, 1, ..., N-1, one add per rank, each rounding once to the dtype:
//   the same bits every run, and on host and CUDA alike (add is one f32 addition per element).
// - Kernels read only their own device's memory, so a peer's chunk is first copied into the
//   rank's staging buffer: allocated from that rank's arena on first need, grown, never shrunk,
//   counted as MemoryKind::communication and named as the communicator's in out-of-memory
//   errors. It grows only once every rank has finished the previous collective.
// - Calls are serialised by a mutex: fences pair events by call order.
#include "core/error.h"
#include "core/log.h"
#include "partition/collective_checks.h"
#include "partition/communicator.h"

#include <algorithm>
#include <mutex>

namespace strata {
namespace {

constexpr const char* kStagingWhat = "in-process communicator staging (reduce_scatter, all_reduce)";

uint64_t round_up(uint64_t bytes) {
  return (bytes + 255) / 256 * 256;
}

char* at(const TensorView& t, int64_t element) {
  return static_cast<char*>(t.data) + static_cast<uint64_t>(element) * dtype_size(t.dtype);
}

class InProcessCommunicator final : public Communicator {
 public:
  explicit InProcessCommunicator(const std::vector<Device*>& devices) {
    check_communicator_devices("in-process communicator", devices);
    for (Device* d : devices) ranks_.push_back({d, d->create_event(), d->create_event(), {}});
  }

  // Queued work may still use the staging buffers: wait for it before they go.
  ~InProcessCommunicator() override {
    try {
      wait_done();
    } catch (const std::exception& e) {
      log_error("in-process communicator: releasing its staging buffers: {}", e.what());
    }
  }

  int size() const override { return static_cast<int>(ranks_.size()); }
  std::string name() const override { return "in-process"; }
  Device& device(int rank) const override {
    if (rank < 0 || rank >= size())
      fail("in-process communicator: rank {} does not exist; ranks are 0..{}", rank, size() - 1);
    return *ranks_[static_cast<size_t>(rank)].device;
  }

  void all_gather(const std::vector<TensorView>& send, const std::vector<TensorView>& recv,
                  const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_all_gather(devices(), send, recv, streams);
    if (shape.count == 0) return;
    fenced(streams, [&] {
      for (int r = 0; r < size(); ++r) {
        const bool in_place = gather_in_place(send[r], recv[r], r);
        for (int q = 0; q < size(); ++q)
          if (q != r || !in_place)
            peer_copy(r, at(recv[r], q * shape.count), q, send[q].data, send[q].bytes(),
                      *streams[r]);
      }
    });
  }

  // Rank r: recv = chunk r of send[0], then += chunk r of send[q] for q = 1..N-1 (a peer's chunk
  // through staging, its own in place).
  void reduce_scatter(const std::vector<TensorView>& send, const std::vector<TensorView>& recv,
                      const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_reduce_scatter(devices(), send, recv, streams);
    if (shape.count == 0) return;
    const uint64_t chunk_bytes = recv[0].bytes();
    if (size() > 1) reserve_staging(chunk_bytes);
    fenced(streams, [&] {
      for (int r = 0; r < size(); ++r) {
        Stream& s = *streams[r];
        peer_copy(r, recv[r].data, 0, at(send[0], r * shape.count), chunk_bytes, s);
        for (int q = 1; q < size(); ++q)
          accumulate(r, recv[r], q, at(send[q], r * shape.count), staging(r), s);
      }
    });
  }

  // Reduce-scatter into staging (rank r sums slice r of the buffers), a fence, then every rank
  // gathers the summed slices from the peers' staging: each element is still summed in rank
  // order, and every rank copies about two buffers' worth instead of N.
  void all_reduce(const std::vector<TensorView>& buf,
                  const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_all_reduce(devices(), buf, streams);
    const int n = size();
    if (shape.count == 0 || n == 1) return;
    const int64_t slice = (shape.count + n - 1) / n;
    const auto lo = [&](int r) { return std::min<int64_t>(shape.count, r * slice); };
    const auto len = [&](int r) { return std::min<int64_t>(shape.count, lo(r) + slice) - lo(r); };
    // Staging holds [the slice's sum | a peer's slice], each part 256-byte aligned.
    const uint64_t part = round_up(static_cast<uint64_t>(slice) * dtype_size(shape.dtype));
    reserve_staging(2 * part);
    fenced(streams, [&] {
      for (int r = 0; r < n; ++r) {
        if (len(r) == 0) continue;
        Stream& s = *streams[r];
        const TensorView sum{staging(r), shape.dtype, Shape{len(r)}, ranks_[r].device};
        peer_copy(r, sum.data, 0, at(buf[0], lo(r)), sum.bytes(), s);
        for (int q = 1; q < n; ++q)
          accumulate(r, sum, q, at(buf[q], lo(r)), static_cast<char*>(staging(r)) + part, s);
      }
      barrier(streams);  // every slice summed, and nobody reads buf any more
      for (int r = 0; r < n; ++r)
        for (int q = 0; q < n; ++q)
          peer_copy(r, at(buf[r], lo(q)), q, staging(q),
                    static_cast<uint64_t>(len(q)) * dtype_size(shape.dtype), *streams[r]);
    });
  }

 private:
  struct Rank {
    Device* device;
    std::unique_ptr<Event> ready, done;
    DeviceBuffer staging;
  };

  std::vector<Device*> devices() const {
    std::vector<Device*> d;
    for (const Rank& r : ranks_) d.push_back(r.device);
    return d;
  }
  void* staging(int rank) const { return ranks_[static_cast<size_t>(rank)].staging.data(); }

  // Rank r's copy of `bytes` from rank q's memory, on r's stream.
  void peer_copy(int r, void* dst, int q, const void* src, uint64_t bytes, Stream& s) {
    Device& dev = *ranks_[static_cast<size_t>(r)].device;
    if (q == r)
      dev.copy_on_device(dst, src, bytes, s);
    else
      dev.copy_from_peer(dst, *ranks_[static_cast<size_t>(q)].device, src, bytes, s);
  }

  // acc += rank q's elements at `src` (acc's count and dtype), on rank r's stream; a peer's
  // elements go through `tmp` (rank r's staging) first.
  void accumulate(int r, const TensorView& acc, int q, const void* src, void* tmp, Stream& s) {
    Device& dev = *ranks_[static_cast<size_t>(r)].device;
    TensorView addend{const_cast<void*>(src), acc.dtype, acc.shape, &dev};
    if (q != r) {
      peer_copy(r, tmp, q, src, acc.bytes(), s);
      addend.data = tmp;
    }
    dev.kernels().add(acc, acc, addend, s);
  }

  // Grows every rank's staging to `bytes`, once no queued collective uses the old buffers.
  void reserve_staging(uint64_t bytes) {
    bool grow = false;
    for (const Rank& r : ranks_) grow = grow || r.staging.bytes() < bytes;
    if (!grow) return;
    wait_done();
    for (Rank& r : ranks_)
      if (r.staging.bytes() < bytes) {
        r.staging.reset();
        r.staging = DeviceBuffer(*r.device, bytes, kStagingWhat, MemoryKind::communication);
      }
  }

  void wait_done() {
    for (Rank& r : ranks_) r.done->synchronize();
  }

  // Every rank's stream waits until every rank has reached this point of its stream.
  void barrier(const std::vector<Stream*>& streams) {
    for (size_t r = 0; r < ranks_.size(); ++r) streams[r]->record(*ranks_[r].ready);
    for (size_t r = 0; r < ranks_.size(); ++r)
      for (size_t q = 0; q < ranks_.size(); ++q)
        if (q != r) streams[r]->wait(*ranks_[q].ready);
  }

  // Runs `work` (which queues every rank's part) between the fences of the design note. If it
  // throws part-way, the closing fence is still queued, so no later collective overlaps what was
  // queued.
  template <typename Work>
  void fenced(const std::vector<Stream*>& streams, Work&& work) {
    for (size_t r = 0; r < ranks_.size(); ++r)
      for (const Rank& q : ranks_) streams[r]->wait(*q.done);
    barrier(streams);
    try {
      work();
    } catch (...) {
      try {
        close(streams);
      } catch (const std::exception& e) {
        log_error("in-process communicator: closing a failed collective: {}", e.what());
      }
      throw;
    }
    close(streams);
  }

  void close(const std::vector<Stream*>& streams) {
    for (size_t r = 0; r < ranks_.size(); ++r) streams[r]->record(*ranks_[r].done);
    for (size_t r = 0; r < ranks_.size(); ++r)
      for (size_t q = 0; q < ranks_.size(); ++q)
        if (q != r) streams[r]->wait(*ranks_[q].done);
  }

  std::vector<Rank> ranks_;
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Communicator> make_inprocess_communicator(const std::vector<Device*>& devices) {
  return std::make_unique<InProcessCommunicator>(devices);
}

}  // namespace strata
