#!/usr/bin/env bash
# device-rehearsal.sh: runs scripts/device-check.sh here, as root, in a bare Debian 12 chroot,
# so that a lent GPU machine's few minutes are not spent finding a missing package.
#
# The chroot (debootstrap, reused between runs) has only what the lent image is said to have:
# a compiler, CMake, ninja, python3. The CUDA toolkit is mounted read-only through an overlay
# (its own filesystem, so device-env.sh's `find -xdev` does not see its nccl.h) and linked
# into /usr/local/cuda without NCCL; NCCL is laid out as the image's pip wheel has it
# (site-packages/nvidia/nccl/{include,lib}, libnccl.so.2 only), next to a decoy nccl.h where
# PyTorch's wheel has one. With no GPU the gpu tests skip and the GPU benchmarks fail at once;
# the build, the dependency setup and the rest of the suite must pass. Logs: $ROOT/out.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${STRATA_REHEARSAL_ROOT:-/tmp/strata-rehearsal}
cuda=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
[ "$(id -u)" -eq 0 ] || { echo "device-rehearsal: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
[ -x "$cuda/bin/nvcc" ] || { echo "device-rehearsal: no CUDA toolkit at $cuda; set CUDA_HOME" >&2; exit 1; }
[ -d .deps ] || scripts/device-deps.sh
command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap

if [ ! -x "$root/usr/bin/cmake" ]; then
  debootstrap --variant=minbase --include=build-essential,cmake,ninja-build,python3,file \
    bookworm "$root" http://deb.debian.org/debian
fi
mkdir -p "$root/hostcuda" "$root/.empty" "$root/out"
unmount() { umount "$root/hostcuda" "$root/proc" "$root/dev" 2>/dev/null || true; }
trap unmount EXIT
mount -t overlay overlay -o "lowerdir=$cuda:$root/.empty" "$root/hostcuda"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"

chroot "$root" bash -euc "
  if [ ! -d /usr/local/cuda-rehearsal ]; then
    cp -as /hostcuda /usr/local/cuda-rehearsal
    find /usr/local/cuda-rehearsal -name '*nccl*' -prune -exec rm -rf {} +
    ln -sfn cuda-rehearsal /usr/local/cuda
  fi
  rm -rf /opt/deps /work/strata /out/*
  mkdir -p /work/strata"
# NCCL from wherever this machine has it (the toolkit's tree or Debian's libnccl-dev).
nccl_h=$(ls "$cuda"/include/nccl.h /usr/include/nccl.h 2>/dev/null | head -1 || true)
nccl_so=$(ls "$cuda"/lib*/libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so.2 2>/dev/null | head -1 || true)
[ -n "$nccl_h" ] && [ -n "$nccl_so" ] || { echo "device-rehearsal: NCCL not found here" >&2; exit 1; }
wheel=$root/opt/torch/.venv/lib/python3.12/site-packages
mkdir -p "$wheel/nvidia/nccl/include" "$wheel/nvidia/nccl/lib" "$wheel/torch/include/torch/csrc/cuda"
cp -r "$(dirname "$nccl_h")"/nccl* "$wheel/nvidia/nccl/include/"
cp -L "$nccl_so" "$wheel/nvidia/nccl/lib/"
echo '// not NCCL: where PyTorch keeps its own nccl.h' >"$wheel/torch/include/torch/csrc/cuda/nccl.h"
git ls-files -z | tar --null -T - -cf - | tar -C "$root/work/strata" -xf -
cp -r .deps "$root/work/strata/"
rc=0
chroot "$root" bash -c "cd /work/strata && OUT=/out STRATA_DEADLINE=${STRATA_DEADLINE:-1800} \
  bash scripts/device-check.sh" >"$root/out/check.log" 2>&1 || rc=$?
tail -3 "$root/out/check.log"
grep -h -E "tests passed|tests failed" "$root"/out/ctest-*.log || true
echo "device-rehearsal: device-check.sh exit $rc; logs in $root/out"
exit "$rc"
