# device-env.sh: sourced on a lent GPU machine (no package registry). Unpacks the carried
# .deps/ (see scripts/device-deps.sh) into /opt/deps once and exports what CMake and the built
# programs need to find them, the CUDA toolkit and NCCL.
STRATA_DEPS=/opt/deps
if [ ! -f "$STRATA_DEPS/.unpacked" ]; then
  mkdir -p "$STRATA_DEPS"
  for f in .deps/*.deb; do dpkg -x "$f" "$STRATA_DEPS"; done
  # .pc files carry an absolute prefix; point them at the unpacked tree.
  sed -i "s|^prefix=/usr|prefix=$STRATA_DEPS/usr|; s|=/usr/|=$STRATA_DEPS/usr/|" \
    "$STRATA_DEPS"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  touch "$STRATA_DEPS/.unpacked"
fi
export PKG_CONFIG_PATH="$STRATA_DEPS/usr/lib/x86_64-linux-gnu/pkgconfig:$STRATA_DEPS/usr/share/pkgconfig"
export LD_LIBRARY_PATH="$STRATA_DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
command -v pkg-config >/dev/null || export PKG_CONFIG="$STRATA_DEPS/usr/bin/pkgconf"
export PATH="/usr/local/cuda/bin:$PATH"
# NCCL may come with the toolkit or only with the Python wheels of the image.
if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -z "${NCCL_HOME:-}" ]; then
  NCCL_HOME=$(find / -xdev -name nccl.h -path '*nccl*' 2>/dev/null | head -1 | xargs -r dirname | xargs -r dirname)
  export NCCL_HOME
  export LD_LIBRARY_PATH="$NCCL_HOME/lib:$LD_LIBRARY_PATH"
fi
