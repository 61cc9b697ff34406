// collective_checks.h: the argument checks every Communicator runs before it queues anything.
//
// Both implementations (in-process and NCCL) call these, so a bad call fails the same way on
// either, with a message naming the collective, the rank and the tensor. Nothing is queued
// when a check fails.
#pragma once

#include "core/device.h"

#include <cstdint>
#include <vector>

namespace strata {

// What a checked call resolved to.
struct CollectiveShape {
  DType dtype = DType::f32;
  int64_t count =
      0;  // elements per rank: all_gather's send, reduce_scatter's recv, all_reduce's buf
};

// all_gather runs in place on `rank` when its send is exactly its own chunk of its recv.
bool gather_in_place(const TensorView& send, const TensorView& recv, int rank);

// One tensor per rank and one stream per rank; f32 or bf16, one dtype throughout; element counts
// as communicator.h lays them out; every tensor in its rank's device memory; no rank writes
// memory that another tensor of the call reads or writes (except all_gather in place).
CollectiveShape check_all_gather(const std::vector<Device*>& devices,
                                 const std::vector<TensorView>& send,
                                 const std::vector<TensorView>& recv,
                                 const std::vector<Stream*>& streams);
CollectiveShape check_reduce_scatter(const std::vector<Device*>& devices,
                                     const std::vector<TensorView>& send,
                                     const std::vector<TensorView>& recv,
                                     const std::vector<Stream*>& streams);
CollectiveShape check_all_reduce(const std::vector<Device*>& devices,
                                 const std::vector<TensorView>& buf,
                                 const std::vector<Stream*>& streams);

// Throws Error unless `devices` is non-empty, free of nulls and of one backend; `who` names the
// communicator in the message ("in-process communicator").
void check_communicator_devices(const char* who, const std::vector<Device*>& devices);

}  // namespace strata
