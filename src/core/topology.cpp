// topology.cpp: the only file that talks to hwloc. One hwloc topology (with the
// important PCI devices, so GPUs can be placed) is loaded on first use and kept; a loaded
// hwloc topology may be queried from several threads at once.
#include "core/topology.h"

#include "core/error.h"

#include <hwloc.h>

#include <unistd.h>

#include <cerrno>

namespace strata {
namespace {

class Loaded {
 public:
  Loaded() {
    if (hwloc_topology_init(&topo_) != 0)
      fail("hwloc: cannot initialise a topology ({}); check that hwloc is installed (libhwloc15)",
           errno_text(errno));
    // PCI devices come from the linux component, which reads /sys/bus/pci. The "pci"
    // component (libpciaccess) finds the same devices but leaks on every load.
    hwloc_topology_set_components(topo_, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, "pci");
    if (hwloc_topology_set_io_types_filter(topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0 ||
        hwloc_topology_load(topo_) != 0) {
      const int err = errno;
      hwloc_topology_destroy(topo_);
      fail(
          "hwloc: cannot load the machine topology ({}); strata reads it from /sys and /proc: "
          "make sure both are mounted (in a container, do not mask /sys)",
          errno_text(err));
    }
    data_.packages = hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_PACKAGE);
    data_.cores = hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_CORE);
    data_.processing_units = hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_PU);
    const int nodes = hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_NUMANODE);
    for (int i = 0; i < nodes; ++i) {
      hwloc_obj_t obj = hwloc_get_obj_by_type(topo_, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
      NumaNode node;
      node.os_index = static_cast<int>(obj->os_index);
      node.memory_bytes = obj->attr ? obj->attr->numanode.local_memory : 0;
      if (obj->cpuset) {
        unsigned pu = 0;
        hwloc_bitmap_foreach_begin(pu, obj->cpuset) node.cpus.push_back(static_cast<int>(pu));
        hwloc_bitmap_foreach_end();
      }
      data_.numa_nodes.push_back(std::move(node));
    }
    // Some virtual machines report neither packages nor cores; count what is there.
    if (data_.cores == 0) data_.cores = data_.processing_units;
    if (data_.packages == 0) data_.packages = 1;
  }
  ~Loaded() { hwloc_topology_destroy(topo_); }
  Loaded(const Loaded&) = delete;
  Loaded& operator=(const Loaded&) = delete;

  hwloc_topology_t get() const { return topo_; }
  const Topology& data() const { return data_; }

 private:
  hwloc_topology_t topo_ = nullptr;
  Topology data_;
};

const Loaded& loaded() {
  static const Loaded instance;  // a throwing constructor is retried on the next call
  return instance;
}

// A nodeset holding `node`, or an error naming the node and the nodes that exist.
hwloc_nodeset_t nodeset_of(int node) {
  for (const NumaNode& n : loaded().data().numa_nodes) {
    if (n.os_index == node) {
      hwloc_nodeset_t set = hwloc_bitmap_alloc();
      hwloc_bitmap_only(set, static_cast<unsigned>(node));
      return set;
    }
  }
  std::vector<int> known;
  for (const NumaNode& n : loaded().data().numa_nodes) known.push_back(n.os_index);
  fail("NUMA node {} does not exist on this machine (nodes: {}); pick one of those", node,
       format_cpu_list(known));
}

// An hwloc bitmap freed at the end of its scope.
class Bitmap {
 public:
  Bitmap() : set_(hwloc_bitmap_alloc()) {
    if (set_ == nullptr) fail("hwloc: out of memory allocating a bitmap");
  }
  ~Bitmap() { hwloc_bitmap_free(set_); }
  Bitmap(const Bitmap&) = delete;
  Bitmap& operator=(const Bitmap&) = delete;
  hwloc_bitmap_t get() const { return set_; }

 private:
  hwloc_bitmap_t set_;
};

std::vector<int> to_list(hwloc_const_bitmap_t set) {
  std::vector<int> out;
  if (hwloc_bitmap_weight(set) < 0) return out;  // infinite: cannot be listed
  unsigned i = 0;
  hwloc_bitmap_foreach_begin(i, set) out.push_back(static_cast<int>(i));
  hwloc_bitmap_foreach_end();
  return out;
}

std::vector<int> cpubind_of(int flags) {
  Bitmap set;
  if (hwloc_get_cpubind(loaded().get(), set.get(), flags) != 0) return {};
  return to_list(set.get());
}

}  // namespace

const Topology& topology() {
  return loaded().data();
}

int numa_node_of_pci(const std::string& pci_bus_id) {
  hwloc_topology_t topo = loaded().get();
  hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo, pci_bus_id.c_str());
  if (dev == nullptr) return -1;
  hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(topo, dev);
  if (parent == nullptr || parent->nodeset == nullptr) return -1;
  if (hwloc_bitmap_weight(parent->nodeset) != 1) return -1;  // attached to the whole machine
  return hwloc_bitmap_first(parent->nodeset);
}

int numa_node_of_memory(const void* addr, uint64_t bytes) {
  const auto start = reinterpret_cast<uintptr_t>(addr);
  if (addr == nullptr || bytes == 0 || bytes - 1 > UINTPTR_MAX - start) return -1;
  hwloc_topology_t topo = loaded().get();
  const long page_size = sysconf(_SC_PAGESIZE);
  const uint64_t page = page_size > 0 ? static_cast<uint64_t>(page_size) : 4096;
  const uint64_t first = start / page, pages = (start + (bytes - 1)) / page - first + 1;
  Bitmap all, one;
  // Nodes of `count` pages from page `at`; untouched pages add no node.
  const auto add = [&](uint64_t at, uint64_t count) {
    hwloc_bitmap_zero(one.get());
    const auto* p = reinterpret_cast<const void*>(static_cast<uintptr_t>(at * page));
    if (hwloc_get_area_memlocation(topo, p, count * page, one.get(), HWLOC_MEMBIND_BYNODESET) != 0)
      return false;
    hwloc_bitmap_or(all.get(), all.get(), one.get());
    return true;
  };
  constexpr uint64_t kWholeUpTo = 64, kPairs = 32;
  if (pages <= kWholeUpTo) {
    if (!add(first, pages)) return -1;
  } else {
    for (uint64_t k = 0; k < kPairs; ++k)  // pairs from the first page to the last two
      if (!add(first + k * (pages - 2) / (kPairs - 1), 2)) return -1;
  }
  return hwloc_bitmap_weight(all.get()) == 1 ? hwloc_bitmap_first(all.get()) : -1;
}

std::vector<int> cpus_of_this_thread() {
  return cpubind_of(HWLOC_CPUBIND_THREAD);
}

std::vector<int> cpus_of_this_process() {
  return cpubind_of(HWLOC_CPUBIND_PROCESS);
}

std::string bind_this_thread_to_cpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return "no CPUs to bind this thread to";
  Bitmap set;
  for (int cpu : cpus) {
    if (cpu < 0) return "CPU " + std::to_string(cpu) + " is not a CPU number";
    hwloc_bitmap_set(set.get(), static_cast<unsigned>(cpu));
  }
  if (hwloc_set_cpubind(loaded().get(), set.get(), HWLOC_CPUBIND_THREAD) != 0)
    return "binding this thread to CPUs " + format_cpu_list(cpus) + ": " + errno_text(errno);
  return "";
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::string bind_memory_to_numa_node(void* addr, uint64_t bytes, int node) {
  hwloc_nodeset_t set = nodeset_of(node);
  const int rc = hwloc_set_area_membind(loaded().get(), addr, bytes, set, HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_BYNODESET);
  const int err = errno;
  hwloc_bitmap_free(set);
  return rc == 0 ? std::string()
                 : "mbind to NUMA node " + std::to_string(node) + ": " + errno_text(err);
}

ThreadMemoryBinding::ThreadMemoryBinding(int node) {
  hwloc_topology_t topo = loaded().get();
  hwloc_nodeset_t set = nodeset_of(node);
  hwloc_nodeset_t previous = hwloc_bitmap_alloc();
  hwloc_membind_policy_t policy = HWLOC_MEMBIND_DEFAULT;
  if (hwloc_get_membind(topo, previous, &policy, HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET) !=
      0) {
    error_ = "reading this thread's memory policy: " + errno_text(errno);
    hwloc_bitmap_free(previous);
  } else if (hwloc_set_membind(topo, set, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET) != 0) {
    error_ = "binding this thread's memory to NUMA node " + std::to_string(node) + ": " +
             errno_text(errno);
    hwloc_bitmap_free(previous);
  } else {
    previous_ = previous;
    previous_policy_ = policy;
    bound_ = true;
  }
  hwloc_bitmap_free(set);
}

ThreadMemoryBinding::~ThreadMemoryBinding() {
  if (!bound_) return;
  auto previous = static_cast<hwloc_nodeset_t>(previous_);
  hwloc_set_membind(loaded().get(), previous, static_cast<hwloc_membind_policy_t>(previous_policy_),
                    HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET);
  hwloc_bitmap_free(previous);
}

}  // namespace strata
