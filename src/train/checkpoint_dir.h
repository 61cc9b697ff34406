// checkpoint_dir.h: where a run directory's checkpoints are, and which one is the newest
// complete one (what `strata generate`, `strata export` and `--resume` start from).
//
// A run directory holds checkpoints/step-<N>/, one per saved step, each a Hugging Face model
// directory plus the trainer's state. A checkpoint counts only once the file named COMPLETE is
// in it: the trainer writes that marker last, so a directory without it was still being written
// when the run stopped and must never be read. Names other than step-<digits> (temporary
// directories, files) are ignored.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata {

// The marker file written last into a finished checkpoint directory.
inline constexpr std::string_view kCheckpointCompleteMarker = "COMPLETE";
// The folder of a run directory that holds the step-<N> checkpoints.
inline constexpr std::string_view kCheckpointsFolder = "checkpoints";

// "step-<N>", the name of step N's checkpoint directory.
std::string checkpoint_dir_name(int64_t step);
// N for a name "step-<N>" (decimal digits only, no sign); nullopt for any other name.
std::optional<int64_t> checkpoint_step(std::string_view dir_name);

// Whether `dir` holds a checkpoints/ folder, i.e. names a run directory.
bool is_run_dir(const std::filesystem::path& dir);

// The complete checkpoints of a run directory, (step, directory), oldest first; none when it
// has no checkpoints/ folder.
std::vector<std::pair<int64_t, std::filesystem::path>> complete_checkpoints(
    const std::filesystem::path& run_dir);

// run_dir/checkpoints/step-<N> with the largest N whose directory holds the COMPLETE marker.
// An Error names the run directory when it has no checkpoints/ folder or no complete
// checkpoint (listing the incomplete ones found).
std::filesystem::path newest_checkpoint(const std::filesystem::path& run_dir);

}  // namespace strata
