// topology.h: the machine's packages, NUMA nodes, cores and PUs, read once through hwloc.
//
// The pinned pool that serves a GPU must be NUMA-local to it (DESIGN §3), so this also
// answers which NUMA node a PCI device hangs off. Topology is plain data; hwloc itself
// stays inside topology.cpp. The hwloc topology is loaded on first use and cached for the
// life of the process; a load failure is an Error and is retried on the next call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct NumaNode {
  int os_index = 0;           // the kernel's node number (numactl --membind=<os_index>)
  uint64_t memory_bytes = 0;  // local memory of this node
  std::vector<int> cpus;      // OS indices of its processing units
};

struct Topology {
  int packages = 0;          // sockets
  int cores = 0;             // physical cores
  int processing_units = 0;  // logical CPUs (hardware threads) this process may see
  std::vector<NumaNode> numa_nodes;
};

// Loads the topology on first use (PCI devices included) and returns the cached copy.
const Topology& topology();

// The os index of the NUMA node a PCI device ("0000:17:00.0", as CUDA reports it) is
// attached to; -1 when hwloc does not know the device or it is not local to one node.
int numa_node_of_pci(const std::string& pci_bus_id);

// The os index of the NUMA node that holds the pages of [addr, addr + bytes); -1 when it is
// unknown, when no page has been touched yet, or when the pages lie on several nodes. Areas of
// up to 64 pages are checked page by page; larger ones at 32 evenly spread pairs of adjacent
// pages (a pair, so that memory interleaved page by page across nodes shows as several nodes):
// a query costs tens of microseconds, not a walk over every page of a multi-GiB shard.
int numa_node_of_memory(const void* addr, uint64_t bytes);

// The CPUs (OS indices) the calling thread may run on, and those of the whole process (the
// union over its threads, as taskset or numactl left them); empty when the kernel will not say.
std::vector<int> cpus_of_this_thread();
std::vector<int> cpus_of_this_process();

// Binds the calling thread to `cpus` (OS indices). Returns "" on success, else why not: callers
// treat pinning as best effort.
std::string bind_this_thread_to_cpus(const std::vector<int>& cpus);

// "0-25,52-77": a CPU list in the kernel's (and numactl's) notation.
std::string format_cpu_list(const std::vector<int>& cpus);

// Binds the pages of [addr, addr + bytes) to NUMA node `node` before they are first
// touched. Returns "" on success, else why not (single-node kernels, containers without
// mbind): callers treat binding as best effort.
std::string bind_memory_to_numa_node(void* addr, uint64_t bytes, int node);

// While alive, memory the calling thread allocates comes from NUMA node `node` (use it
// around allocators that touch pages themselves, such as cudaHostAlloc). Best effort:
// error() says why binding did not happen. Restores the previous policy on destruction.
class ThreadMemoryBinding {
 public:
  explicit ThreadMemoryBinding(int node);
  ~ThreadMemoryBinding();
  ThreadMemoryBinding(const ThreadMemoryBinding&) = delete;
  ThreadMemoryBinding& operator=(const ThreadMemoryBinding&) = delete;
  const std::string& error() const { return error_; }

 private:
  void* previous_ = nullptr;  // hwloc_nodeset_t of the policy to restore
  int previous_policy_ = 0;
  bool bound_ = false;
  std::string error_;
};

}  // namespace strata
