// communicator.cpp: make_communicator, the choice between NCCL and the in-process collectives.
#include "partition/collective_checks.h"
#include "partition/communicator.h"

#include <set>

namespace strata {

// NCCL needs one GPU per rank and gains nothing for a single rank; everything else (host
// devices, virtual ranks sharing a GPU) goes in-process.
std::unique_ptr<Communicator> make_communicator(const std::vector<Device*>& devices) {
  check_communicator_devices("communicator", devices);
  std::set<int> gpus;
  bool nccl = devices.size() > 1;
  for (const Device* d : devices)
    nccl = nccl && d->backend() == Backend::cuda && gpus.insert(d->index()).second;
  return nccl ? make_nccl_communicator(devices) : make_inprocess_communicator(devices);
}

}  // namespace strata
