// trainer.cpp: the training loop (see trainer.h).
#include "train/trainer.h"

#include "core/bytes.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/pinned_pool.h"
#include "core/system.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "partition/communicator.h"
#include "schedule/executor.h"
#include "schedule/schedule.h"
#include "train/checkpoint.h"
#include "train/checkpoint_dir.h"
#include "train/data_loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <unistd.h>

namespace strata {

namespace fs = std::filesystem;

namespace {

std::string duration(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t / 60 % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// The held-out sequences in order, micro_batch of them per rank and micro-batch of each
// forward-only pass, the last pass partly filled (its empty rank batches still take part in
// the gathers). The loss is summed over every target, so it does not depend on the split.
EvalResult evaluate(Executor& ex, EvalSequences& held_out, int64_t micro_batches, int ranks,
                    int64_t micro_batch) {
  held_out.rewind();
  const int64_t T = held_out.seq_len();
  EvalResult total;
  for (;;) {
    int64_t got = 0;
    std::vector<std::vector<HostBatch>> batches(static_cast<size_t>(micro_batches));
    for (auto& mb : batches)
      for (int r = 0; r < ranks; ++r) {
        HostBatch b;
        b.ids.resize(static_cast<size_t>(micro_batch * T));
        b.targets.resize(b.ids.size());
        if (held_out.data().packs_documents()) b.doc_start.resize(b.ids.size());
        b.batch = held_out.next(micro_batch, b.ids, b.targets, b.doc_start);
        b.ids.resize(static_cast<size_t>(b.batch * T));
        b.targets.resize(b.ids.size());
        if (!b.doc_start.empty()) b.doc_start.resize(b.ids.size());
        got += b.batch;
        mb.push_back(std::move(b));
      }
    if (got == 0) return total;
    const EvalResult e = ex.evaluate(batches);
    total.loss_sum += e.loss_sum;
    total.targets += e.targets;
    total.seconds += e.seconds;
  }
}

Placement place(const TrainSettings& s, const std::vector<Device*>& devices, TierBudgets& budgets) {
  LlamaConfig model = resolve_model(s.model);
  model.vocab_pieces = s.vocab_pieces;
  RunShape shape;
  shape.model = model;
  shape.ranks = static_cast<int>(devices.size());
  shape.param_dtype = s.dtype;
  shape.grad_dtype = s.grad_dtype;
  shape.optimizer = s.adam.type;
  shape.micro_batch = s.micro_batch;
  shape.seq_len = s.seq_len;
  shape.persistence_threshold = s.persistence_threshold;
  shape.working_buffers = working_buffers_for(s.prefetch_depth, model.tie_word_embeddings);
  shape.recompute = s.recompute;
  shape.offload_activations = s.offload_activations;
  shape.micro_batch_group = s.micro_batch_group;
  return place_locally(shape, s.offload, devices.front()->memory().capacity, s.cpu_memory,
                       s.pinned_memory, &budgets);
}

// Host RAM the run is planned to hold at its peak (the figure `strata train` prints as "host
// memory plan"): the placement's cpu tier (host-homed P, G, O and the pinned buffers), every
// device's gpu tier when the devices are host devices (their arenas are host RAM), and what
// writing a checkpoint or resuming holds at once, one unit at a time (below).
struct HostMemoryPlan {
  uint64_t cpu = 0, devices = 0, checkpoint = 0;
  uint64_t total() const { return cpu + devices + checkpoint; }
};

HostMemoryPlan plan_host_memory(const Placement& placement, const std::vector<Device*>& devices) {
  const TierBytes need = placement.needs();
  HostMemoryPlan h;
  // The cpu tier counts what checkpoints and resumes hold (Placement::checkpoint_bytes): said
  // apart here.
  h.checkpoint = need.at(Tier::cpu, StateKind::checkpoint);
  h.cpu = need.total(Tier::cpu) - h.checkpoint;
  for (const Device* d : devices)
    if (d->backend() == Backend::host) h.devices += need.total(Tier::gpu);
  return h;
}

}  // namespace

void check_update_during_backward(double max_grad_norm, DType dtype, const std::string& clip_from) {
  if (max_grad_norm > 0)
    fail(
        "--update-during-backward on with gradient clipping at {} ({}): clipping needs the whole "
        "step's gradient norm before any unit is updated; turn clipping off (--clip 0, "
        "gradient_clipping 0) or --update-during-backward off",
        max_grad_norm, clip_from);
  if (dtype == DType::f16)
    fail(
        "--update-during-backward on with fp16 (--dtype f16): loss scaling skips a step whose "
        "gradients overflow, which needs every gradient before any unit is updated; use --dtype "
        "bf16 or --update-during-backward off");
}

double train(const TrainSettings& s, const std::vector<Device*>& devices) {
  if (devices.empty()) fail("train: no devices; name them with --devices");
  if (s.steps < 1) fail("--steps {}: train at least one step", s.steps);
  if (s.data.empty()) fail("train: no training data; give --data FILE (strata tokenize makes one)");
  if (s.update_during_backward)
    check_update_during_backward(s.max_grad_norm, s.dtype, "--clip or gradient_clipping");
  const int R = static_cast<int>(devices.size());
  TierBudgets budgets;
  const Placement placement = place(s, devices, budgets);
  const LlamaConfig& model = placement.shape.model;
  ScheduleOptions so;
  so.micro_batches = static_cast<int>(s.grad_accum);
  so.prefetch_depth = s.prefetch_depth;
  so.update_during_backward = s.update_during_backward;
  so.reduce_per_group = s.reduce_per_group;
  const Schedule schedule = Schedule::build(placement, so);
  schedule.validate();

  DataLoader loader(s.data, s.seq_len, model.vocab_size, s.seed, s.data_width, s.loss_masks,
                    s.packing);
  std::optional<EvalSequences> held_out;
  if (!s.eval_data.empty())
    held_out.emplace(s.eval_data, s.seq_len, model.vocab_size, s.eval_sequences, s.data_width,
                     s.loss_masks, s.packing);

  // The checkpoint a resumed run continues from: chosen, verified, checked against this run and
  // its trainer state restored before anything is allocated or any log is opened. (All but the
  // optimizer file's tensors, which restore_checkpoint verifies as it reads them, so that a
  // resume reads them once.)
  LossScaler scaler(s.scaling);
  fs::path ckpt;
  int64_t step = 0, applied = 0;
  double verify_s = 0;
  KnownDamage damaged;  // checkpoints restore_checkpoint found damaged after they were chosen
  auto choose = [&] {
    const auto began = std::chrono::steady_clock::now();
    ckpt = s.resume_from.empty() ? resume_checkpoint(s.run_dir, s.resume_fallback, damaged)
                                 : resume_checkpoint_at(s.resume_from, s.resume_fallback, damaged);
    verify_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    std::error_code ec;
    const fs::path ckpt_run = ckpt.parent_path().parent_path();
    if (!s.resume_from.empty() && !fs::equivalent(ckpt_run, s.run_dir, ec)) {
      // Another run's checkpoint starts this run directory, which must hold no run of its own.
      const auto own = complete_checkpoints(s.run_dir);
      if (!own.empty() || fs::exists(s.run_dir / "metrics.jsonl", ec))
        fail(
            "--resume-from {}: --run-dir {} already holds a run ({}), and the checkpoint is not "
            "one of its own; continuing another run's checkpoint there would mix the two runs' "
            "checkpoints and logs: name a new --run-dir, or continue that run with --resume",
            ckpt.string(), s.run_dir.string(),
            own.empty()
                ? std::string("metrics.jsonl")
                : fmt::format("checkpoints up to {}", own.back().second.filename().string()));
    }
    const nlohmann::json resumed = read_trainer_state(ckpt);
    const std::string where = (ckpt / "trainer_state.json").string();
    try {
      if (resumed.at("model") != to_hf_config_json(model))
        fail(
            "resume from {}: the checkpoint is of another model ({}); pass the --model it was "
            "trained with",
            ckpt.string(), resumed.at("model").dump());
      step = resumed.at("step").get<int64_t>();
      if (step >= s.steps)
        fail("resume from {}: it is at step {} already and --steps is {}; ask for more steps",
             ckpt.string(), step, s.steps);
      applied = resumed.at("applied_updates").get<int64_t>();
      loader.restore(DataPosition::from_json(resumed.at("data"), where));
      scaler.restore(LossScaleState::from_json(resumed.at("loss_scale"), where));
    } catch (const nlohmann::json::exception& e) {
      fail("resume from {}: {} is damaged ({}); resume from an earlier checkpoint", ckpt.string(),
           where, e.what());
    }
  };
  if (s.resume) choose();

  // Its directories are made before anything is allocated: one that cannot be is refused first.
  Monitor monitor(s.monitor);
  const int64_t samples_per_step = R * s.grad_accum * s.micro_batch;  // the monitors' step unit

  auto comm = make_communicator(devices);
  ExecutorOptions eo;
  eo.cpu_adam_threads = s.cpu_adam_threads;
  eo.record = !s.trace.empty();
  if (budgets.pinned_limit != kUnlimited) eo.pinned_limit = budgets.pinned_limit;
  const uint64_t pools_before = PinnedPool::pools_created();
  Executor ex(placement, schedule, *comm, eo);

  std::error_code ec;
  fs::create_directories(s.run_dir, ec);
  if (ec)
    fail("--run-dir {}: cannot create it: {}; name a writable directory", s.run_dir.string(),
         ec.message());
  if (s.resume) {
    const auto began = std::chrono::steady_clock::now();
    for (;;) {
      try {
        restore_checkpoint(ckpt, ex);
        break;
      } catch (const CheckpointDamaged& e) {
        // The optimizer file's bytes are verified as they are read: one that fails makes
        // another checkpoint the choice, as if it had been found damaged first (an Error
        // without --resume-fallback), restored whole over what was restored of this one.
        damaged[e.checkpoint] = e.damage;
        choose();
      }
    }
    fmt::print("resumed from {} at step {} (verified in {:.1f} s, restored in {:.1f} s)\n",
               ckpt.string(), step, verify_s,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
    // Checkpoints past it are of the timeline it abandons: set aside, never overwritten.
    for (const fs::path& aside : set_aside_checkpoints_after(s.run_dir, step))
      fmt::print("set aside {}: of a later step than the checkpoint resumed from\n",
                 aside.string());
    // The steps after the checkpoint are trained again: what an interrupted run logged of them
    // goes, so each step is in the logs once.
    keep_lines(
        s.run_dir / "metrics.jsonl",
        [step](const std::string& line, size_t) {
          const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
          return !j.is_discarded() && j.is_object() && j.contains("step") &&
                 j["step"].is_number_integer() && j["step"].get<int64_t>() <= step;
        },
        "metrics");
    monitor.resume_at(step * samples_per_step);
  } else if (fs::is_directory(s.model) && !s.init_random) {
    ex.load(open_model_weights(s.model, model));
  } else {
    ex.init_random(s.seed);
  }
  // An image-text Gemma 3's vision tower, which checkpoints carry: from the model read, or from
  // the checkpoint resumed from (which carries it, unless the run began from --init random).
  std::optional<SafetensorsReader> image_text;
  if (model.image_text_checkpoint()) {
    const fs::path from = s.resume                                      ? ckpt / "model.safetensors"
                          : fs::is_directory(s.model) && !s.init_random ? fs::path(s.model)
                                                                        : fs::path();
    if (!from.empty()) image_text.emplace(SafetensorsReader::open(from));
  }

  const TierBytes need = placement.needs();
  fmt::print(
      "strata train: {} on {} device(s), {} micro-batch(es) of {} x {} tokens per step{}; state: "
      "gpu {} per device, cpu {}, nvme {}; run directory {}\n",
      model.name, R, s.grad_accum, s.micro_batch, s.seq_len,
      s.micro_batch_group > 1
          ? fmt::format(", in groups of {} run unit by unit{}", s.micro_batch_group,
                        s.reduce_per_group ? ", gradients reduced once per group" : "")
          : std::string(),
      format_bytes(need.total(Tier::gpu)), format_bytes(need.total(Tier::cpu)),
      format_bytes(need.total(Tier::nvme)), s.run_dir.string());
  if (s.offload_activations) {
    const int n = offloaded_checkpoints(placement.shape.model, checkpoint_slots(placement.shape));
    fmt::print(
        "activation checkpoints: {} block input(s) per micro-batch go to host RAM after their "
        "forward and come back before their backward ({} there); each device keeps a ring of {} "
        "(--offload-activations cpu)\n",
        n, format_bytes(need.at(Tier::cpu, StateKind::activations)),
        checkpoint_slots(placement.shape));
  }
  // Where the gradients of an offloaded optimizer accumulate (OffloadRequest::grads).
  if (const Placement::OffloadedGradients g = placement.offloaded_gradients(); g.units > 0)
    fmt::print(
        "gradients: {} of {} offloaded-optimizer unit(s) sum on the device(s) and go to the host "
        "once a step; {} go every micro-batch{} (--offload-gradients {})\n",
        g.on_gpu, g.units, g.units - g.on_gpu,
        g.on_nvme > 0
            ? fmt::format(", {} of them summed on NVMe (read back, added to, written)", g.on_nvme)
            : std::string(),
        grad_home_name(s.offload.grads));
  if (placement.offloaded_gradients().units == 0 && s.offload.grads != GradHome::automatic)
    fmt::print(
        "gradients: every unit's optimizer is on the device(s), and so are its gradients; "
        "--offload-gradients {} is for an optimizer offloaded to the CPU or NVMe and changes "
        "nothing here\n",
        grad_home_name(s.offload.grads));
  if (s.reduce_per_group && s.micro_batch_group <= 1)
    fmt::print(
        "gradients: each micro-batch is its own group (--micro-batch-group 1), so "
        "--reduce-per-group on changes nothing\n");
  if (s.update_during_backward) {
    int host_optimizer = 0;
    for (const UnitHomes& h : placement.homes) host_optimizer += h.optimizer != Tier::gpu;
    if (host_optimizer > 0)
      fmt::print(
          "optimizer: CPU Adam updates each of {} unit(s) as soon as its gradients are final, "
          "under the rest of the backward (--update-during-backward on)\n",
          host_optimizer);
    else
      fmt::print(
          "optimizer: every unit's optimizer is on the device(s), so --update-during-backward "
          "on changes nothing\n");
  }
  for (const TokenSequences* d : {&loader.data(), held_out ? &held_out->data() : nullptr})
    if (d && d->packing() != Packing::wrapped)
      fmt::print("{} data: {}\n", d == &loader.data() ? "training" : "held-out",
                 describe_documents(*d));
  for (const TokenSequences* d : {&loader.data(), held_out ? &held_out->data() : nullptr})
    if (d && d->masked_files() > 0)
      fmt::print(
          "{} data: loss masks beside {} of {} file(s); {} of {} targets count (--loss-mask "
          "off: all)\n",
          d == &loader.data() ? "training" : "held-out", d->masked_files(), d->files().size(),
          d->counted_targets(), d->size() * d->seq_len());
  const HostMemoryPlan host = plan_host_memory(placement, devices);
  const ExecutorMemory mem = ex.memory();
  fmt::print(
      "host memory plan: {} (cpu tier {}, host devices {}, checkpoint copy {}); pinned pool {} "
      "(placement {})\n",
      format_bytes(host.total()), format_bytes(host.cpu), format_bytes(host.devices),
      format_bytes(host.checkpoint), format_bytes(mem.pinned_capacity),
      format_bytes(placement.pinned_need()));
  if (need.total(Tier::nvme) > 0)
    fmt::print("nvme swap: {}; stripe {} (aio.block_size), queue depth {} (aio.queue_depth)\n",
               fmt::join(placement.request.nvme_paths, ", "),
               format_bytes(placement.request.nvme_stripe), placement.request.nvme_queue_depth);
  std::fflush(stdout);

  // Where the state is, for the progress line: each tier's bytes per device (gpu) or in all.
  const std::string tiers =
      fmt::format("gpu {} cpu {} nvme {}", format_bytes(need.total(Tier::gpu)),
                  format_bytes(need.total(Tier::cpu)), format_bytes(need.total(Tier::nvme)));
  std::ofstream metrics(s.run_dir / "metrics.jsonl", s.resume ? std::ios::app : std::ios::trunc);
  if (!metrics) fail("cannot write {}/metrics.jsonl", s.run_dir.string());
  if (monitor.enabled()) fmt::print("monitor: {}\n", monitor.describe());
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  const int64_t rows = s.micro_batch * s.seq_len;
  const double tokens_per_step = double(samples_per_step) * double(s.seq_len);
  const auto start = std::chrono::steady_clock::now();
  const int64_t first = step;
  double loss = NAN;
  // The progress line's loss: the mean since the last line printed, as Hugging Face's Trainer
  // logs the mean over its logging_steps (metrics.jsonl keeps every step's).
  double window_loss = 0;
  int64_t window_steps = 0;
  while (step < s.steps) {
    ++step;
    std::vector<std::vector<HostBatch>> batches(static_cast<size_t>(s.grad_accum));
    for (auto& mb : batches)
      for (int r = 0; r < R; ++r) {
        HostBatch b;
        b.batch = s.micro_batch;
        b.ids.resize(static_cast<size_t>(rows));
        b.targets.resize(static_cast<size_t>(rows));
        if (loader.data().packs_documents()) b.doc_start.resize(static_cast<size_t>(rows));
        loader.next(s.micro_batch, b.ids, b.targets, b.doc_start);
        mb.push_back(std::move(b));
      }
    StepParams p;
    p.step = applied + 1;
    p.adam = s.adam;
    p.decay_every_parameter = s.decay_every_parameter;
    const double lr = s.schedule.for_update(applied);  // logged as the schedule gives it
    p.adam.lr = static_cast<float>(lr);
    // OneCycle's momentum: Adam's betas as DeepSpeed's scheduler sets them for this update.
    const std::optional<std::pair<double, double>> betas = s.schedule.betas_for_update(applied);
    if (betas) {
      p.adam.beta1 = static_cast<float>(betas->first);
      p.adam.beta2 = static_cast<float>(betas->second);
    }
    p.loss_scale = static_cast<float>(scaler.scale());
    p.max_grad_norm = static_cast<float>(s.max_grad_norm);
    const StepResult r = ex.step(batches, p);
    scaler.update(r.skipped);
    std::optional<EvalResult> eval;
    if (held_out && ((s.eval_every > 0 && step % s.eval_every == 0) || step == s.steps))
      eval = evaluate(ex, *held_out, s.grad_accum, R, s.micro_batch);
    if (!r.skipped) ++applied;
    loss = r.loss;
    window_loss += r.loss;
    window_steps += 1;
    nlohmann::json lanes = nlohmann::json::object();
    for (size_t l = 0; l < schedule.lanes.size(); ++l)
      lanes[schedule.lanes[l].name()] = r.lane_busy_s[l];
    const double tps = r.step_s > 0 ? tokens_per_step / r.step_s : 0;
    // Passes over the training data so far, as Hugging Face's Trainer logs `epoch`.
    const DataPosition& at = loader.position();
    const double epoch =
        double(at.epoch) + double(at.position) / double(std::max<int64_t>(at.sequences, 1));
    nlohmann::json record{
        {"step", step},
        {"epoch", epoch},
        {"loss", r.loss},
        {"lr", lr},
        {"grad_norm", r.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.grad_norm)},
        {"loss_scale", p.loss_scale},
        {"skipped", r.skipped},
        {"tokens_per_s", tps},
        {"step_s", r.step_s},
        {"overlap", r.overlap},
        {"lane_busy_s", lanes},
        {"host_memory_plan", host.total()},
        {"pinned_bytes", ex.memory().pinned_capacity},
        {"pinned_allocations", ex.memory().pinned_allocations},
        {"pinned_pools", PinnedPool::pools_created() - pools_before}};
    if (betas) record["beta1"] = betas->first;  // OneCycle's, as its scheduler set it
    if (eval) {
      record["eval_loss"] = eval->loss();
      record["eval_targets"] = eval->targets;
      record["eval_s"] = eval->seconds;
    }
    metrics << record.dump() << "\n";
    metrics.flush();
    if (monitor.enabled()) {
      // DeepSpeed's tags, at the samples trained so far; the gradient norm (as Hugging Face's
      // Trainer logs it) and the held-out loss besides. DeepSpeed's engine writes lr and
      // loss_scale after the step has stepped its scheduler and scaler: the next update's rate
      // and scale.
      const int64_t samples = step * samples_per_step;
      std::vector<MonitorEvent> events{
          {"Train/Samples/train_loss", r.loss, samples},
          {"Train/Samples/lr", s.schedule.for_update(applied), samples}};
      if (s.dtype == DType::f16)
        events.push_back({"Train/Samples/loss_scale", scaler.scale(), samples});
      if (!r.skipped) events.push_back({"Train/Samples/grad_norm", r.grad_norm, samples});
      if (eval) events.push_back({"Eval/Samples/eval_loss", eval->loss(), samples});
      monitor.write(events);
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double eta = elapsed / double(step - first) * double(s.steps - step);
    const std::string line = fmt::format(
        "step {}/{} (epoch {:.2f}) loss {:.4f}{} lr {:.3g} grad-norm {:.3g}{} {:.0f} tokens/s ETA "
        "{} | {}",
        step, s.steps, epoch, window_loss / double(window_steps),
        window_steps > 1 ? fmt::format(" (mean of {} steps)", window_steps) : std::string(), lr,
        r.grad_norm, r.skipped ? " (skipped: overflow)" : "", tps, duration(eta), tiers);
    if (step % std::max<int64_t>(s.steps_per_print, 1) == 0 || step == s.steps ||
        step == first + 1) {
      fmt::print("{}{}\n", tty ? "\r" : "", line);
      window_loss = 0;
      window_steps = 0;
    } else if (tty) {
      fmt::print("\r{}", line);
    }
    if (eval)
      fmt::print(
          "{}eval: step {} loss {:.4f} perplexity {:.4g} over {} sequences ({} targets) in "
          "{:.2f}s\n",
          tty ? "\r" : "", step, eval->loss(), std::exp(eval->loss()), held_out->size(),
          eval->targets, eval->seconds);
    std::fflush(stdout);
    if (!std::isfinite(r.loss) && !r.skipped)
      fail("step {}: the loss is {}; lower the learning rate or check the data", step, r.loss);
    if ((s.save_every > 0 && step % s.save_every == 0) || step == s.steps) {
      const nlohmann::json state = {{"step", step},
                                    {"applied_updates", applied},
                                    {"data", loader.position().to_json()},
                                    {"loss_scale", scaler.state().to_json()},
                                    {"model", to_hf_config_json(model)},
                                    {"settings", s.echo}};
      // The step's last updates (which run on past its loss) end first: the line below times
      // the checkpoint alone.
      ex.finish();
      const auto began = std::chrono::steady_clock::now();
      const fs::path dir =
          save_checkpoint(s.run_dir, step, ex, model, s.dtype, state, s.keep,
                          model_side_files(s.model), image_text ? &*image_text : nullptr);
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
      uint64_t bytes = 0;
      std::error_code unsized;
      for (const auto& e : fs::directory_iterator(dir, unsized))
        if (e.is_regular_file(unsized)) bytes += e.file_size(unsized);
      fmt::print("checkpoint: {} ({} in {:.1f} s, {}/s)\n", dir.string(), format_bytes(bytes), took,
                 format_bytes(static_cast<uint64_t>(double(bytes) / std::max(took, 1e-3))));
      std::fflush(stdout);
    }
  }
  if (!s.trace.empty()) ex.trace(s.trace);
  return loss;
}

}  // namespace strata
