// swap_store.h: where state that fits neither GPU memory nor RAM lives: named shards on the
// nvme_paths, striped RAID-0 style, with a checksum per block (DESIGN §5).
//
// The store's address space is cut into stripe units dealt round-robin over the paths (unit u
// lives in path u % k at offset (u / k) * stripe), so k drives give k drives' bandwidth. Each
// shard starts on a stripe boundary; each stripe unit of a shard is one checksum block
// (XXH3-64 of the shard's bytes in it), kept in memory and checked on every read: a mismatch
// is an Error naming the file, offset, expected and actual value, and read() never returns
// the data as good. One swap file per path is preallocated with fallocate after checking free
// space; the directory is flock'ed so two runs cannot share it; the files (and the lock file)
// are removed by the destructor. The swap files live as long as the run: a checkpoint must
// copy out of them.
//
// Threads: the store has one io_uring ring per channel, and read()/write() name the channel
// they run on; each channel is driven by one thread at a time, so `channels` threads (the
// executor's nvme.read and nvme.write lanes) move data at once, each on its own ring. Two
// transfers of one shard at once are refused with an Error (the caller must order them).
#pragma once

#include "core/pinned_pool.h"
#include "nvme/io_ring.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::nvme {

struct SwapStoreOptions {
  std::vector<std::string> paths;  // nvme_path directories, one per drive; must exist
  uint64_t capacity = 0;           // bytes of shards to hold (each shard rounds up to stripes)
  uint64_t stripe = 1ull << 20;    // stripe unit and checksum block; a multiple of 4 KiB
  IoOptions io;
  unsigned channels = 1;  // rings, one per thread that transfers at once; 1..64
  // Bounce buffers for callers whose buffers are not 4 KiB aligned come from here (one
  // stripe per queue slot, only for the length of a call); nullptr: the store owns a pool.
  PinnedPool* staging = nullptr;
};

// Where a stripe unit of a shard lies.
struct Extent {
  std::string file;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class SwapStore {
 public:
  static constexpr const char* kSwapFile = "strata-swap.bin";
  static constexpr const char* kLockFile = "strata-swap.lock";
  // The largest stripe: beyond a few MiB a drive gains nothing, and the figures derived from it
  // (a queue's worth of bounce buffers, stripes x stripe) must stay far from overflowing.
  static constexpr uint64_t kMaxStripe = uint64_t{256} << 20;

  // Throws Error when a path is missing, listed twice or locked by another run, when the
  // space is not there (naming the path, bytes needed and bytes free), or when fallocate fails.
  explicit SwapStore(SwapStoreOptions options);
  ~SwapStore();  // removes the swap and lock files
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Reserves room for shard `name`; throws Error when the name is taken or the store is full.
  void add_shard(const std::string& name, uint64_t bytes);
  // Writes the whole shard from `src` (shard_bytes(name) bytes), checksumming each block,
  // through channel `channel`'s ring.
  void write(const std::string& name, const void* src, unsigned channel = 0);
  // Reads the whole shard into `dst`, verifying each block. Throws Error on an I/O error, a
  // lost file or a checksum mismatch; then `dst` holds no block that failed verification
  // (such blocks are zeroed) and must not be used.
  void read(const std::string& name, void* dst, unsigned channel = 0);

  uint64_t shard_bytes(const std::string& name) const;
  std::vector<Extent> extents(const std::string& name) const;
  const std::vector<std::string>& files() const { return files_; }
  uint64_t file_bytes() const { return file_bytes_; }  // preallocated per path
  unsigned channels() const { return static_cast<unsigned>(rings_.size()); }
  // Summed over the channels' rings; call while no transfer runs.
  IoStats io_stats() const;
  // Bytes of the store's own bounce-buffer pool (made on the first call whose buffer is not 4
  // KiB aligned and no `staging` pool was given); 0 while every caller's buffers were aligned.
  uint64_t own_staging_bytes() const;

 private:
  struct Shard {
    uint64_t start = 0;  // first stripe unit
    uint64_t bytes = 0;
    bool written = false;
    bool busy = false;                // a transfer of it is running
    std::vector<uint64_t> checksums;  // one per stripe unit; its transfer's alone while busy
  };
  const Shard& shard(const std::string& name) const;  // call under mu_
  // Stripe unit `unit`'s offset in its swap file, and in *file the ring's index of that file.
  uint64_t place(uint64_t unit, int* file) const;
  Extent locate(uint64_t unit, uint64_t bytes) const;  // the same, with the file's path
  void check_files() const;
  void transfer(const std::string& name, IoOp op, char* data, unsigned channel);
  PinnedPool& staging_pool(unsigned channel);
  void remove_files() noexcept;

  SwapStoreOptions options_;
  std::vector<std::string> files_;
  std::vector<std::string> locks_;
  std::vector<int> lock_fds_;
  std::vector<int> ring_files_;
  uint64_t file_bytes_ = 0;
  uint64_t units_total_ = 0;
  uint64_t units_used_ = 0;
  // mu_ guards shards_ (the map and each shard's flags) and own_staging_.
  mutable std::mutex mu_;
  std::map<std::string, Shard> shards_;
  std::unique_ptr<PinnedPool> own_staging_;
  std::vector<std::unique_ptr<IoRing>> rings_;  // one per channel
  std::vector<char> staging_registered_;        // per ring: own_staging_ registered with it
};

}  // namespace strata::nvme
