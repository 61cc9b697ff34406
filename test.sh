#!/usr/bin/env bash
# test.sh: every check CI runs. Installs what is missing, then:
#   1. clang-format: every C++/CUDA source must be formatted;
#   2. Release build with warnings as errors (CUDA compiled where a toolkit exists) and, sharing
#      its objects, the CUDA backend on the CPU emulator (tests/cuda_emu); the full ctest: gpu
#      tests skip with a message when there is no GPU, and run again on 3 emulated GPUs (label
#      emu: every CUDA kernel against the host's, NCCL, the executor on CUDA);
#   3. ASan+UBSan build (clang), unit tests;
#   4. TSan build (clang), the concurrent tests (label tsan).
cd "$(dirname "$0")"
source scripts/common.sh
install_packages "${STRATA_PACKAGES[@]}" "${STRATA_CLANG_PACKAGES[@]}" clang-format

echo "== clang-format"
mapfile -t sources < <(git ls-files --cached --others --exclude-standard -- \
  '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh' 2>/dev/null || find src tools tests bench -name '*.[ch]*' -o -name '*.cu')
if [ ${#sources[@]} -gt 0 ]; then
  clang-format --dry-run -Werror "${sources[@]}"
fi

ctest_args=(--output-on-failure -j"$JOBS" --timeout 600)
# The sanitizer builds are the slowest to compile (ASan+UBSan about 12 minutes on 2 cores with
# GCC at -O2 -g): -O1, as the sanitizers' documentation suggests, and line tables only (-g1),
# enough for symbolised reports, take about two thirds of that, and clang (whose sanitizers
# these are, and a second compiler's warnings) about a fifth less again.
sanitizer_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)

echo "== release build, the CUDA backend also on the emulator, full test suite"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON -DSTRATA_CUDA_EMU=ON
cmake --build build -j"$JOBS"
(cd build && ctest "${ctest_args[@]}")

echo "== address + undefined-behaviour sanitizers, unit tests"
cmake -S . -B build-asan -G Ninja "${sanitizer_flags[@]}" -DSTRATA_WERROR=ON \
  -DSTRATA_CUDA=OFF -DSTRATA_SANITIZE=address,undefined
cmake --build build-asan -j"$JOBS" --target tests_unit  # only what -L unit runs
(cd build-asan && ctest "${ctest_args[@]}" -L unit)

echo "== thread sanitizer, concurrent tests"
cmake -S . -B build-tsan -G Ninja "${sanitizer_flags[@]}" -DSTRATA_WERROR=ON \
  -DSTRATA_CUDA=OFF -DSTRATA_SANITIZE=thread
cmake --build build-tsan -j"$JOBS" --target tests_tsan  # only what -L tsan runs
# TSan needs a narrower address-space randomisation than recent kernels use by default.
(cd build-tsan && setarch "$(uname -m)" -R ctest "${ctest_args[@]}" -L tsan)

echo "== all checks passed"
