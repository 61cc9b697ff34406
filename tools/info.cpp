// info.cpp: `strata info [--json]`, what this machine offers a training run: CPU and SIMD
// level, NUMA nodes, RAM and the pinned-memory limit, GPUs, CUDA/NCCL, io_uring, and the
// filesystems that could hold NVMe swap.
//
// Every fact is gathered once into one JSON document; the text report is printed from that
// document, so the two forms never disagree. A missing GPU, driver or io_uring is a fact to
// report, not an error: both forms exit 0 on any machine strata builds on.
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/system.h"
#include "core/topology.h"
#include "gpu/runtime.h"

#include <fmt/format.h>
#include <unistd.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace strata::cli {
namespace {

using ojson = nlohmann::ordered_json;  // keys print in the order they are gathered

ojson version_or_null(std::string text) {
  return text.empty() ? ojson() : ojson(std::move(text));
}

// 13000 -> "13.0", 12040 -> "12.4".
std::string cuda_version_text(int v) {
  return v <= 0 ? "" : fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}
// 22703 -> "2.27.3" (NCCL >= 2.9 codes); 2804 -> "2.8.4" (older codes).
std::string nccl_version_text(int v) {
  if (v <= 0) return "";
  if (v >= 10000) return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  return fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
}

ojson cpu_facts() {
  ojson cpu;
  cpu["model"] = cpu_model();
  cpu["arch"] = machine_arch();
  const SimdInfo simd = cpu_simd();
  cpu["simd"] = simd.best;
  cpu["simd_available"] = simd.available;
  try {
    const Topology& t = topology();
    cpu["logical_cpus"] = t.processing_units;
    cpu["physical_cores"] = t.cores;
    cpu["packages"] = t.packages;
    ojson nodes = ojson::array();
    for (const NumaNode& n : t.numa_nodes)
      nodes.push_back({{"os_index", n.os_index},
                       {"memory_bytes", n.memory_bytes},
                       {"cpus", format_cpu_list(n.cpus)}});
    cpu["numa_nodes"] = nodes;
  } catch (const Error& e) {
    cpu["logical_cpus"] = sysconf(_SC_NPROCESSORS_ONLN);
    cpu["physical_cores"] = nullptr;
    cpu["packages"] = nullptr;
    cpu["numa_nodes"] = ojson::array();
    cpu["topology_error"] = e.what();
  }
  return cpu;
}

ojson memory_facts() {
  const MemoryInfo m = memory_info();
  const uint64_t limit = memlock_limit();
  return {{"total_bytes", m.total},
          {"available_bytes", m.available},
          {"memlock_limit_bytes", limit == kUnlimited ? ojson("unlimited") : ojson(limit)},
          {"memlock_limit_applies", !can_lock_past_limit()}};
}

ojson gpu_facts(const CudaRuntime& rt) {
  ojson gpus = ojson::array();
  for (const CudaGpu& g : rt.gpus) {
    int node = -1;
    try {
      node = numa_node_of_pci(g.pci_bus_id);
    } catch (const Error&) {
      // no topology: the CPU section already carries the reason
    }
    gpus.push_back({{"index", g.index},
                    {"name", g.name},
                    {"memory_bytes", g.total_memory},
                    {"free_bytes", cuda_free_memory(g.index)},
                    {"compute_capability",
                     fmt::format("{}.{}", g.compute_capability / 10, g.compute_capability % 10)},
                    {"multiprocessors", g.multiprocessors},
                    {"pci_bus_id", g.pci_bus_id},
                    {"numa_node", node < 0 ? ojson() : ojson(node)}});
  }
  return gpus;
}

ojson cuda_facts(const CudaRuntime& rt) {
  return {{"status", rt.status},
          {"detail", rt.detail},
          {"compiled", rt.compiled},
          {"runtime_version", version_or_null(cuda_version_text(rt.runtime_version))},
          {"driver_version", version_or_null(cuda_version_text(rt.driver_version))},
          {"nccl_version", version_or_null(nccl_version_text(rt.nccl_version))},
          {"nccl_runtime_version", version_or_null(nccl_version_text(rt.nccl_runtime_version))}};
}

ojson io_uring_facts() {
  const IoUringProbe p = probe_io_uring();
  return {{"works", p.works}, {"detail", p.detail}, {"read", p.read}, {"write", p.write}};
}

ojson filesystem_facts() {
  ojson out = ojson::array();
  for (const Filesystem& fs : swap_filesystems()) {
    ojson o_direct = fs.o_direct.result == ODirect::yes  ? ojson(true)
                     : fs.o_direct.result == ODirect::no ? ojson(false)
                                                         : ojson("not writable");
    out.push_back({{"mount_point", fs.mount_point},
                   {"type", fs.type},
                   {"device", fs.device},
                   {"total_bytes", fs.total_bytes},
                   {"free_bytes", fs.free_bytes},
                   {"writable", fs.writable},
                   {"o_direct", o_direct},
                   {"o_direct_detail", fs.o_direct.detail}});
  }
  return out;
}

ojson gather() {
  const CudaRuntime& rt = cuda_runtime();
  return {{"cpu", cpu_facts()},           {"memory", memory_facts()},
          {"gpus", gpu_facts(rt)},        {"cuda", cuda_facts(rt)},
          {"io_uring", io_uring_facts()}, {"filesystems", filesystem_facts()}};
}

std::string bytes_of(const ojson& v) {
  return format_bytes(v.get<uint64_t>());
}
std::string text_of(const ojson& v) {
  return v.is_null() ? "?" : v.dump();
}

void print_text(const ojson& f) {
  const ojson& cpu = f["cpu"];
  fmt::print("CPU          {} ({}), SIMD {}\n", cpu["model"].get<std::string>(),
             cpu["arch"].get<std::string>(), cpu["simd"].get<std::string>());
  std::string levels;
  for (const ojson& l : cpu["simd_available"])
    levels += (levels.empty() ? "" : " ") + l.get<std::string>();
  fmt::print("             SIMD available: {}\n", levels.empty() ? "none" : levels);
  fmt::print("             {} package(s), {} physical cores, {} logical CPUs\n",
             text_of(cpu["packages"]), text_of(cpu["physical_cores"]),
             text_of(cpu["logical_cpus"]));
  if (cpu.contains("topology_error"))
    fmt::print("             topology unknown: {}\n", cpu["topology_error"].get<std::string>());
  for (const ojson& n : cpu["numa_nodes"])
    fmt::print("NUMA node {:<2} {}, CPUs {}\n", n["os_index"].get<int>(),
               bytes_of(n["memory_bytes"]), n["cpus"].get<std::string>());

  const ojson& mem = f["memory"];
  fmt::print("Memory       {} total, {} available\n", bytes_of(mem["total_bytes"]),
             bytes_of(mem["available_bytes"]));
  const ojson& limit = mem["memlock_limit_bytes"];
  fmt::print("Pinned limit ulimit -l {}{}\n",
             limit.is_string() ? limit.get<std::string>() : bytes_of(limit),
             mem["memlock_limit_applies"].get<bool>()
                 ? ""
                 : " (does not apply: this process has CAP_IPC_LOCK)");

  const ojson& cuda = f["cuda"];
  const std::string status = cuda["status"].get<std::string>();
  const std::string detail = cuda["detail"].get<std::string>();
  if (f["gpus"].empty()) {
    const std::string why = status == "not compiled" ? "CUDA not compiled" : "CUDA " + status;
    fmt::print("GPUs         none ({}{}{})\n", why, detail.empty() ? "" : ": ", detail);
  }
  for (const ojson& g : f["gpus"])
    fmt::print("GPU {:<8} {}, {} ({} free), compute {}, PCI {}, NUMA node {}\n",
               g["index"].get<int>(), g["name"].get<std::string>(), bytes_of(g["memory_bytes"]),
               bytes_of(g["free_bytes"]), g["compute_capability"].get<std::string>(),
               g["pci_bus_id"].get<std::string>(),
               g["numa_node"].is_null() ? "unknown" : g["numa_node"].dump());
  auto version = [](const ojson& v) {
    return v.is_null() ? std::string("none") : v.get<std::string>();
  };
  if (cuda["compiled"].get<bool>()) {
    fmt::print("CUDA         {}: runtime {} compiled in, driver {}\n", status,
               version(cuda["runtime_version"]), version(cuda["driver_version"]));
    fmt::print("NCCL         {} compiled in, {} at run time\n", version(cuda["nccl_version"]),
               version(cuda["nccl_runtime_version"]));
  } else {
    fmt::print("CUDA         not compiled (rebuild where the CUDA toolkit is installed)\n");
  }

  const ojson& uring = f["io_uring"];
  if (uring["works"].get<bool>())
    fmt::print("io_uring     works ({}); READ {}, WRITE {}\n", uring["detail"].get<std::string>(),
               uring["read"].get<bool>() ? "yes" : "no", uring["write"].get<bool>() ? "yes" : "no");
  else
    fmt::print("io_uring     does not work: {}\n", uring["detail"].get<std::string>());

  const ojson& fss = f["filesystems"];
  fmt::print("Filesystems that could hold swap:{}\n", fss.empty() ? " none" : "");
  if (fss.empty()) return;
  size_t wm = 5, wt = 4, wd = 6;
  for (const ojson& fs : fss) {
    wm = std::max(wm, fs["mount_point"].get<std::string>().size());
    wt = std::max(wt, fs["type"].get<std::string>().size());
    wd = std::max(wd, fs["device"].get<std::string>().size());
  }
  fmt::print("  {:<{}}  {:<{}}  {:<{}}  {:>10}  {:>10}  {}\n", "MOUNT", wm, "TYPE", wt, "DEVICE",
             wd, "FREE", "TOTAL", "O_DIRECT");
  for (const ojson& fs : fss) {
    const ojson& od = fs["o_direct"];
    std::string o = od.is_string() ? od.get<std::string>() : od.get<bool>() ? "yes" : "no";
    const std::string why = fs["o_direct_detail"].get<std::string>();
    if (od.is_boolean() && !od.get<bool>() && !why.empty()) o += " (" + why + ")";
    fmt::print("  {:<{}}  {:<{}}  {:<{}}  {:>10}  {:>10}  {}\n",
               fs["mount_point"].get<std::string>(), wm, fs["type"].get<std::string>(), wt,
               fs["device"].get<std::string>(), wd, bytes_of(fs["free_bytes"]),
               bytes_of(fs["total_bytes"]), o);
  }
}

}  // namespace

Command add_info(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "info",
      "Report what this machine offers: CPU, NUMA, RAM, pinned-memory limit, GPUs, "
      "CUDA/NCCL, io_uring and swap filesystems");
  auto json_out = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json_out, "print the report as JSON");
  return {cmd, [json_out] {
            const ojson facts = gather();
            if (*json_out)
              fmt::print("{}\n", facts.dump(2));
            else
              print_text(facts);
            return 0;
          }};
}

}  // namespace strata::cli
