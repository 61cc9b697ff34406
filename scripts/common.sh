# common.sh: shared by run.sh and test.sh. Installs the Debian packages strata needs
# (only the missing ones) and finds the CUDA toolkit if one is installed.
set -euo pipefail

STRATA_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libxxhash-dev libtbb-dev libxsimd-dev libhwloc-dev libfmt-dev
  nlohmann-json3-dev libcli11-dev libopenblas-dev libsentencepiece-dev libpcre2-dev
  libicu-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3
  python3-numpy python3-torch  # the CPU Adam parity test and bench/adam_vs_torch.py
  python3-regex  # the tokenizer.json reference (tests/reference/bpe_reference.py)
  python3-jinja2  # the chat template reference (tests/reference/chat_template_reference.py)
  python3-crc32c  # the TensorBoard event file reader (tests/reference/tfevents_reader.py)
)

# test.sh's sanitizer builds and fuzz/run.sh: Debian's clang with the sanitizer runtimes and
# libFuzzer (libclang-rt-14-dev), llvm-symbolizer for readable reports.
STRATA_CLANG_PACKAGES=(clang libclang-rt-14-dev llvm-14)
STRATA_FUZZ_PACKAGES=("${STRATA_CLANG_PACKAGES[@]}")

# install_packages PKG...: apt-get installs whichever of PKG are not installed yet.
install_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "strata: installing Debian packages: ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "strata: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The CUDA toolkit is not a Debian package here: use it where it is installed.
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  if [ -x "$d/nvcc" ] && ! command -v nvcc >/dev/null; then export PATH="$d:$PATH"; fi
done

JOBS=${JOBS:-$(nproc)}
