// collective_checks.cpp: argument checks shared by the communicators (collective_checks.h).
#include "partition/collective_checks.h"

#include "core/bytes.h"
#include "core/error.h"

#include <functional>
#include <string>

namespace strata {
namespace {

// One tensor of a call: rank `rank`'s `role` ("send", "recv", "buf").
struct Part {
  int rank;
  const char* role;
  const TensorView* view;
  bool written;
};

std::string describe(const Part& p) {
  return fmt::format("rank {}'s {} {}", p.rank, p.role, p.view->str());
}

void check_rank_count(const char* op, size_t ranks, size_t given, const char* what) {
  if (given != ranks)
    fail("{} over {} ranks: {} {} given; pass one per rank, in rank order", op, ranks, given, what);
}

void check_streams(const char* op, const std::vector<Device*>& devices,
                   const std::vector<Stream*>& streams) {
  check_rank_count(op, devices.size(), streams.size(), "streams");
  for (size_t r = 0; r < streams.size(); ++r) {
    if (streams[r] == nullptr)
      fail("{}: rank {}'s stream is null; pass a stream created by {}", op, r, devices[r]->name());
    // An empty copy checks that the stream is the device's own, and queues nothing.
    try {
      devices[r]->copy_from_peer(nullptr, *devices[r], nullptr, 0, *streams[r]);
    } catch (const Error& e) {
      fail("{}: rank {}'s stream: {}", op, r, e.what());
    }
  }
}

DType check_dtypes(const char* op, const std::vector<Part>& parts) {
  for (const Part& p : parts)
    if (p.view->dtype != DType::f32 && p.view->dtype != DType::bf16)
      fail("{}: {} is {}; collectives take f32 or bf16 tensors, convert it first", op, describe(p),
           dtype_name(p.view->dtype));
  for (const Part& p : parts)
    if (p.view->dtype != parts.front().view->dtype)
      fail("{}: {} is {} but {} is {}; give every tensor of one collective the same dtype", op,
           describe(p), dtype_name(p.view->dtype), describe(parts.front()),
           dtype_name(parts.front().view->dtype));
  return parts.front().view->dtype;
}

void check_numel(const char* op, const Part& p, int64_t expected, const std::string& because) {
  if (p.view->numel() != expected)
    fail("{}: {} has {} elements but must have {} ({}); give every rank the same count", op,
         describe(p), p.view->numel(), expected, because);
}

void check_memory(const char* op, const std::vector<Device*>& devices, const Part& p) {
  Device& device = *devices[static_cast<size_t>(p.rank)];
  if (p.view->device != nullptr && p.view->device != &device)
    fail("{}: {} belongs to {}, but rank {} is {}; pass each rank a tensor on its own device", op,
         describe(p), p.view->device->name(), p.rank, device.name());
  if (p.view->bytes() > 0 && !device.owns(p.view->data, p.view->bytes()))
    fail("{}: {} at {} (+{}) is not in {}'s memory; allocate it on rank {}'s device {}", op,
         describe(p), p.view->data, format_bytes(p.view->bytes()), device.name(), p.rank,
         device.name());
}

bool overlap(const TensorView& a, const TensorView& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data), pb = reinterpret_cast<uintptr_t>(b.data);
  return a.bytes() > 0 && b.bytes() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
}

// A tensor written by one rank may share memory with no other tensor of the call, except where
// `allowed` says so (all_gather in place).
void check_overlaps(const char* op, const std::vector<Part>& parts,
                    const std::function<bool(const Part&, const Part&)>& allowed) {
  for (size_t i = 0; i < parts.size(); ++i)
    for (size_t j = i + 1; j < parts.size(); ++j) {
      const Part &a = parts[i], &b = parts[j];
      if ((a.written || b.written) && overlap(*a.view, *b.view) && !allowed(a, b) && !allowed(b, a))
        fail(
            "{}: {} at {} and {} at {} overlap in memory; give every tensor its own memory "
            "(only all_gather runs in place, with send the rank's own chunk of recv)",
            op, describe(a), a.view->data, describe(b), b.view->data);
    }
}

std::vector<Part> parts_of(const std::vector<TensorView>& views, const char* role, bool written) {
  std::vector<Part> parts;
  for (size_t r = 0; r < views.size(); ++r)
    parts.push_back({static_cast<int>(r), role, &views[r], written});
  return parts;
}

}  // namespace

bool gather_in_place(const TensorView& send, const TensorView& recv, int rank) {
  return send.bytes() > 0 &&
         static_cast<const char*>(send.data) ==
             static_cast<const char*>(recv.data) + static_cast<uint64_t>(rank) * send.bytes();
}

void check_communicator_devices(const char* who, const std::vector<Device*>& devices) {
  if (devices.empty()) fail("{}: no devices given; pass at least one", who);
  for (size_t r = 0; r < devices.size(); ++r)
    if (devices[r] == nullptr) fail("{}: device of rank {} is null; pass opened devices", who, r);
  for (size_t r = 1; r < devices.size(); ++r)
    if (devices[r]->backend() != devices[0]->backend())
      fail(
          "{}: rank {} is {} but rank 0 is {}; one communicator joins devices of one backend "
          "(--devices host:N or cuda)",
          who, r, devices[r]->name(), devices[0]->name());
}

namespace {

// all_gather and reduce_scatter mirror each other: one side holds `count` elements per rank
// (all_gather's send, reduce_scatter's recv), the other N times as many.
CollectiveShape check_gather_or_scatter(const char* op, const std::vector<Device*>& devices,
                                        const std::vector<TensorView>& send,
                                        const std::vector<TensorView>& recv,
                                        const std::vector<Stream*>& streams, bool gather) {
  const size_t n = devices.size();
  check_rank_count(op, n, send.size(), "send tensors");
  check_rank_count(op, n, recv.size(), "recv tensors");
  check_streams(op, devices, streams);
  std::vector<Part> parts = parts_of(send, "send", false);
  const std::vector<Part> recv_parts = parts_of(recv, "recv", true);
  parts.insert(parts.end(), recv_parts.begin(), recv_parts.end());
  const std::vector<TensorView>& per_rank = gather ? send : recv;
  const char* per_rank_role = gather ? "send" : "recv";
  CollectiveShape shape{check_dtypes(op, parts), per_rank[0].numel()};
  for (const Part& p : parts) {
    const bool small = p.view == &per_rank[static_cast<size_t>(p.rank)];
    check_numel(
        op, p, small ? shape.count : shape.count * static_cast<int64_t>(n),
        small ? fmt::format("rank 0's {} has {}", per_rank_role, shape.count)
              : fmt::format("{} ranks x rank 0's {} count {}", n, per_rank_role, shape.count));
    check_memory(op, devices, p);
  }
  check_overlaps(op, parts, [&](const Part& a, const Part& b) {
    return gather && a.rank == b.rank && a.view == &send[static_cast<size_t>(a.rank)] &&
           b.view == &recv[static_cast<size_t>(b.rank)] &&
           gather_in_place(*a.view, *b.view, a.rank);
  });
  return shape;
}

}  // namespace

CollectiveShape check_all_gather(const std::vector<Device*>& devices,
                                 const std::vector<TensorView>& send,
                                 const std::vector<TensorView>& recv,
                                 const std::vector<Stream*>& streams) {
  return check_gather_or_scatter("all_gather", devices, send, recv, streams, true);
}

CollectiveShape check_reduce_scatter(const std::vector<Device*>& devices,
                                     const std::vector<TensorView>& send,
                                     const std::vector<TensorView>& recv,
                                     const std::vector<Stream*>& streams) {
  return check_gather_or_scatter("reduce_scatter", devices, send, recv, streams, false);
}

CollectiveShape check_all_reduce(const std::vector<Device*>& devices,
                                 const std::vector<TensorView>& buf,
                                 const std::vector<Stream*>& streams) {
  const char* op = "all_reduce";
  check_rank_count(op, devices.size(), buf.size(), "buffers");
  check_streams(op, devices, streams);
  const std::vector<Part> parts = parts_of(buf, "buf", true);
  CollectiveShape shape{check_dtypes(op, parts), buf[0].numel()};
  for (const Part& p : parts) {
    check_numel(op, p, shape.count, fmt::format("rank 0's buf has {}", shape.count));
    check_memory(op, devices, p);
  }
  check_overlaps(op, parts, [](const Part&, const Part&) { return false; });
  return shape;
}

}  // namespace strata
