# device-env.sh: sourced on a lent GPU machine (no package registry). Unpacks the carried
# .deps/ (see scripts/device-deps.sh) into /opt/deps once and exports what CMake and the built
# programs need to find them, the CUDA toolkit and NCCL.
STRATA_DEPS=/opt/deps
if [ ! -f "$STRATA_DEPS/.unpacked" ]; then
  mkdir -p "$STRATA_DEPS"
  for f in .deps/*.deb; do dpkg -x "$f" "$STRATA_DEPS"; done
  # .pc files carry an absolute prefix; point them at the unpacked tree. OpenBLAS's live in
  # its own directory, which Debian's alternatives (not run by dpkg -x) would link.
  sed -i "s|^prefix=/usr|prefix=$STRATA_DEPS/usr|; s|=/usr/|=$STRATA_DEPS/usr/|" \
    "$STRATA_DEPS"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc \
    "$STRATA_DEPS"/usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig/*.pc
  touch "$STRATA_DEPS/.unpacked"
fi
lib="$STRATA_DEPS/usr/lib/x86_64-linux-gnu"
export PKG_CONFIG_PATH="$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$STRATA_DEPS/usr/share/pkgconfig"
export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread:${LD_LIBRARY_PATH:-}"
# Multiarch headers (hwloc's autogen/config.h): the compiler searches /usr/include/<triplet>
# by default, not the unpacked tree's.
export CPATH="$STRATA_DEPS/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}"
command -v pkg-config >/dev/null || export PKG_CONFIG="$STRATA_DEPS/usr/bin/pkgconf"
export PATH="/usr/local/cuda/bin:$PATH"
# NCCL may come with the toolkit or only with the Python wheels of the image.
if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -z "${NCCL_HOME:-}" ]; then
  # An include/nccl.h beside a lib/ holding libnccl.so*: PyTorch's wheel ships a header of the
  # same name (torch/csrc/cuda/nccl.h) that is not NCCL's.
  NCCL_HOME=
  while IFS= read -r h; do
    d=$(dirname "$(dirname "$h")")
    if compgen -G "$d/lib/libnccl.so*" >/dev/null; then NCCL_HOME=$d; break; fi
  done < <(find / -xdev -path '*/include/nccl.h' 2>/dev/null)
  export NCCL_HOME
  export LD_LIBRARY_PATH="$NCCL_HOME/lib:$LD_LIBRARY_PATH"
fi
