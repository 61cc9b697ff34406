#!/usr/bin/env bash
# test.sh: every check CI runs. Installs what is missing, then:
#   1. clang-format: every C++/CUDA source must be formatted;
#   2. Release build with warnings as errors (CUDA compiled where a toolkit exists: for sm_80
#      alone where no GPU is present, see below) and, sharing its objects, the CUDA backend on
#      the CPU emulator (tests/cuda_emu); the full ctest: gpu
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

# Without a GPU the CUDA backend is compiled to prove that it builds, and its tests run on the
# emulator: one architecture does that, sm_80 (the oldest strata supports; its PTX, embedded
# too, runs on any later GPU), which halves nvcc's time against the default two (sm_80 and
# sm_90; attention_mma.cu alone takes 80 s for both on CI's 2 cores). With a GPU the default
# holds, so the gpu tests run the code a user's build runs.
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  cuda_arch=(-UCMAKE_CUDA_ARCHITECTURES)
else
  cuda_arch=(-DCMAKE_CUDA_ARCHITECTURES=80)
fi

echo "== release build, the CUDA backend also on the emulator, full test suite"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON -DSTRATA_CUDA_EMU=ON \
  "${cuda_arch[@]}"
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
