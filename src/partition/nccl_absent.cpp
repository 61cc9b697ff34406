// nccl_absent.cpp: make_nccl_communicator in a build without the CUDA backend (and so without
// NCCL); nccl_communicator.cpp replaces it when CUDA is compiled in.
#include "core/error.h"
#include "partition/collective_checks.h"
#include "partition/communicator.h"

namespace strata {

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device*>& devices) {
  check_communicator_devices("NCCL communicator", devices);
  std::string names;
  for (const Device* d : devices) names += (names.empty() ? "" : ", ") + d->name();
  fail(
      "NCCL communicator over {}: this strata was built without the CUDA backend, so without "
      "NCCL; rebuild with the CUDA toolkit and NCCL (STRATA_CUDA=ON), or use the in-process "
      "communicator (make_communicator picks it for host devices)",
      names);
}

}  // namespace strata
