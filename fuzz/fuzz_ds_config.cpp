// fuzz_ds_config.cpp: the DeepSpeed config reader on arbitrary bytes.
//
// The input is the config file's text. load_ds_config reads and checks it; when it accepts one,
// the batch sizes are resolved for 1 to 8 GPUs and the plan settings derived for the `tiny`
// preset, as `strata plan` and `strata train` do. A strata::Error is the config being refused;
// anything else is a finding.
#include "core/error.h"
#include "fuzz_input.h"
#include "model/config.h"
#include "train/ds_config.h"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const strata::LlamaConfig model = *strata::find_preset("tiny");
  const strata::fuzz::MemoryFile file(data, size);
  strata::DsConfig config;
  try {
    config = strata::load_ds_config(file.path());
  } catch (const strata::Error&) {
    return 0;  // refused: expected for most inputs
  }
  // The GPU count is not part of the file; take it from the input's length so that every
  // count is tried across the corpus.
  const int world = 1 + static_cast<int>(size % 8);
  try {
    (void)strata::resolve_ds_batch(config, world);
  } catch (const strata::Error&) {
  }
  try {
    (void)strata::ds_plan_settings(config, world, model);
  } catch (const strata::Error&) {
  }
  return 0;
}
