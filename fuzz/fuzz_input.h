// fuzz_input.h: what the fuzz targets share.
//
// strata's readers take paths (they mmap or stream the file), so a target hands its input to
// them as an in-memory file: a memfd, opened by the reader through /proc/self/fd/N. The real
// open, fstat, mmap and read paths run, and nothing touches the disk.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace strata::fuzz {

class MemoryFile {
 public:
  MemoryFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("strata-fuzz-input", MFD_CLOEXEC);
    if (fd_ < 0) die("memfd_create");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) die("write");
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  ~MemoryFile() { ::close(fd_); }

  const std::string& path() const { return path_; }

 private:
  // The harness, not the code under test, failed: stop rather than report a false finding.
  [[noreturn]] static void die(const char* what) {
    std::fprintf(stderr, "strata fuzz harness: %s of the in-memory input failed: %s\n", what,
                 std::strerror(errno));
    std::abort();
  }

  int fd_ = -1;
  std::string path_;
};

}  // namespace strata::fuzz
