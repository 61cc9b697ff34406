// checkpoint_dir.cpp: see checkpoint_dir.h. Only the directory names and the marker are read;
// the checkpoint's contents are checked by whoever loads it.
#include "train/checkpoint_dir.h"

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <vector>

namespace strata {

namespace fs = std::filesystem;

std::string checkpoint_dir_name(int64_t step) {
  if (step < 0) fail("checkpoint step {} is negative; steps count from 0", step);
  return fmt::format("step-{}", step);
}

std::optional<int64_t> checkpoint_step(std::string_view dir_name) {
  constexpr std::string_view prefix = "step-";
  if (!dir_name.starts_with(prefix)) return std::nullopt;
  const std::string_view digits = dir_name.substr(prefix.size());
  if (digits.empty() ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  int64_t step = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

bool is_run_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir / kCheckpointsFolder, ec);
}

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(run_dir / kCheckpointsFolder, ec)) {
    const std::optional<int64_t> step = checkpoint_step(e.path().filename().string());
    if (step && e.is_directory(ec) && fs::is_regular_file(e.path() / kCheckpointCompleteMarker, ec))
      out.emplace_back(*step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

fs::path newest_checkpoint(const fs::path& run_dir) {
  const fs::path folder = run_dir / kCheckpointsFolder;
  std::error_code ec;
  if (!fs::is_directory(folder, ec))
    fail(
        "run directory {}: no {}/ folder in it; pass a run directory of `strata train` or a "
        "checkpoint directory (config.json + safetensors)",
        run_dir.string(), kCheckpointsFolder);
  fs::directory_iterator it(folder, ec);
  if (ec)
    fail("run directory {}: cannot list {}: {}; check its permissions", run_dir.string(),
         folder.string(), ec.message());
  const auto complete = complete_checkpoints(run_dir);
  if (!complete.empty()) return complete.back().second;
  // None complete: name what is there, for the error.
  std::vector<std::string> incomplete;
  for (const fs::directory_entry& entry : it) {
    const std::string name = entry.path().filename().string();
    if (checkpoint_step(name) && entry.is_directory(ec)) incomplete.push_back(name);
  }
  std::sort(incomplete.begin(), incomplete.end());
  if (incomplete.empty())
    fail(
        "run directory {}: no checkpoint in {} (no step-<N> directory); the run saved none "
        "yet (see --save-every)",
        run_dir.string(), folder.string());
  fail(
      "run directory {}: no complete checkpoint in {}: {} lack the {} marker (they were "
      "being written when the run stopped); train until a checkpoint is saved, or pass a "
      "checkpoint directory itself",
      run_dir.string(), folder.string(), fmt::join(incomplete, ", "), kCheckpointCompleteMarker);
}

}  // namespace strata
