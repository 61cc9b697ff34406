// io_ring.cpp: IoRing over liburing. A user request becomes one or two "parts" (the aligned
// head through the O_DIRECT descriptor, an unaligned rest through the buffered one); each
// part owns one preallocated slot whose index is the SQE's user data. A part that completes
// short is queued again from where it stopped; -EAGAIN/-EINTR queue it again unchanged.
#include "nvme/io_ring.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>

namespace strata::nvme {

namespace {

constexpr unsigned kMaxFiles = 64;                // two descriptors each in the fixed-file table
constexpr uint64_t kMaxPartIo = 1ull << 30;       // io_uring lengths are 32-bit; longer ones resume
constexpr uint64_t kMaxFixedBuffer = 1ull << 30;  // the kernel's limit per registered iovec

bool aligned(uint64_t v) {
  return v % kDirectAlignment == 0;
}
bool aligned(const void* p) {
  return aligned(reinterpret_cast<uintptr_t>(p));
}

const char* op_name(IoOp op) {
  return op == IoOp::read ? "read" : "write";
}

std::string advice(int err, const IoOptions& options) {
  switch (err) {
    case ENOSPC:
      return options.enospc_advice;
    case EIO:
      return "the drive reported an I/O error: check `dmesg` and the drive's health";
    case EOPNOTSUPP:
      return "this filesystem does not support the request (iopoll needs O_DIRECT and aligned "
             "requests); drop --iopoll";
    default:
      return "check the drive and the filesystem holding that file";
  }
}

}  // namespace

struct IoRing::File {
  std::string path;
  int direct_fd = -1;
  int buffered_fd = -1;
};

struct IoRing::Part {
  unsigned pending = 0;
  bool buffered = false;
  uint64_t offset = 0;
  char* buf = nullptr;
  uint64_t len = 0;
  uint64_t done = 0;
};

struct IoRing::Pending {
  IoRequest req;
  uint64_t sequence = 0;
  unsigned parts_left = 0;
  bool failed = false;
  bool faulted = false;
};

IoRing::IoRing(IoOptions options) : options_(std::move(options)), ring_(new io_uring{}) {
  const unsigned qd = options_.queue_depth;
  if (qd < 1 || qd > 4096)
    fail("io queue depth {} is out of range; use 1 to 4096 (32 suits NVMe drives)", qd);
  io_uring_params params{};
  if (options_.sqpoll) {
    params.flags |= IORING_SETUP_SQPOLL;
    params.sq_thread_idle = 1000;
  }
  if (options_.iopoll) params.flags |= IORING_SETUP_IOPOLL;
  // A request may be split in two parts (aligned head, unaligned tail): 2 slots each.
  // Completions are delivered when this ring's thread next enters the kernel (it always does,
  // to submit or wait) instead of by interrupting it: no inter-processor interrupt for each
  // completion, which cost a third of the IOPS of 4 KiB random reads on 2 busy cores (Linux
  // 5.19+; older kernels refuse the flag and get the ring without it).
  io_uring_params coop = params;
  coop.flags |= IORING_SETUP_COOP_TASKRUN;
  int rc = io_uring_queue_init_params(2 * qd, ring_.get(), &coop);
  if (rc == -EINVAL) rc = io_uring_queue_init_params(2 * qd, ring_.get(), &params);
  if (rc < 0)
    fail(
        "io_uring_queue_init (queue depth {}{}{}) failed: {}; run `strata info` to see whether "
        "io_uring works here (a container may block it)",
        qd, options_.sqpoll ? ", sqpoll" : "", options_.iopoll ? ", iopoll" : "", errno_text(-rc));
  parts_.resize(2 * qd);
  pending_.resize(qd);
  free_parts_.reserve(2 * qd);
  free_pending_.reserve(qd);
  for (unsigned i = 2 * qd; i-- > 0;) free_parts_.push_back(i);
  for (unsigned i = qd; i-- > 0;) free_pending_.push_back(i);
  files_.reserve(kMaxFiles);
  if (options_.register_files) {
    const int r = io_uring_register_files_sparse(ring_.get(), 2 * kMaxFiles);
    if (r < 0)
      warn_once("nvme-fixed-files",
                "nvme: io_uring refused registered files ({}); using plain "
                "descriptors",
                errno_text(-r));
    else
      fixed_files_ = true;
  }
}

IoRing::~IoRing() {
  try {
    while (in_flight_ > 0) reap_one();
  } catch (...) {
    // Nothing can be reported from a destructor; the ring is torn down below regardless.
  }
  io_uring_queue_exit(ring_.get());
  for (const File& f : files_) {
    if (f.direct_fd >= 0) close(f.direct_fd);
    if (f.buffered_fd >= 0) close(f.buffered_fd);
  }
}

int IoRing::add_file(const std::string& path, bool create) {
  if (files_.size() >= kMaxFiles)
    fail("io ring: cannot open {}: already {} files on this ring; use another ring", path,
         kMaxFiles);
  const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0);
  File f{path};
  if (options_.direct) {
    const bool refuse =
        std::any_of(options_.faults.begin(), options_.faults.end(),
                    [](const Fault& x) { return x.kind == FaultKind::o_direct_refused; });
    f.direct_fd = refuse ? -1 : open(path.c_str(), flags | O_DIRECT, 0600);
    if (refuse) errno = EINVAL;
    if (f.direct_fd < 0 && errno != EINVAL)
      fail("cannot open {}: {}; check that the nvme_path exists and is writable", path,
           errno_text(errno));
    if (f.direct_fd < 0 && options_.warn_if_buffered) {
      const std::string dir = std::filesystem::path(path).parent_path().string();
      warn_once("nvme-o-direct:" + dir,
                "nvme: {} refuses O_DIRECT (tmpfs or a network filesystem?); using buffered I/O "
                "there, which is slower and fills the page cache",
                dir);
    }
  }
  if (options_.iopoll && f.direct_fd < 0)
    fail("cannot open {} for iopoll: it needs O_DIRECT, which {}; drop --iopoll", path,
         options_.direct ? "this filesystem refuses" : "is off");
  f.buffered_fd = open(path.c_str(), flags, 0600);
  if (f.buffered_fd < 0) {
    const int err = errno;
    if (f.direct_fd >= 0) close(f.direct_fd);
    fail("cannot open {}: {}; check that the nvme_path exists and is writable", path,
         errno_text(err));
  }
  const int index = static_cast<int>(files_.size());
  files_.push_back(f);
  if (fixed_files_) {
    int fds[2] = {f.direct_fd, f.buffered_fd};
    const int r = io_uring_register_files_update(ring_.get(), 2 * index, fds, 2);
    if (r < 0) fail("io_uring_register_files_update for {} failed: {}", path, errno_text(-r));
  }
  return index;
}

bool IoRing::is_direct(int file) const {
  return files_.at(file).direct_fd >= 0;
}
int IoRing::fd(int file) const {
  const File& f = files_.at(file);
  return f.direct_fd >= 0 ? f.direct_fd : f.buffered_fd;
}
const std::string& IoRing::path(int file) const {
  return files_.at(file).path;
}

void IoRing::register_buffer(void* base, uint64_t len) {
  if (in_flight_ > 0) fail("io ring: register_buffer with {} requests in flight", in_flight_);
  for (uint64_t off = 0; off < len; off += kMaxFixedBuffer)
    buffers_.push_back({static_cast<char*>(base) + off, std::min(kMaxFixedBuffer, len - off)});
  if (!options_.register_buffers) return;
  if (fixed_buffers_) io_uring_unregister_buffers(ring_.get());
  const int r = io_uring_register_buffers(ring_.get(), buffers_.data(),
                                          static_cast<unsigned>(buffers_.size()));
  fixed_buffers_ = r == 0;
  if (r < 0)
    warn_once("nvme-fixed-buffers",
              "nvme: io_uring refused to register {} of buffers ({}); "
              "using unregistered buffers (raise `ulimit -l` to allow it)",
              format_bytes(len), errno_text(-r));
}

void IoRing::submit(const IoRequest& r) {
  if (r.file < 0 || r.file >= static_cast<int>(files_.size()))
    fail("io ring: {} names file {}, but {} are open", op_name(r.op), r.file, files_.size());
  if (r.len > 0 && r.buf == nullptr)
    fail("io ring: {} of {} bytes into a null buffer", op_name(r.op), r.len);
  const uint64_t sequence =
      options_.request_counter ? options_.request_counter->fetch_add(1) : sequence_++;
  ++stats_.requests;
  if (r.len == 0) {
    if (on_complete_) on_complete_(r);
    return;
  }
  const File& f = files_[r.file];
  uint64_t head = 0;  // bytes through the O_DIRECT descriptor
  if (f.direct_fd >= 0 && aligned(r.buf) && aligned(r.offset))
    head = r.len / kDirectAlignment * kDirectAlignment;
  const unsigned needed = (head > 0) + (r.len > head);
  while (free_pending_.empty() || free_parts_.size() < needed) {
    reap_one();
    throw_if_failed();
  }
  const unsigned q = free_pending_.back();
  free_pending_.pop_back();
  pending_[q] = Pending{r, sequence, needed, false, false};
  char* buf = static_cast<char*>(r.buf);
  if (head > 0) push_part(q, false, r.offset, buf, head);
  if (r.len > head) push_part(q, true, r.offset + head, buf + head, r.len - head);
  throw_if_failed();
}

void IoRing::wait_all() {
  while (in_flight_ > 0) reap_one();
  throw_if_failed();
}

void IoRing::wait_one() {
  if (in_flight_ > 0) reap_one();
  throw_if_failed();
}

void IoRing::push_part(unsigned pending, bool buffered, uint64_t offset, char* buf, uint64_t len) {
  const unsigned slot = free_parts_.back();
  free_parts_.pop_back();
  parts_[slot] = Part{pending, buffered, offset, buf, len, 0};
  if (buffered && files_[pending_[pending].req.file].direct_fd >= 0) ++stats_.buffered_parts;
  queue_part(slot);
}

void IoRing::queue_part(unsigned slot) {
  Part& p = parts_[slot];
  const IoRequest& r = pending_[p.pending].req;
  const File& f = files_[r.file];
  const bool buffered = p.buffered || f.direct_fd < 0;
  int fd = buffered ? f.buffered_fd : f.direct_fd;
  if (fixed_files_) fd = 2 * r.file + (buffered ? 1 : 0);
  char* buf = p.buf + p.done;
  const uint64_t off = p.offset + p.done;
  const auto len = static_cast<unsigned>(std::min(p.len - p.done, kMaxPartIo));
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) {  // cannot happen: the queue holds queue_depth entries
    io_uring_submit(ring_.get());
    sqe = io_uring_get_sqe(ring_.get());
  }
  int fixed = -1;
  if (fixed_buffers_)
    for (size_t i = 0; i < buffers_.size(); ++i) {
      char* base = static_cast<char*>(buffers_[i].iov_base);
      if (buf >= base && buf + len <= base + buffers_[i].iov_len) fixed = static_cast<int>(i);
    }
  if (fixed >= 0) {
    ++stats_.fixed_buffers;
    if (r.op == IoOp::read)
      io_uring_prep_read_fixed(sqe, fd, buf, len, off, fixed);
    else
      io_uring_prep_write_fixed(sqe, fd, buf, len, off, fixed);
  } else if (r.op == IoOp::read) {
    io_uring_prep_read(sqe, fd, buf, len, off);
  } else {
    io_uring_prep_write(sqe, fd, buf, len, off);
  }
  if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, slot);
  ++in_flight_;
  int rc;
  do rc = io_uring_submit(ring_.get());
  while (rc == -EINTR || rc == -EAGAIN);
  if (rc < 0)
    record_failure(std::make_exception_ptr(
        Error(fmt::format("io_uring_submit of a {} to {} failed: {}; {}", op_name(r.op), f.path,
                          errno_text(-rc), advice(-rc, options_)))));
}

void IoRing::reap_one() {
  if (in_flight_ == 0) fail("io ring: waiting for a completion with nothing in flight (a bug)");
  io_uring_cqe* cqe = nullptr;
  // Entries left in the queue by a refused io_uring_submit would otherwise never complete;
  // submitting them and waiting is one system call.
  if (io_uring_sq_ready(ring_.get()) > 0) io_uring_submit_and_wait(ring_.get(), 1);
  int rc;
  do rc = io_uring_wait_cqe(ring_.get(), &cqe);
  while (rc == -EINTR || rc == -EAGAIN);
  if (rc < 0) {
    // The ring itself is broken: nothing more will complete, so waiting would hang.
    in_flight_ = 0;
    record_failure(std::make_exception_ptr(Error(
        fmt::format("io_uring_wait_cqe failed: {}; the I/O ring is unusable", errno_text(-rc)))));
    return;
  }
  do {
    const auto slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(ring_.get(), cqe);
    --in_flight_;
    finish_part(slot, res);
  } while (io_uring_peek_cqe(ring_.get(), &cqe) == 0);
}

void IoRing::finish_part(unsigned slot, int res) {
  Part& p = parts_[slot];
  Pending& q = pending_[p.pending];
  const IoRequest& r = q.req;
  bool injected = false;
  for (const Fault& fault : options_.faults)
    if (fault.kind == FaultKind::slow && q.sequence >= fault.request)
      std::this_thread::sleep_for(std::chrono::milliseconds(kSlowFaultDelayMs));
  if (!q.faulted)
    for (const Fault& fault : options_.faults) {
      if (fault.kind == FaultKind::slow) continue;
      if (fault.request != q.sequence) continue;
      q.faulted = injected = true;
      if (fault.kind == FaultKind::eio) res = -EIO;
      if (fault.kind == FaultKind::enospc) res = -ENOSPC;
      if (fault.kind == FaultKind::short_io && res > 1)
        res =
            res >= 2 * static_cast<int>(kDirectAlignment)
                ? res / 2 / static_cast<int>(kDirectAlignment) * static_cast<int>(kDirectAlignment)
                : res / 2;
      if (fault.kind == FaultKind::eagain) {
        if (r.op == IoOp::read) std::memset(p.buf + p.done, 0, p.len - p.done);
        res = -EAGAIN;
      }
      if (fault.kind == FaultKind::corrupt && r.op == IoOp::read && res > 0) p.buf[p.done] ^= 0x5a;
    }
  const uint64_t at = p.offset + p.done;
  if ((res == -EAGAIN || res == -EINTR) && !failure_) {
    ++stats_.requeued;
    queue_part(slot);
    return;
  }
  if (res < 0 || (res == 0 && p.done < p.len)) {
    q.failed = true;
    std::string what = fmt::format("{} of {} at offset {} in {}", op_name(r.op),
                                   format_bytes(r.len), r.offset, files_[r.file].path);
    if (res < 0)
      what += fmt::format(" failed at offset {}: {}{}; {}", at, errno_text(-res),
                          injected ? " (injected fault)" : "", advice(-res, options_));
    else
      what += fmt::format(
          " hit the end of the file at offset {}; the file was truncated or "
          "replaced while in use (a swap file must not be touched during a run)",
          at);
    record_failure(std::make_exception_ptr(Error(what)));
  } else {
    p.done += static_cast<uint64_t>(res);
    if (p.done < p.len && !failure_) {
      ++stats_.resumed;
      const File& f = files_[r.file];
      if (!p.buffered && f.direct_fd >= 0 &&
          !(aligned(p.offset + p.done) && aligned(p.buf + p.done) && aligned(p.len - p.done))) {
        p.buffered = true;  // O_DIRECT cannot go on from an unaligned point
        ++stats_.buffered_parts;
      }
      queue_part(slot);
      return;
    }
    if (p.done < p.len) q.failed = true;  // abandoned: another request already failed
  }
  if (!q.failed) stats_.bytes += p.len;
  free_parts_.push_back(slot);
  if (--q.parts_left > 0) return;
  const unsigned pending = p.pending;
  if (!q.failed && on_complete_) {
    try {
      on_complete_(r);
    } catch (...) {
      record_failure(std::current_exception());
    }
  }
  free_pending_.push_back(pending);
}

void IoRing::record_failure(std::exception_ptr e) {
  if (!failure_) failure_ = std::move(e);
}

void IoRing::throw_if_failed() {
  if (!failure_) return;
  while (in_flight_ > 0) reap_one();  // never leave the kernel writing into unwound buffers
  std::exception_ptr e = std::move(failure_);
  failure_ = nullptr;
  std::rethrow_exception(e);
}

std::vector<Fault> faults_from_env() {
  const char* env = std::getenv("STRATA_NVME_FAULTS");
  std::vector<Fault> faults;
  if (env == nullptr || *env == 0) return faults;
  std::string_view rest = env;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const size_t at = item.find('@');
    const std::string_view kind = item.substr(0, at);
    uint64_t request = 0;
    const char* end = item.data() + item.size();
    const bool number = at != std::string_view::npos && at + 1 < item.size() &&
                        std::from_chars(item.data() + at + 1, end, request).ptr == end;
    std::optional<FaultKind> k;
    if (kind == "eio") k = FaultKind::eio;
    if (kind == "enospc") k = FaultKind::enospc;
    if (kind == "short") k = FaultKind::short_io;
    if (kind == "eagain") k = FaultKind::eagain;
    if (kind == "corrupt") k = FaultKind::corrupt;
    if (kind == "slow") k = FaultKind::slow;
    if (!k || !number)
      fail(
          "STRATA_NVME_FAULTS: '{}' is not KIND@REQUEST (KIND eio, enospc, short, eagain, corrupt "
          "or slow; REQUEST a count); unset the variable outside fault tests",
          item);
    faults.push_back({*k, request});
  }
  return faults;
}

}  // namespace strata::nvme
