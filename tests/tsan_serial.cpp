// tsan_serial.cpp: linked into every test of a -fsanitize=thread build.
//
// Debian's libtbb is not instrumented, so TSan cannot see how its worker threads hand results
// back to the thread that waits for them: every parallel_for body that reads its caller's
// stack is reported as a race, hundreds per executor step, and the real ones would drown. With
// one thread, a parallel loop runs on the thread that called it, and what TSan reports is left
// to strata's own threads (executor lanes, host streams, io_uring rings, communicator ranks),
// which is what the tsan label checks. The chunked ops give the same bits for any thread
// count, and the ordinary build's tests prove that across thread counts. (OpenBLAS, equally
// uninstrumented, always runs on its caller's thread: host::matmul turns its pool off.)
#include <oneapi/tbb/global_control.h>

namespace {

const tbb::global_control serial_tbb{tbb::global_control::max_allowed_parallelism, 1};

}  // namespace
