// io_ring.h: the NVMe tier's I/O engine, one io_uring per I/O thread (DESIGN §5).
//
// Open files through the ring (add_file), then submit() reads and writes and wait_all().
// At most queue_depth requests are in flight: submit() reaps a completion before it queues
// more. Short reads and writes are resumed where they stopped and -EAGAIN/-EINTR are
// requeued, so a request completes whole or fails. Files are opened with O_DIRECT; where the
// filesystem refuses it (tmpfs, some network filesystems) they are opened buffered and one
// warning is logged. With O_DIRECT, the part of a request that is not 4 KiB aligned (an odd
// tail, an unaligned buffer or offset) goes through a second, buffered descriptor of the same
// file, so any request works and aligned ones run at the drive's speed.
//
// The one thing to know before editing: when anything fails, every request still in flight
// is waited for before the Error is thrown, so a caller unwinding its buffers never races the
// kernel. Request slots are preallocated (no heap allocation per request); completions are
// reaped with io_uring_wait_cqe (no spinning) unless sqpoll/iopoll are asked for. Not
// thread-safe: one IoRing per thread.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct io_uring;  // liburing's, kept out of this header

namespace strata::nvme {

inline constexpr uint64_t kDirectAlignment = 4096;  // buffer, offset and length for O_DIRECT

enum class IoOp : uint8_t { read, write };

// Fault injection for tests: make the `request`-th submit() (0-based, counted per ring) fail
// with EIO or ENOSPC, complete short once (it is then resumed), complete once with -EAGAIN
// (it is then queued again unchanged; a read's buffer is first cleared from where the part
// stood, as if nothing had been read), or (reads only) return data with one flipped byte,
// which only a checksum can catch. o_direct_refused (request ignored)
// makes add_file() see EINVAL from an O_DIRECT open, as on a filesystem that refuses it. slow
// delays the completion of that request and of every later one by kSlowFaultDelayMs (a slow
// drive: nothing fails, everything waits).
enum class FaultKind : uint8_t { eio, enospc, short_io, eagain, corrupt, o_direct_refused, slow };
inline constexpr int kSlowFaultDelayMs = 5;
struct Fault {
  FaultKind kind;
  uint64_t request;
};

// Faults named by the environment variable STRATA_NVME_FAULTS, for tests of whole runs (the
// swap store's ring takes them): a comma-separated list of KIND@REQUEST with KIND one of eio,
// enospc, short, eagain, corrupt, slow and REQUEST the 0-based submit() count of that ring. Empty
// when the variable is unset; an Error names a malformed entry.
std::vector<Fault> faults_from_env();

struct IoOptions {
  unsigned queue_depth = 32;      // requests in flight at most; 1..4096
  bool direct = true;             // O_DIRECT where the filesystem takes it
  bool register_buffers = false;  // READ_FIXED/WRITE_FIXED for buffers in register_buffer()
  bool register_files = false;    // IOSQE_FIXED_FILE for the ring's files
  bool sqpoll = false;            // a kernel thread polls the submission queue (burns a core)
  bool iopoll = false;            // busy-poll completions (O_DIRECT only; burns a core)
  std::vector<Fault> faults;      // tests only
  // Shared request numbering for faults: rings given the same counter count their submit()s
  // together (a swap store's rings, so a fault names the store's N-th request); null: each
  // ring counts its own.
  std::shared_ptr<std::atomic<uint64_t>> request_counter;
  // Whether a filesystem's refusal of O_DIRECT is logged (once per directory): a warning for the
  // swap store, whose drive should take it; nothing for a checkpoint's writer, which simply
  // writes a tmpfs run directory through the page cache.
  bool warn_if_buffered = true;
  // What a full filesystem's error tells the user to do (the swap store's default; a
  // checkpoint's writer has no nvme_path to add).
  std::string enospc_advice = "free space on that filesystem or add another nvme_path";
};

struct IoRequest {
  IoOp op = IoOp::read;
  int file = 0;  // index from add_file()
  uint64_t offset = 0;
  void* buf = nullptr;
  uint64_t len = 0;
  uint64_t tag = 0;  // the caller's, handed back to on_complete
};

struct IoStats {
  uint64_t requests = 0;        // submit() calls
  uint64_t bytes = 0;           // bytes moved by completed requests
  uint64_t resumed = 0;         // short reads/writes continued where they stopped
  uint64_t requeued = 0;        // -EAGAIN / -EINTR resubmissions
  uint64_t buffered_parts = 0;  // (parts of) requests sent through a buffered descriptor
  uint64_t fixed_buffers = 0;   // parts that used a registered buffer
};

class IoRing {
 public:
  // Throws Error when io_uring cannot be set up (naming the call and errno) or queue_depth
  // is out of range.
  explicit IoRing(IoOptions options);
  ~IoRing();  // waits for anything in flight; never throws
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;

  // Opens `path` read-write (creating it when `create`), O_DIRECT when asked and taken;
  // returns the index requests name it by. Throws Error naming the path and errno.
  int add_file(const std::string& path, bool create);
  bool is_direct(int file) const;
  int fd(int file) const;  // the descriptor for fallocate/fstat (direct when direct)
  const std::string& path(int file) const;

  // Registers [base, base+len) for READ_FIXED/WRITE_FIXED (with register_buffers); call
  // before submitting. A kernel refusal (memlock limit) is logged once and I/O goes on
  // without fixed buffers.
  void register_buffer(void* base, uint64_t len);

  // Called once per request when it has completed whole, from inside submit()/wait_all().
  // An Error it throws fails the batch like an I/O error does.
  void on_complete(std::function<void(const IoRequest&)> fn) { on_complete_ = std::move(fn); }

  // Queues a request, first reaping completions while the queue is full. Throws the first
  // failure (after waiting for everything in flight).
  void submit(const IoRequest& request);
  // Waits for every submitted request; throws the first failure after all have finished.
  void wait_all();
  // Waits for at least one completion when anything is in flight (to free a caller's
  // buffer); throws the first failure like submit().
  void wait_one();

  unsigned in_flight() const { return in_flight_; }
  const IoStats& stats() const { return stats_; }
  const IoOptions& options() const { return options_; }

 private:
  struct File;
  struct Part;
  struct Pending;
  void reap_one();
  void push_part(unsigned pending, bool buffered, uint64_t offset, char* buf, uint64_t len);
  void queue_part(unsigned slot);
  void finish_part(unsigned slot, int res);
  void record_failure(std::exception_ptr e);
  void throw_if_failed();

  IoOptions options_;
  std::unique_ptr<::io_uring> ring_;
  std::vector<File> files_;
  std::vector<Part> parts_;       // queue_depth slots
  std::vector<Pending> pending_;  // queue_depth user requests
  std::vector<unsigned> free_parts_;
  std::vector<unsigned> free_pending_;
  std::vector<iovec> buffers_;
  bool fixed_buffers_ = false;
  bool fixed_files_ = false;
  unsigned in_flight_ = 0;  // parts submitted to the kernel
  unsigned unsubmitted_ = 0;
  uint64_t sequence_ = 0;
  std::exception_ptr failure_;
  std::function<void(const IoRequest&)> on_complete_;
  IoStats stats_;
};

}  // namespace strata::nvme
