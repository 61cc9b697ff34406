#!/usr/bin/env bash
# run.sh: the main job. Installs what is missing, builds strata (Release, CUDA backend when
# a toolkit is present) and runs it. Until the trainer lands, the main job is `strata info`.
cd "$(dirname "$0")"
source scripts/common.sh
install_packages "${STRATA_PACKAGES[@]}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$JOBS"
build/bin/strata info "$@"
