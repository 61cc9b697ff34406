// communicator.h: collectives across the local devices of one process (DESIGN §2, §4).
//
// One process drives every local device, so a collective is one call that covers every rank:
// argument vectors hold one entry per rank, in rank order, and each rank's part is queued on
// that rank's stream (after everything already queued there). Nothing blocks the caller.
// Work queued on a rank's stream after a collective runs once no rank reads that rank's buffers
// any more, so it may overwrite them (or the caller may free them once the stream is done).
//
// Two implementations:
// - NCCL (CUDA devices): one communicator per GPU from ncclCommInitAll, grouped calls.
// - in-process (host devices, and CUDA devices too, so N virtual ranks can share one GPU in
//   tests): peer copies plus the kernel table's add, summing in rank order 0, 1, ..., N-1, so
//   the result is the same bits every run.
//
// Layout: all_gather's recv on every rank is the ranks' send buffers concatenated in rank
// order; reduce_scatter's send on every rank is N equal chunks, and rank r's recv is the sum
// over ranks of chunk r. Element counts are per rank and equal across ranks; the buffers are
// f32 or bf16 (bf16 sums are formed in f32 per step and rounded once per add).
#pragma once

#include "core/device.h"

#include <memory>
#include <string>
#include <vector>

namespace strata {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "nccl", "in-process"
  virtual Device& device(int rank) const = 0;

  // recv[r] (count * size() elements) = concat over q of send[q] (count elements), on every r.
  // send[r] and recv[r] live on device(r); send[r] may be the r-th chunk of recv[r] (in place).
  virtual void all_gather(const std::vector<TensorView>& send, const std::vector<TensorView>& recv,
                          const std::vector<Stream*>& streams) = 0;
  // recv[r] (count elements) = sum over q of chunk r of send[q] (count * size() elements).
  virtual void reduce_scatter(const std::vector<TensorView>& send,
                              const std::vector<TensorView>& recv,
                              const std::vector<Stream*>& streams) = 0;
  // buf[r] = sum over q of buf[q], on every rank (the loss, the gradient norm's parts).
  virtual void all_reduce(const std::vector<TensorView>& buf,
                          const std::vector<Stream*>& streams) = 0;
};

// The in-process communicator over `devices` (host or CUDA, all of one backend).
std::unique_ptr<Communicator> make_inprocess_communicator(const std::vector<Device*>& devices);
// NCCL over CUDA devices, one GPU each (distinct GPUs). Throws Error when NCCL is not
// compiled in or a device is not CUDA, naming it.
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device*>& devices);
// NCCL for several distinct GPUs, in-process otherwise (host devices, a single device, or
// virtual ranks sharing a GPU).
std::unique_ptr<Communicator> make_communicator(const std::vector<Device*>& devices);

}  // namespace strata
