#!/usr/bin/env bash
# device-deps.sh: downloads (here, where Debian's registry is reachable) the .deb files a
# GPU machine without a registry needs to build strata, into .deps/ (git-ignored). The
# device tool carries .deps/ over; scripts/device-build.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
apt-get download liburing-dev liburing2 libxxhash-dev libxxhash0 libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 \
  libxsimd-dev libhwloc-dev libhwloc15 libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev \
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libltdl7 libnuma1 \
  pkgconf libpkgconf3 pkgconf-bin libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev libgfortran5 \
  libsentencepiece-dev libsentencepiece0
