// checkpoint.cpp: writing and reading checkpoints (see checkpoint.h).
#include "train/checkpoint.h"

#include "core/error.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "schedule/executor.h"
#include "train/checkpoint_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace strata {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainerState = "trainer_state.json";
constexpr const char* kOptimizer = "optimizer.safetensors";

void write_text(const fs::path& path, const std::string& text) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f)
      fail("checkpoint: cannot write {}: {}; check the run directory's space and permissions",
           path.string(), std::strerror(errno));
  }
  fsync_path(path);
}

}  // namespace

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("fsync {}: cannot open it: {}", path.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("fsync {}: {}; the data may not be on disk", path.string(), std::strerror(err));
}

fs::path save_checkpoint(const fs::path& run_dir, int64_t step, const Executor& executor,
                         const LlamaConfig& config, DType model_dtype,
                         const nlohmann::json& trainer_state, int keep) {
  const fs::path dir = run_dir / kCheckpointsFolder;
  const fs::path final_dir = dir / checkpoint_dir_name(step);
  const fs::path tmp = dir / fmt::format(".tmp-step-{}", step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    fail("checkpoint: cannot create {}: {}; check the run directory's permissions", dir.string(),
         ec.message());
  fs::remove_all(tmp, ec);  // a save interrupted earlier
  fs::create_directory(tmp, ec);
  if (ec) fail("checkpoint: cannot create {}: {}", tmp.string(), ec.message());

  const ModelLayout layout = ModelLayout::build(config);
  const int U = layout.num_units();
  // The model, as Hugging Face names and shapes it, in the run's dtype.
  {
    std::vector<std::vector<char>> data(static_cast<size_t>(U));
    std::vector<SafetensorsTensor> tensors;
    for (int u = 0; u < U; ++u) {
      const std::vector<float> p = executor.parameters(u);
      auto& raw = data[static_cast<size_t>(u)];
      raw.resize(p.size() * dtype_size(model_dtype));
      convert(raw.data(), model_dtype, p.data(), DType::f32, p.size());
      for (const ParamSlot& s : layout.units[static_cast<size_t>(u)].params)
        tensors.push_back(
            {s.name, model_dtype,
             std::vector<int64_t>(s.shape.dims.begin(), s.shape.dims.begin() + s.shape.rank),
             raw.data() + s.offset * dtype_size(model_dtype)});
    }
    write_safetensors(tmp / "model.safetensors", tensors, {{"format", "pt"}});
  }
  write_text(tmp / "config.json", to_hf_config_json(config).dump(2) + "\n");
  // The optimizer state, one unit at a time in memory.
  {
    std::vector<UnitOptimizerState> states;
    std::vector<SafetensorsTensor> tensors;
    states.reserve(static_cast<size_t>(U));
    for (int u = 0; u < U; ++u) {
      states.push_back(executor.optimizer_state(u));
      const UnitOptimizerState& st = states.back();
      const std::string& name = layout.units[static_cast<size_t>(u)].name;
      const auto n = static_cast<int64_t>(st.master.size());
      tensors.push_back({name + ".master", DType::f32, {n}, st.master.data()});
      tensors.push_back({name + ".exp_avg", DType::f32, {n}, st.m.data()});
      tensors.push_back({name + ".exp_avg_sq", DType::f32, {n}, st.v.data()});
    }
    write_safetensors(tmp / kOptimizer, tensors, {{"format", "strata-optimizer"}});
  }
  write_text(tmp / kTrainerState, trainer_state.dump(2) + "\n");
  fsync_path(tmp);

  fs::remove_all(final_dir, ec);  // an incomplete one from a run that died before COMPLETE
  fs::rename(tmp, final_dir, ec);
  if (ec)
    fail("checkpoint: cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  fsync_path(dir);
  write_text(final_dir / kCheckpointCompleteMarker, fmt::format("step {}\n", step));
  fsync_path(final_dir);

  if (keep > 0) {
    auto all = complete_checkpoints(run_dir);
    while (static_cast<int>(all.size()) > keep) {
      fs::remove_all(all.front().second, ec);
      all.erase(all.begin());
    }
  }
  return final_dir;
}

nlohmann::json read_trainer_state(const fs::path& checkpoint) {
  const fs::path path = checkpoint / kTrainerState;
  std::ifstream f(path);
  if (!f)
    fail("checkpoint {}: {} is missing; the checkpoint is incomplete, resume from another one",
         checkpoint.string(), kTrainerState);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    fail("checkpoint {}: {} is not a JSON object; the checkpoint is damaged", checkpoint.string(),
         kTrainerState);
  return j;
}

void restore_checkpoint(const fs::path& checkpoint, Executor& executor) {
  const SafetensorsReader reader = SafetensorsReader::open(checkpoint / kOptimizer);
  const ModelLayout layout = ModelLayout::build(executor.placement().shape.model);
  for (int u = 0; u < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[static_cast<size_t>(u)];
    UnitOptimizerState st;
    for (const auto& [suffix, v] : {std::pair{".master", &st.master}, std::pair{".exp_avg", &st.m},
                                    std::pair{".exp_avg_sq", &st.v}}) {
      const SafetensorsEntry* e = reader.find(unit.name + suffix);
      if (e == nullptr)
        fail("checkpoint {}: {} has no tensor {}; the checkpoint is damaged or of another model",
             checkpoint.string(), kOptimizer, unit.name + suffix);
      v->resize(static_cast<size_t>(e->numel()));
      const std::vector<int64_t> shape{e->numel()};
      reader.read_checked(unit.name + suffix, v->data(), DType::f32, shape);
    }
    executor.set_optimizer_state(u, st);
  }
}

}  // namespace strata
