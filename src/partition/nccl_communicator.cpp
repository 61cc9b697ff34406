// nccl_communicator.cpp: the collectives of communicator.h through NCCL, one process driving
// every local GPU (DESIGN §2, §4). Compiled only with the CUDA backend (nccl_absent.cpp
// otherwise).
//
// One NCCL communicator per rank from ncclCommInitAll, so each rank needs its own GPU. Every
// collective is one NCCL group: a call per rank on that rank's CUDA stream, so NCCL orders it
// after the work already queued there and the caller is never blocked. Unlike the in-process
// communicator, NCCL adds in its own (ring or tree) order: sums of integer-valued data are exact,
// others may differ from the in-process result in the last bits.
#include "core/error.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_stream.h"
#include "partition/collective_checks.h"
#include "partition/communicator.h"

#include <nccl.h>

#include <mutex>

namespace strata {
namespace {

ncclDataType_t nccl_type(DType t) {
  return t == DType::bf16 ? ncclBfloat16 : ncclFloat32;  // checked f32 or bf16 before
}

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const std::vector<Device*>& devices) : devices_(devices) {
    check_communicator_devices("NCCL communicator", devices);
    std::vector<int> gpus;
    for (size_t r = 0; r < devices.size(); ++r) {
      if (devices[r]->backend() != Backend::cuda)
        fail(
            "NCCL communicator: rank {} is {}, not a CUDA device; NCCL joins GPUs only, use the "
            "in-process communicator for host devices (make_communicator picks it)",
            r, devices[r]->name());
      for (size_t q = 0; q < r; ++q)
        if (devices[q]->index() == devices[r]->index())
          fail(
              "NCCL communicator: ranks {} and {} are both {}; NCCL needs a distinct GPU per "
              "rank: pass distinct GPUs (--devices cuda:0,1), or use the in-process "
              "communicator for ranks sharing a GPU",
              q, r, devices[r]->name());
      gpus.push_back(devices[r]->index());
    }
    comms_.resize(devices.size());
    NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(comms_.size()), gpus.data()));
  }

  // Finalizing flushes the collectives still queued; the communicators of one thread are
  // finalized in one group so that none waits for a peer not yet finalizing.
  ~NcclCommunicator() override {
    const auto check = [](ncclResult_t res, const char* what) {
      if (res != ncclSuccess)
        log_error("NCCL communicator: {} failed: {}", what, ncclGetErrorString(res));
    };
    check(ncclGroupStart(), "ncclGroupStart");
    for (ncclComm_t c : comms_) check(ncclCommFinalize(c), "ncclCommFinalize");
    check(ncclGroupEnd(), "ncclGroupEnd (finalize)");
    for (ncclComm_t c : comms_) check(ncclCommDestroy(c), "ncclCommDestroy");
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int size() const override { return static_cast<int>(devices_.size()); }
  std::string name() const override { return "nccl"; }
  Device& device(int rank) const override {
    if (rank < 0 || rank >= size())
      fail("NCCL communicator: rank {} does not exist; ranks are 0..{}", rank, size() - 1);
    return *devices_[static_cast<size_t>(rank)];
  }

  // In place when send is the rank's own chunk of recv: NCCL detects it from the pointers.
  void all_gather(const std::vector<TensorView>& send, const std::vector<TensorView>& recv,
                  const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_all_gather(devices_, send, recv, streams);
    if (shape.count == 0) return;
    grouped(streams, [&](size_t r, cudaStream_t s) {
      NCCL_CHECK(ncclAllGather(send[r].data, recv[r].data, static_cast<size_t>(shape.count),
                               nccl_type(shape.dtype), comms_[r], s));
    });
  }

  void reduce_scatter(const std::vector<TensorView>& send, const std::vector<TensorView>& recv,
                      const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_reduce_scatter(devices_, send, recv, streams);
    if (shape.count == 0) return;
    grouped(streams, [&](size_t r, cudaStream_t s) {
      NCCL_CHECK(ncclReduceScatter(send[r].data, recv[r].data, static_cast<size_t>(shape.count),
                                   nccl_type(shape.dtype), ncclSum, comms_[r], s));
    });
  }

  void all_reduce(const std::vector<TensorView>& buf,
                  const std::vector<Stream*>& streams) override {
    std::lock_guard lock(mutex_);
    const CollectiveShape shape = check_all_reduce(devices_, buf, streams);
    if (shape.count == 0) return;
    grouped(streams, [&](size_t r, cudaStream_t s) {
      NCCL_CHECK(ncclAllReduce(buf[r].data, buf[r].data, static_cast<size_t>(shape.count),
                               nccl_type(shape.dtype), ncclSum, comms_[r], s));
    });
  }

 private:
  // One NCCL group holding `call(rank, stream)` for every rank. The group is closed even when a
  // call throws, so the thread is not left inside an open group.
  template <typename Call>
  void grouped(const std::vector<Stream*>& streams, Call&& call) {
    std::vector<cudaStream_t> handles;
    for (size_t r = 0; r < devices_.size(); ++r)
      handles.push_back(cuda_stream_handle(*devices_[r], *streams[r]));
    NCCL_CHECK(ncclGroupStart());
    try {
      for (size_t r = 0; r < devices_.size(); ++r) call(r, handles[r]);
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    NCCL_CHECK(ncclGroupEnd());
  }

  std::vector<Device*> devices_;
  std::vector<ncclComm_t> comms_;
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device*>& devices) {
  return std::make_unique<NcclCommunicator>(devices);
}

}  // namespace strata
