#!/usr/bin/env bash
# device-build.sh: on a lent GPU machine (no package registry), unpack the carried .deps/
# into /opt/deps, build strata with CUDA for the local GPU, and run the test suite.
# Usage: scripts/device-build.sh [ctest args...]; logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
deps=/opt/deps
mkdir -p "$deps"
for f in .deps/*.deb; do dpkg -x "$f" "$deps"; done
# .pc files carry an absolute prefix; point them at the unpacked tree.
sed -i "s|^prefix=/usr|prefix=$deps/usr|; s|=/usr/|=$deps/usr/|" "$deps"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig"
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
command -v pkg-config >/dev/null || export PKG_CONFIG="$deps/usr/bin/pkgconf"
export PATH="/usr/local/cuda/bin:$PATH"
# NCCL may come with the toolkit or only with the Python wheels of the image.
if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -z "${NCCL_HOME:-}" ]; then
  NCCL_HOME=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null ||
    find / -name nccl.h -path '*nccl*' 2>/dev/null | head -1 | xargs -r dirname | xargs -r dirname)
  export NCCL_HOME
  export LD_LIBRARY_PATH="$NCCL_HOME/lib:$LD_LIBRARY_PATH"
fi
echo "NCCL_HOME=${NCCL_HOME:-toolkit}"
out=${OUT:-/tmp}
arch=${STRATA_DEVICE_ARCH:-90}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvcc --version | tail -1; cmake --version | head -1; c++ --version | head -1
} 2>&1 | tee "$out/device.txt"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON -DSTRATA_WERROR=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_PREFIX_PATH="$deps/usr" \
  -DPKG_CONFIG_EXECUTABLE="${PKG_CONFIG:-$(command -v pkg-config)}" >"$out/configure.log" 2>&1 ||
  { tail -40 "$out/configure.log"; exit 1; }
cmake --build build -j"$(nproc)" >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
(cd build && ctest --output-on-failure --timeout 300 "$@") 2>&1 | tee "$out/ctest.log"
