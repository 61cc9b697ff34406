// nccl.cpp (CUDA emulator): NCCL's communicators and collectives on the CPU, for one process
// driving every rank (ncclCommInitAll).
//
// A rank's collective is checked at the call (buffers inside live allocations of the comm's GPU,
// the stream on that GPU, in-place positions exact or buffers apart) and queued on its stream as
// a task; inside ncclGroupStart/End the calls are queued at the outermost ncclGroupEnd, in call
// order, or none of them if one failed. The n-th collective a rank queues meets the n-th of
// every other rank (a "round"). Each rank's task:
// 1. arrives and waits (condition variable) until every rank has arrived. The last to arrive
//    checks that all called the same collective with the same count and dtype (and that their
//    buffers are still allocated); otherwise every rank's task throws a Fault naming both calls,
//    which leaves each GPU with a sticky error, as a mismatched NCCL call would wreck the job;
// 2. computes its own output from every rank's input: sums in rank order (rank 0 + rank 1 +
//    ...), accumulated in f32 for bf16 and f16 and rounded once to nearest even, so results are
//    deterministic; integers wrap;
// 3. waits until every rank has finished reading the inputs, so that no stream goes on (and,
//    say, overwrites its send buffer) while a peer still reads it. An in-place all-reduce stages
//    its result and stores it only then, since its peers read its buffer until that point.
// A rank that cannot arrive makes the others fail instead of hang: its task dropped by the
// runtime (its GPU has a sticky error), its communicator destroyed before queuing the round, or
// STRATA_EMU_NCCL_TIMEOUT seconds (default 600; 0: no limit) without it. Real NCCL would hang
// in those cases, and so would a single ungrouped call per rank from one thread: the emulator
// queues that one, as the per-rank tasks never block the calling thread.
#include "emu_internal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

thread_local std::string t_last_error;

// Records what ncclGetLastError says next on this thread (printed, as NCCL's WARN lines are,
// when NCCL_DEBUG is set).
ncclResult_t fail(ncclResult_t result, std::string message) {
  t_last_error = std::move(message);
  if (const char* debug = std::getenv("NCCL_DEBUG"); debug != nullptr && *debug != '\0')
    std::fprintf(stderr, "cuda_emu NCCL WARN %s\n", t_last_error.c_str());
  return result;
}

enum class Kind { kAllGather, kReduceScatter, kAllReduce };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllGather:
      return "ncclAllGather";
    case Kind::kReduceScatter:
      return "ncclReduceScatter";
    case Kind::kAllReduce:
      return "ncclAllReduce";
  }
  return "?";
}

const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return "ncclInt8";
    case ncclUint8:
      return "ncclUint8";
    case ncclInt32:
      return "ncclInt32";
    case ncclUint32:
      return "ncclUint32";
    case ncclInt64:
      return "ncclInt64";
    case ncclUint64:
      return "ncclUint64";
    case ncclFloat16:
      return "ncclFloat16";
    case ncclFloat32:
      return "ncclFloat32";
    case ncclFloat64:
      return "ncclFloat64";
    case ncclBfloat16:
      return "ncclBfloat16";
    case ncclFloat8e4m3:
      return "ncclFloat8e4m3";
    case ncclFloat8e5m2:
      return "ncclFloat8e5m2";
    default:
      return "ncclDataType_t(?)";
  }
}

// Bytes per element of the dtypes the emulator implements (0: not one of them).
size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

// One rank's call.
struct Op {
  Kind kind;
  size_t count;  // per rank: sendcount, recvcount or count as the call names it
  ncclDataType_t dtype;
  ncclRedOp_t red;
  const void* send;
  void* recv;
  size_t send_bytes, recv_bytes;
  bool in_place;
};

std::string op_text(const Op& op) {
  std::string s = std::string(kind_name(op.kind)) + "(count " + std::to_string(op.count) + ", " +
                  type_name(op.dtype);
  if (op.kind != Kind::kAllGather) s += op.red == ncclSum ? ", ncclSum" : ", another op";
  return s + ")";
}

double timeout_seconds() {
  static const double seconds = [] {
    const char* v = std::getenv("STRATA_EMU_NCCL_TIMEOUT");
    return v != nullptr && *v != '\0' ? std::atof(v) : 600.0;
  }();
  return seconds;
}

// One collective across the clique: the n-th call of every rank.
struct Round {
  std::vector<Op> ops;        // by rank
  std::vector<char> present;  // by rank: arrived
  int arrived = 0, done_reading = 0, left = 0;
  std::string fault;  // set once: every rank's task throws it
};

// The ranks of one ncclCommInitAll and their rounds. Shared by the communicators and by the
// queued tasks, which may outlive a communicator destroyed right after queuing them.
struct Clique {
  int size = 0;
  std::vector<int> devices;
  std::mutex mutex;
  std::condition_variable cv;
  std::map<uint64_t, Round> rounds;
  std::vector<uint64_t> issued;   // per rank: collectives queued so far
  std::vector<uint64_t> pending;  // per rank: queued tasks not finished (run or dropped)
  std::vector<char> destroyed;    // per rank: communicator destroyed (issued[] is final)

  Round& round(uint64_t seq) {
    Round& r = rounds[seq];
    if (r.present.empty()) {
      r.ops.resize(static_cast<size_t>(size));
      r.present.assign(static_cast<size_t>(size), 0);
    }
    return r;
  }
  // Called with the mutex held by each rank done with round `seq`.
  void leave(uint64_t seq, Round& r) {
    if (++r.left == size) rounds.erase(seq);
  }
  // Why a rank missing from round `seq` will never come, or "".
  std::string never_coming(uint64_t seq, const Round& r) const {
    for (int q = 0; q < size; ++q) {
      const auto uq = static_cast<size_t>(q);
      if (!r.present[uq] && destroyed[uq] && issued[uq] <= seq)
        return "NCCL collective #" + std::to_string(seq) + ": rank " + std::to_string(q) +
               "'s communicator was destroyed after it had queued only " +
               std::to_string(issued[uq]) + " collectives, so it never joins this one";
    }
    return "";
  }
  std::string timed_out(uint64_t seq, const Round& r) const {
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", timeout_seconds());
    std::string s = "NCCL collective #" + std::to_string(seq) + ": waited " + limit +
                    " s (STRATA_EMU_NCCL_TIMEOUT) for";
    for (int q = 0; q < size; ++q) {
      const auto uq = static_cast<size_t>(q);
      if (r.present[uq]) continue;
      s += " rank " + std::to_string(q) +
           (issued[uq] > seq ? " (queued it; its stream has not reached it)"
                             : " (has not called it)");
    }
    return s;
  }
  // Run by the last rank to arrive: the same collective everywhere, buffers still there.
  std::string check_complete(uint64_t seq, const Round& r) const {
    const std::string at = "NCCL collective #" + std::to_string(seq) + ": ";
    const Op& first = r.ops[0];
    for (int q = 1; q < size; ++q) {
      const Op& op = r.ops[static_cast<size_t>(q)];
      if (op.kind != first.kind || op.count != first.count || op.dtype != first.dtype ||
          (op.kind != Kind::kAllGather && op.red != first.red))
        return at + "rank 0 called " + op_text(first) + " but rank " + std::to_string(q) +
               " called " + op_text(op) + "; every rank must make the same calls in order";
    }
    for (int q = 0; q < size; ++q) {
      const Op& op = r.ops[static_cast<size_t>(q)];
      int device = -1;
      if (!cuda_emu::device_range(op.send, op.send_bytes, &device) ||
          !cuda_emu::device_range(op.recv, op.recv_bytes, &device))
        return at + "rank " + std::to_string(q) + "'s " + op_text(op) +
               ": a buffer was freed before the collective ran";
    }
    return "";
  }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;
  int rank;
  int device;
  bool finalized = false;
};

namespace {

// Sums element i over the ranks' inputs in rank order, with one rounding at the store.
template <typename T>
void reduce_typed(const std::vector<const unsigned char*>& in, unsigned char* out, size_t count) {
  const auto get = [](const unsigned char* p, size_t i) {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof(T));
    return v;
  };
  for (size_t i = 0; i < count; ++i) {
    T result;
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      const auto widen = [](T h) {
        if constexpr (std::is_same_v<T, __half>) {
          return __half2float(h);
        } else {
          return __bfloat162float(h);
        }
      };
      float acc = widen(get(in[0], i));
      for (size_t q = 1; q < in.size(); ++q) acc = acc + widen(get(in[q], i));
      if constexpr (std::is_same_v<T, __half>) {
        result = __float2half_rn(acc);
      } else {
        result = __float2bfloat16_rn(acc);
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      T acc = get(in[0], i);
      for (size_t q = 1; q < in.size(); ++q) acc = acc + get(in[q], i);
      result = acc;
    } else {  // integers wrap, as on the GPU (unsigned arithmetic: no undefined overflow)
      using U = std::make_unsigned_t<T>;
      U acc = static_cast<U>(get(in[0], i));
      for (size_t q = 1; q < in.size(); ++q)
        acc = static_cast<U>(acc + static_cast<U>(get(in[q], i)));
      result = static_cast<T>(acc);
    }
    std::memcpy(out + i * sizeof(T), &result, sizeof(T));
  }
}

void reduce(ncclDataType_t t, const std::vector<const unsigned char*>& in, unsigned char* out,
            size_t count) {
  switch (t) {
    case ncclInt8:
      return reduce_typed<int8_t>(in, out, count);
    case ncclUint8:
      return reduce_typed<uint8_t>(in, out, count);
    case ncclInt32:
      return reduce_typed<int32_t>(in, out, count);
    case ncclUint32:
      return reduce_typed<uint32_t>(in, out, count);
    case ncclInt64:
      return reduce_typed<int64_t>(in, out, count);
    case ncclUint64:
      return reduce_typed<uint64_t>(in, out, count);
    case ncclFloat16:
      return reduce_typed<__half>(in, out, count);
    case ncclFloat32:
      return reduce_typed<float>(in, out, count);
    case ncclFloat64:
      return reduce_typed<double>(in, out, count);
    case ncclBfloat16:
      return reduce_typed<__nv_bfloat16>(in, out, count);
    default:
      throw cuda_emu::Fault(std::string("NCCL: reduction of ") + type_name(t) + " not emulated");
  }
}

// Rank `rank`'s output of a complete round. Returns the staged result of an in-place
// all-reduce (stored after the second barrier), else writes the output directly: the ranks'
// buffers lie on distinct GPUs, so only a rank's own in-place all-reduce writes what a peer
// still reads.
std::vector<unsigned char> compute(const Round& r, int rank) {
  const Op& me = r.ops[static_cast<size_t>(rank)];
  const size_t es = type_bytes(me.dtype), chunk = me.count * es;
  auto* recv = static_cast<unsigned char*>(me.recv);
  std::vector<const unsigned char*> in;
  switch (me.kind) {
    case Kind::kAllGather:
      for (size_t q = 0; q < r.ops.size(); ++q) {
        const void* src = r.ops[q].send;
        if (src != recv + q * chunk) std::memcpy(recv + q * chunk, src, chunk);
      }
      return {};
    case Kind::kReduceScatter:
      // In place, recv is the rank's own chunk of send: element i is read before it is written,
      // and the peers read only their own chunks of it.
      for (const Op& op : r.ops)
        in.push_back(static_cast<const unsigned char*>(op.send) +
                     static_cast<size_t>(rank) * chunk);
      reduce(me.dtype, in, recv, me.count);
      return {};
    case Kind::kAllReduce: {
      for (const Op& op : r.ops) in.push_back(static_cast<const unsigned char*>(op.send));
      if (!me.in_place) {
        reduce(me.dtype, in, recv, me.count);
        return {};
      }
      std::vector<unsigned char> staged(chunk);
      reduce(me.dtype, in, staged.data(), me.count);
      return staged;
    }
  }
  return {};
}

// One rank's part of one round, shared by the copies of its queued task. A task the runtime
// drops without running (its GPU has a sticky error) destroys its part unrun, which tells the
// peers: they would otherwise wait for it forever.
class Part {
 public:
  Part(std::shared_ptr<Clique> clique, int rank, uint64_t seq, const Op& op)
      : clique_(std::move(clique)), rank_(rank), seq_(seq), op_(op) {}
  Part(const Part&) = delete;
  Part& operator=(const Part&) = delete;
  ~Part() {
    if (ran_) return;
    Clique& c = *clique_;
    std::lock_guard lock(c.mutex);
    Round& r = c.round(seq_);
    if (r.fault.empty())
      r.fault = "NCCL collective #" + std::to_string(seq_) + ": rank " + std::to_string(rank_) +
                "'s " + op_text(op_) +
                " was dropped before it ran (its GPU has a sticky error from an earlier fault)";
    c.leave(seq_, r);
    --c.pending[static_cast<size_t>(rank_)];
    c.cv.notify_all();
  }

  void run() {
    ran_ = true;
    Clique& c = *clique_;
    const auto ur = static_cast<size_t>(rank_);
    std::unique_lock lock(c.mutex);
    // Whatever happens below, the rank's finalize stops waiting for this part.
    struct Done {
      Clique& c;
      std::unique_lock<std::mutex>& lock;
      size_t rank;
      ~Done() {
        if (!lock.owns_lock()) lock.lock();
        --c.pending[rank];
        c.cv.notify_all();
      }
    } done{c, lock, ur};

    Round& r = c.round(seq_);
    r.ops[ur] = op_;
    r.present[ur] = 1;
    if (++r.arrived == c.size && r.fault.empty()) r.fault = c.check_complete(seq_, r);
    c.cv.notify_all();
    const double limit = timeout_seconds();
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(limit > 0 ? limit : 0.0));
    while (r.fault.empty() && r.arrived < c.size) {
      if (std::string why = c.never_coming(seq_, r); !why.empty()) {
        r.fault = std::move(why);
        c.cv.notify_all();
        break;
      }
      if (limit <= 0) {
        c.cv.wait(lock);
      } else if (c.cv.wait_until(lock, deadline) == std::cv_status::timeout && r.arrived < c.size &&
                 r.fault.empty()) {
        r.fault = c.timed_out(seq_, r);
        c.cv.notify_all();
      }
    }
    if (!r.fault.empty()) {
      const std::string fault = r.fault;
      c.leave(seq_, r);
      throw cuda_emu::Fault(fault);
    }

    lock.unlock();
    std::vector<unsigned char> staged;
    std::exception_ptr error;
    try {
      staged = compute(r, rank_);
    } catch (...) {
      error = std::current_exception();  // after the barrier: the peers must not wait forever
    }
    lock.lock();
    ++r.done_reading;
    c.cv.notify_all();
    c.cv.wait(lock, [&] { return r.done_reading == c.size; });
    lock.unlock();
    if (!staged.empty()) std::memcpy(op_.recv, staged.data(), staged.size());
    lock.lock();
    c.leave(seq_, r);
    if (error) std::rethrow_exception(error);
  }

 private:
  std::shared_ptr<Clique> clique_;
  int rank_;
  uint64_t seq_;
  Op op_;
  bool ran_ = false;  // set and read on the stream's worker thread
};

// The default stream's handles name the current GPU's default stream; NCCL makes the comm's GPU
// current before it launches, so for a collective they name the comm GPU's.
bool is_default(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// Queues `op` as the comm's next collective on `stream`.
ncclResult_t issue(ncclComm* comm, const Op& op, cudaStream_t stream) {
  Clique& c = *comm->clique;
  uint64_t seq = 0;
  {
    std::lock_guard lock(c.mutex);
    seq = c.issued[static_cast<size_t>(comm->rank)]++;
    ++c.pending[static_cast<size_t>(comm->rank)];
  }
  // The task holds the only reference: the part goes with it, run or dropped.
  auto part = std::make_shared<Part>(comm->clique, comm->rank, seq, op);
  int previous = -1;
  const bool switch_device = is_default(stream) && cuda_emu::current_device() != comm->device;
  if (switch_device) {
    previous = cuda_emu::current_device();
    (void)cudaSetDevice(comm->device);
  }
  try {
    cuda_emu::enqueue(stream, [part = std::move(part)] { part->run(); });
  } catch (const std::exception& e) {
    if (switch_device) (void)cudaSetDevice(previous);
    return fail(ncclUnhandledCudaError,
                std::string(kind_name(op.kind)) + ": queuing on the stream failed: " + e.what());
  }
  if (switch_device) (void)cudaSetDevice(previous);
  return ncclSuccess;
}

void wait_idle(ncclComm* comm) {
  Clique& c = *comm->clique;
  std::unique_lock lock(c.mutex);
  c.cv.wait(lock, [&] { return c.pending[static_cast<size_t>(comm->rank)] == 0; });
}

// The calling thread's open group.
struct GroupCall {
  ncclComm* comm;
  Op op;
  cudaStream_t stream;
};
struct Group {
  int depth = 0;
  ncclResult_t error = ncclSuccess;
  std::vector<GroupCall> calls;
  std::vector<ncclComm*> finalizes;
};
thread_local Group t_group;

// A failed call inside a group fails the whole group at ncclGroupEnd, as in NCCL.
ncclResult_t group_fail(ncclResult_t result, std::string message) {
  if (t_group.depth > 0 && t_group.error == ncclSuccess) t_group.error = result;
  return fail(result, std::move(message));
}

bool overlaps(const void* p, size_t p_bytes, const void* q, size_t q_bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + q_bytes && b < a + p_bytes;
}

ncclResult_t collective(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t dtype,
                        ncclRedOp_t red, ncclComm* comm, cudaStream_t stream) {
  const std::string fn = kind_name(kind);
  if (comm == nullptr) return group_fail(ncclInvalidArgument, fn + ": comm is NULL");
  const std::string who = fn + " on rank " + std::to_string(comm->rank) +
                          " (cuda:" + std::to_string(comm->device) + ")";
  if (comm->finalized)
    return group_fail(ncclInvalidUsage, who + ": the communicator has been finalized");
  const size_t es = type_bytes(dtype);
  if (es == 0)
    return group_fail(ncclInvalidArgument,
                      who + ": datatype " + std::to_string(static_cast<int>(dtype)) + " (" +
                          type_name(dtype) + ") is not one the emulator implements");
  if (kind != Kind::kAllGather && red != ncclSum)
    return group_fail(ncclInvalidArgument,
                      who + ": reduction op " + std::to_string(static_cast<int>(red)) +
                          " is not implemented by the emulator (ncclSum only)");
  if (cuda_emu::sticky_error(comm->device) != cudaSuccess)
    return group_fail(ncclUnhandledCudaError,
                      who + ": the GPU has a sticky CUDA error from an earlier fault");
  const int stream_device = is_default(stream) ? comm->device : cuda_emu::stream_device(stream);
  if (stream_device < 0)
    return group_fail(ncclInvalidArgument, who + ": the stream is not a live stream");
  if (stream_device != comm->device)
    return group_fail(ncclInvalidArgument,
                      who + ": the stream belongs to cuda:" + std::to_string(stream_device));
  if (count == 0) return ncclSuccess;  // nothing to move: nothing queued, as in NCCL

  const size_t size = static_cast<size_t>(comm->clique->size);
  size_t chunk = 0, total = 0;
  if (__builtin_mul_overflow(count, es, &chunk) || __builtin_mul_overflow(chunk, size, &total))
    return group_fail(ncclInvalidArgument, who + ": count " + std::to_string(count) + " overflows");
  Op op{kind, count, dtype, red, send, recv, 0, 0, false};
  op.send_bytes = kind == Kind::kReduceScatter ? total : chunk;
  op.recv_bytes = kind == Kind::kAllGather ? total : chunk;
  const struct {
    const char* name;
    const void* ptr;
    size_t bytes;
  } buffers[2] = {{"sendbuff", send, op.send_bytes}, {"recvbuff", recv, op.recv_bytes}};
  for (const auto& b : buffers) {
    int on = -1;
    if (b.ptr == nullptr || !cuda_emu::device_range(b.ptr, b.bytes, &on))
      return group_fail(ncclInvalidArgument, who + ": " + b.name + " (" + std::to_string(b.bytes) +
                                                 " bytes) is not inside one live device "
                                                 "allocation");
    if (on != comm->device)
      return group_fail(ncclInvalidArgument,
                        who + ": " + b.name + " is in cuda:" + std::to_string(on) + "'s memory");
  }
  // In place means exactly NCCL's in-place position; any other overlap is a bug.
  const auto* s = static_cast<const unsigned char*>(send);
  const auto* d = static_cast<const unsigned char*>(recv);
  const size_t own = static_cast<size_t>(comm->rank) * chunk;
  const char* position = "";
  switch (kind) {
    case Kind::kAllGather:
      op.in_place = s == d + own;
      position = "sendbuff == recvbuff + rank * sendcount";
      break;
    case Kind::kReduceScatter:
      op.in_place = d == s + own;
      position = "recvbuff == sendbuff + rank * recvcount";
      break;
    case Kind::kAllReduce:
      op.in_place = s == d;
      position = "sendbuff == recvbuff";
      break;
  }
  if (!op.in_place && overlaps(send, op.send_bytes, recv, op.recv_bytes))
    return group_fail(
        ncclInvalidArgument,
        who + ": sendbuff and recvbuff overlap but are not in place (" + position + ")");

  if (t_group.depth > 0) {
    t_group.calls.push_back({comm, op, stream});
    return ncclSuccess;
  }
  return issue(comm, op, stream);
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) {
  return t_last_error.c_str();
}

ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  const char* fn = "ncclCommInitAll: ";
  if (comm == nullptr) return fail(ncclInvalidArgument, std::string(fn) + "comm is NULL");
  if (ndev < 1)
    return fail(ncclInvalidArgument, fn + std::to_string(ndev) + " devices: need at least 1");
  const int count = cuda_emu::device_count();
  if (count == 0) return fail(ncclUnhandledCudaError, std::string(fn) + "no CUDA device");
  auto clique = std::make_shared<Clique>();
  clique->size = ndev;
  for (int r = 0; r < ndev; ++r) {
    const int dev = devlist == nullptr ? r : devlist[r];
    if (dev < 0 || dev >= count)
      return fail(ncclInvalidArgument, fn + std::string("rank ") + std::to_string(r) +
                                           ": invalid device " + std::to_string(dev) + " (" +
                                           std::to_string(count) + " GPUs)");
    for (int q = 0; q < r; ++q)
      if (clique->devices[static_cast<size_t>(q)] == dev)
        return fail(ncclInvalidUsage, fn + std::string("Duplicate GPU detected: rank ") +
                                          std::to_string(q) + " and rank " + std::to_string(r) +
                                          " both on CUDA device " + std::to_string(dev));
    clique->devices.push_back(dev);
  }
  clique->issued.assign(static_cast<size_t>(ndev), 0);
  clique->pending.assign(static_cast<size_t>(ndev), 0);
  clique->destroyed.assign(static_cast<size_t>(ndev), 0);
  for (int r = 0; r < ndev; ++r)
    comm[r] = new ncclComm{clique, r, clique->devices[static_cast<size_t>(r)]};
  return ncclSuccess;
}

// Waits for the rank's queued collectives (at the outermost ncclGroupEnd inside a group, so
// that the ranks finalized together can all reach their last collectives).
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return fail(ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
  if (comm->finalized)
    return group_fail(ncclInvalidUsage, "ncclCommFinalize: rank " + std::to_string(comm->rank) +
                                            " is already finalized");
  comm->finalized = true;
  if (t_group.depth > 0) {
    t_group.finalizes.push_back(comm);
    return ncclSuccess;
  }
  wait_idle(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  for (const GroupCall& call : t_group.calls)
    if (call.comm == comm)
      return fail(ncclInvalidUsage, "ncclCommDestroy: rank " + std::to_string(comm->rank) +
                                        " still has calls in this thread's open group");
  for (ncclComm* f : t_group.finalizes)
    if (f == comm)
      return fail(ncclInvalidUsage, "ncclCommDestroy: rank " + std::to_string(comm->rank) +
                                        " is finalized in this thread's open group; call "
                                        "ncclGroupEnd first");
  wait_idle(comm);  // NCCL finalizes a communicator not finalized yet
  {
    Clique& c = *comm->clique;
    std::lock_guard lock(c.mutex);
    c.destroyed[static_cast<size_t>(comm->rank)] = 1;
    c.cv.notify_all();
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr)
    return fail(ncclInvalidArgument, "ncclCommCount: comm or count is NULL");
  *count = comm->clique->size;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (comm == nullptr || device == nullptr)
    return fail(ncclInvalidArgument, "ncclCommCuDevice: comm or device is NULL");
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr)
    return fail(ncclInvalidArgument, "ncclCommUserRank: comm or rank is NULL");
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Kind::kAllReduce, sendbuff, recvbuff, count, datatype, op, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective(Kind::kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, comm,
                    stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return collective(Kind::kAllGather, sendbuff, recvbuff, sendcount, datatype, ncclSum, comm,
                    stream);
}

ncclResult_t ncclGroupStart(void) {
  ++t_group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (t_group.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group.depth > 0) return ncclSuccess;
  Group group = std::move(t_group);
  t_group = Group{};
  if (group.error != ncclSuccess) return group.error;  // none of the group's calls is queued
  for (const GroupCall& call : group.calls)
    if (const ncclResult_t res = issue(call.comm, call.op, call.stream); res != ncclSuccess)
      return res;
  for (ncclComm* comm : group.finalizes) wait_idle(comm);
  return ncclSuccess;
}

}  // extern "C"
