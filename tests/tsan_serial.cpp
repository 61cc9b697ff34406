// tsan_serial.cpp: linked into every test of a -fsanitize=thread build.
//
// Debian's libtbb and libopenblas are not instrumented, so TSan cannot see how their worker
// threads hand results back to the thread that waits for them: every parallel_for body that
// reads its caller's stack is reported as a race, hundreds per executor step, and the real ones
// would drown. With one thread each, a parallel loop runs on the thread that called it, and what
// TSan reports is left to strata's own threads (executor lanes, host streams, io_uring rings,
// communicator ranks), which is what the tsan label checks. The chunked ops give the same bits
// for any thread count, and the ordinary build's tests prove that across thread counts.
#include <cblas.h>
#include <oneapi/tbb/global_control.h>

namespace {

struct SerialLibraries {
  tbb::global_control tbb_threads{tbb::global_control::max_allowed_parallelism, 1};
  SerialLibraries() { openblas_set_num_threads(1); }
};
const SerialLibraries serial_libraries;

}  // namespace
