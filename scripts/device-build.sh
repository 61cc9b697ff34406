#!/usr/bin/env bash
# device-build.sh: on a lent GPU machine, build strata with CUDA for the local GPU (the
# dependencies come from the carried .deps/, see scripts/device-env.sh), then run ctest with
# the given arguments (none: the whole suite). Logs go to $OUT when it is set.
# Warnings do not fail the build here: the image's compiler is not Debian 12's, and a lost
# build costs device time; CI builds with -Werror.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
echo "NCCL_HOME=${NCCL_HOME:-toolkit}"
out=${OUT:-/tmp}
arch=${STRATA_DEVICE_ARCH:-90}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvcc --version | tail -1; cmake --version | head -1; c++ --version | head -1; nproc; free -g
} 2>&1 | tee "$out/device.txt"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON -DSTRATA_CUDA_EMU=OFF -DSTRATA_WERROR=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_PREFIX_PATH="$STRATA_DEPS/usr" \
  -DPKG_CONFIG_EXECUTABLE="${PKG_CONFIG:-$(command -v pkg-config)}" >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
start=$SECONDS
cmake --build build -j"$(nproc)" >>"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - start)) s; warnings: $(grep -c 'warning:' "$out/build.log")"
[ "${1:-}" = "--no-test" ] && exit 0
(cd build && ctest --output-on-failure --timeout 300 "$@") 2>&1 | tee "$out/ctest.log"
