#include "partition/zero.h"

#include "core/bytes.h"
#include "core/error.h"
#include "model/safetensors.h"
#include "model/weights.h"

#include <algorithm>
#include <cstring>

namespace strata {

// What one rank holds: its shard of every unit, the reduce-scatter staging, a setup stream.
struct ZeroModel::Rank {
  Device* device = nullptr;
  std::vector<DeviceBuffer> params, grads;  // per unit: the shard, or the whole unit
  DeviceBuffer scratch;                     // reduce-scatter receive, one shard of grads
  std::unique_ptr<Event> scratch_used;      // the last add out of `scratch`
  std::unique_ptr<Stream> setup;            // loading, downloads, zeroing
};

// One working buffer, present on every rank; `unit` is the unit it holds, or -1 when free.
// The pool's slots (the first working_buffers) hold a gathered sharded unit and its working
// gradients; each replicated unit has a slot of its own with working gradients only (its
// parameters are used in place), so its backward never competes with a gather for the pool.
struct ZeroModel::Slot {
  int unit = -1;
  std::vector<DeviceBuffer> params, grads;             // per rank: a full (padded) unit
  std::vector<std::unique_ptr<Event>> released, used;  // per rank
};

ZeroModel::ZeroModel(const ModelLayout& layout, Communicator& comm, const ZeroOptions& options)
    : layout_(layout),
      comm_(comm),
      options_(options),
      partition_(Partition::build(layout, comm.size(), options.align_elements,
                                  options.persistence_threshold)),
      state_(layout.units.size()) {
  if (options.working_buffers < 1)
    fail(
        "ZeRO-3 model state: {} working buffers per device; at least 1 is needed (2 with tied "
        "embeddings or prefetch)",
        options.working_buffers);
  const int N = ranks();
  const size_t U = partition_.units.size();
  for (const auto* v : {&options.param_resident, &options.grad_resident})
    if (!v->empty() && v->size() != U)
      fail(
          "ZeRO-3 model state: residency given for {} units, the model has {}; give one flag "
          "per unit or none",
          v->size(), U);
  for (int u = 0; u < partition_.num_units(); ++u)
    if (partition_.units[static_cast<size_t>(u)].replicated &&
        (!param_resident(u) || (options.with_grads && !grad_resident(u))))
      fail(
          "ZeRO-3 model state: unit {} is replicated (at most {} elements) but its parameters "
          "or gradients are marked not resident; replicated units stay on every device",
          partition_.units[static_cast<size_t>(u)].name, options.persistence_threshold);
  const uint64_t ps = dtype_size(options.param_dtype), gs = dtype_size(options.grad_dtype);
  // The pool's working buffers hold sharded units only; replicated ones are used in place,
  // with working gradients in a slot of their own.
  const uint64_t gather_numel = partition_.max_gathered_numel();
  const uint64_t grad_numel = options.with_grads ? gather_numel : 0;

  for (int r = 0; r < N; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->device = &comm.device(r);
    Device& d = *rank->device;
    for (int u = 0; u < partition_.num_units(); ++u) {
      const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
      const std::string what = up.replicated ? fmt::format("unit {} (replicated)", up.name)
                                             : fmt::format("shard {}/{} of unit {}", r, N, up.name);
      // Off-device state keeps an empty slot, so units index the vectors as before.
      rank->params.emplace_back(d, param_resident(u) ? up.resident() * ps : 0,
                                "parameters of " + what, MemoryKind::parameters);
      if (options.with_grads)
        rank->grads.emplace_back(d, grad_resident(u) ? up.resident() * gs : 0,
                                 "gradients of " + what, MemoryKind::gradients);
    }
    // Only units whose G is resident and sharded add through the staging, and only with
    // several ranks (one adds its working gradients in place); else nothing is allocated.
    bool staged_adds = false;
    for (int u = 0; u < partition_.num_units(); ++u)
      staged_adds = staged_adds || (N > 1 && !partition_.units[static_cast<size_t>(u)].replicated &&
                                    options.with_grads && grad_resident(u));
    if (staged_adds)
      rank->scratch = DeviceBuffer(d, partition_.max_shard_numel() * gs, "reduce-scatter staging",
                                   MemoryKind::communication);
    rank->scratch_used = d.create_event();
    rank->setup = d.create_stream("zero setup");
    ranks_.push_back(std::move(rank));
  }
  // A slot on every rank: `param_bytes` of gathered parameters, `grad_bytes` of gradients.
  auto add_slot = [&](uint64_t param_bytes, uint64_t grad_bytes, const std::string& params_name,
                      const std::string& grads_name) {
    auto slot = std::make_unique<Slot>();
    for (int r = 0; r < N; ++r) {
      Device& d = device(r);
      slot->params.emplace_back(d, param_bytes, params_name, MemoryKind::gathered);
      slot->grads.emplace_back(d, grad_bytes, grads_name, MemoryKind::gathered);
      slot->released.push_back(d.create_event());
      slot->used.push_back(d.create_event());
    }
    slots_.push_back(std::move(slot));
    return static_cast<int>(slots_.size()) - 1;
  };
  // One rank uses a sharded unit where its parameters are (gather()): its working buffers hold
  // gradients only.
  const uint64_t gathered_bytes = N == 1 ? 0 : gather_numel * ps;
  for (int i = 0; i < options.working_buffers; ++i)
    add_slot(gathered_bytes, grad_numel * gs,
             fmt::format("working buffer {} (gathered parameters)", i),
             fmt::format("working buffer {} (unit gradients)", i));
  rep_slot_.assign(U, -1);
  for (int u = 0; u < partition_.num_units() && options.with_grads; ++u) {
    const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
    if (up.replicated)
      rep_slot_[static_cast<size_t>(u)] = add_slot(
          0, up.numel * gs, "", fmt::format("working gradients of unit {} (replicated)", up.name));
  }
}

ZeroModel::~ZeroModel() {
  // Queued setup work may still read the buffers; let it finish before they go back.
  for (auto& r : ranks_) {
    try {
      r->setup->synchronize();
    } catch (const Error&) {
      // Already reported to whoever queued it; nothing more to do while tearing down.
    }
  }
}

void ZeroModel::check_unit(int u, const char* what) const {
  if (u < 0 || u >= partition_.num_units())
    fail("{} of unit {}: the model has units 0..{}", what, u, partition_.num_units() - 1);
}

void ZeroModel::check_streams(const std::vector<Stream*>& streams, const char* what) const {
  if (streams.size() != static_cast<size_t>(ranks()))
    fail("{}: {} streams given for {} ranks; pass one stream per rank, in rank order", what,
         streams.size(), ranks());
  for (size_t r = 0; r < streams.size(); ++r)
    if (streams[r] == nullptr) fail("{}: the stream of rank {} is null", what, r);
}

bool ZeroModel::param_resident(int u) const {
  check_unit(u, "residency");
  return options_.param_resident.empty() || options_.param_resident[static_cast<size_t>(u)];
}

bool ZeroModel::grad_resident(int u) const {
  check_unit(u, "residency");
  return options_.grad_resident.empty() || options_.grad_resident[static_cast<size_t>(u)];
}

void ZeroModel::synchronize_setup() const {
  for (const auto& r : ranks_) r->setup->synchronize();
}

// ---- model state ----

void ZeroModel::scatter_staged(int u, const std::vector<char>& staged) {
  if (!param_resident(u)) return;  // its home is elsewhere: the owner of that home sets it
  const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
  const uint64_t ps = dtype_size(options_.param_dtype);
  for (int r = 0; r < ranks(); ++r) {
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    rank.device->copy_to_device(rank.params[static_cast<size_t>(u)].data(),
                                staged.data() + up.shard_offset(r) * ps, up.resident() * ps,
                                *rank.setup);
  }
  synchronize_setup();  // the staging buffer is reused by the next unit
}

void ZeroModel::init_random(uint64_t seed) {
  const uint64_t ps = dtype_size(options_.param_dtype);
  std::vector<char> staged(partition_.max_unit_numel() * ps);
  for (int u = 0; u < partition_.num_units(); ++u) {
    std::fill(staged.begin(), staged.end(), char{0});  // the shards' padding stays zero
    init_unit_random(layout_, u, seed, options_.param_dtype, staged.data());
    scatter_staged(u, staged);
  }
}

void ZeroModel::load(const SafetensorsReader& reader) {
  check_tensor_names(reader);
  const uint64_t ps = dtype_size(options_.param_dtype);
  std::vector<char> staged(partition_.max_unit_numel() * ps);
  for (int u = 0; u < partition_.num_units(); ++u) {
    std::fill(staged.begin(), staged.end(), char{0});
    for (const ParamSlot& p : layout_.units[static_cast<size_t>(u)].params)
      read_parameter(reader, p, staged.data() + p.offset * ps, options_.param_dtype);
    scatter_staged(u, staged);
  }
}

void ZeroModel::check_tensor_names(const SafetensorsReader& reader) const {
  strata::check_tensor_names(layout_, reader);
}

void ZeroModel::upload_unit(int u, const std::vector<float>& values) {
  check_unit(u, "upload");
  const UnitLayout& unit = layout_.units[static_cast<size_t>(u)];
  if (values.size() != unit.numel)
    fail("upload to unit {}: {} values given for its {} elements", unit.name, values.size(),
         unit.numel);
  std::vector<char> staged(
      partition_.units[static_cast<size_t>(u)].padded * dtype_size(options_.param_dtype), char{0});
  convert(staged.data(), options_.param_dtype, values.data(), DType::f32, values.size());
  scatter_staged(u, staged);
}

void ZeroModel::zero_grads() {
  if (!options_.with_grads) return;
  for (const auto& rank : ranks_)
    for (DeviceBuffer& g : rank->grads)
      if (g.bytes() > 0) rank->device->fill_zero(g.data(), g.bytes(), *rank->setup);
  synchronize_setup();
}

void ZeroModel::zero_grad(int u, int r, Stream& stream) {
  check_unit(u, "zero_grad");
  if (!options_.with_grads || !grad_resident(u)) return;
  Rank& rank = *ranks_.at(static_cast<size_t>(r));
  DeviceBuffer& g = rank.grads[static_cast<size_t>(u)];
  if (g.bytes() > 0) rank.device->fill_zero(g.data(), g.bytes(), stream);
}

std::vector<float> ZeroModel::download_unit(int u, bool grad) const {
  check_unit(u, "download");
  const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
  if (grad && !options_.with_grads)
    fail("download of unit {}'s gradients: this model state was made without gradients", up.name);
  if (grad ? !grad_resident(u) : !param_resident(u))
    fail("download of unit {}'s {}: they do not live on the devices; read them from their home",
         up.name, grad ? "gradients" : "parameters");
  const DType t = grad ? options_.grad_dtype : options_.param_dtype;
  const uint64_t es = dtype_size(t);
  auto buffer = [&](int r) -> const DeviceBuffer& {
    const Rank& rank = *ranks_[static_cast<size_t>(r)];
    return (grad ? rank.grads : rank.params)[static_cast<size_t>(u)];
  };
  std::vector<char> raw(up.padded * es);
  if (up.replicated) {
    // Every rank's copy, so a replica that drifted is caught rather than silently ignored.
    std::vector<std::vector<char>> copies(static_cast<size_t>(ranks()),
                                          std::vector<char>(raw.size()));
    for (int r = 0; r < ranks(); ++r)
      ranks_[static_cast<size_t>(r)]->device->copy_to_host(copies[static_cast<size_t>(r)].data(),
                                                           buffer(r).data(), raw.size(),
                                                           *ranks_[static_cast<size_t>(r)]->setup);
    synchronize_setup();
    for (int r = 1; r < ranks(); ++r)
      if (std::memcmp(copies[0].data(), copies[static_cast<size_t>(r)].data(), raw.size()) != 0)
        fail(
            "unit {} is replicated, but rank {}'s {} differ from rank 0's; this is a bug in "
            "strata's ZeRO-3 partitioning",
            up.name, r, grad ? "gradients" : "parameters");
    raw = std::move(copies[0]);
  } else {
    for (int r = 0; r < ranks(); ++r)
      ranks_[static_cast<size_t>(r)]->device->copy_to_host(raw.data() + up.shard_offset(r) * es,
                                                           buffer(r).data(), up.shard * es,
                                                           *ranks_[static_cast<size_t>(r)]->setup);
    synchronize_setup();
  }
  std::vector<float> out(up.numel);
  convert(out.data(), DType::f32, raw.data(), t, out.size());
  return out;
}

TensorView ZeroModel::param_shard(int u, int rank) const {
  check_unit(u, "parameter shard");
  if (!param_resident(u))
    fail("parameter shard of unit {}: its parameters do not live on the devices",
         partition_.units[static_cast<size_t>(u)].name);
  const DeviceBuffer& b = ranks_.at(static_cast<size_t>(rank))->params[static_cast<size_t>(u)];
  const auto n = static_cast<int64_t>(partition_.units[static_cast<size_t>(u)].resident());
  return TensorView{b.data(), options_.param_dtype, {n}, &device(rank)};
}

TensorView ZeroModel::grad_shard(int u, int rank) const {
  check_unit(u, "gradient shard");
  if (!options_.with_grads)
    fail("gradient shard of unit {}: this model state was made without gradients", u);
  if (!grad_resident(u))
    fail("gradient shard of unit {}: its gradients do not live on the devices",
         partition_.units[static_cast<size_t>(u)].name);
  const DeviceBuffer& b = ranks_.at(static_cast<size_t>(rank))->grads[static_cast<size_t>(u)];
  const auto n = static_cast<int64_t>(partition_.units[static_cast<size_t>(u)].resident());
  return TensorView{b.data(), options_.grad_dtype, {n}, &device(rank)};
}

// ---- gather / release / reduce-scatter ----

bool ZeroModel::gathered(int u) const {
  check_unit(u, "gathered");
  return state_[static_cast<size_t>(u)].gathered;
}

int ZeroModel::free_working_buffers() const {
  int n = 0;
  for (int i = 0; i < options_.working_buffers; ++i)
    n += slots_[static_cast<size_t>(i)]->unit < 0 ? 1 : 0;
  return n;
}

int ZeroModel::take_slot(int u) {
  const int pool = options_.working_buffers;
  for (int i = 0; i < pool; ++i)
    if (slots_[static_cast<size_t>(i)]->unit < 0) {
      slots_[static_cast<size_t>(i)]->unit = u;
      return i;
    }
  std::string held;
  for (int i = 0; i < pool; ++i)
    held += fmt::format(
        "{}{}", held.empty() ? "" : ", ",
        partition_.units[static_cast<size_t>(slots_[static_cast<size_t>(i)]->unit)].name);
  fail(
      "gather of unit {}: all {} working buffers are in use (by {}); release one first, or "
      "make the model state with more working buffers",
      partition_.units[static_cast<size_t>(u)].name, pool, held);
}

// The caller's per-rank buffers for a non-resident unit: one per rank, on its device, of the
// shard's length and the expected dtype.
static void check_external(const std::vector<TensorView>& views, bool needed, int ranks,
                           const UnitPartition& up, DType dtype, const char* what,
                           const Communicator& comm) {
  if (!needed) {
    if (!views.empty())
      fail("{} of unit {}: its {} live on the devices, so pass no external buffers", what, up.name,
           std::string_view(what) == "gather" ? "parameters" : "gradients");
    return;
  }
  if (views.size() != static_cast<size_t>(ranks))
    fail(
        "{} of unit {}: it is not resident, so one device buffer per rank is needed ({} given "
        "for {} ranks)",
        what, up.name, views.size(), ranks);
  for (int r = 0; r < ranks; ++r) {
    const TensorView& v = views[static_cast<size_t>(r)];
    if (v.data == nullptr || v.dtype != dtype || v.numel() != static_cast<int64_t>(up.shard) ||
        v.device != &comm.device(r))
      fail("{} of unit {}: rank {}'s buffer must be {} elements of {} on {} (got {} of {}{})", what,
           up.name, r, up.shard, dtype_name(dtype), comm.device(r).name(), v.numel(),
           dtype_name(v.dtype), v.data == nullptr ? ", null" : "");
  }
}

std::vector<UnitBuffers> ZeroModel::gather(int u, const std::vector<Stream*>& streams,
                                           bool for_backward,
                                           const std::vector<TensorView>& shards) {
  check_unit(u, "gather");
  check_streams(streams, "gather");
  const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
  UnitState& st = state_[static_cast<size_t>(u)];
  if (st.gathered) fail("gather of unit {}: it is gathered already; release it first", up.name);
  if (for_backward && !options_.with_grads)
    fail("gather of unit {} for backward: this model state was made without gradients", up.name);
  check_external(shards, !param_resident(u), ranks(), up, options_.param_dtype, "gather", comm_);
  const int N = ranks();
  int s = -1;
  if (!up.replicated) {
    s = take_slot(u);
  } else if (for_backward) {
    s = rep_slot_[static_cast<size_t>(u)];
    slots_[static_cast<size_t>(s)]->unit = u;
  }
  std::vector<UnitBuffers> out(static_cast<size_t>(N));
  if (s >= 0) {
    Slot& slot = *slots_[static_cast<size_t>(s)];
    for (int r = 0; r < N; ++r) {
      // The buffer's last users must be done before it is overwritten: rank r's own work up
      // to the release, and every rank's part of the last reduce-scatter out of it, since
      // peers read rank r's working gradients (a collective's completion on rank r's stream
      // need not mean its peers are done with rank r's memory).
      streams[static_cast<size_t>(r)]->wait(*slot.released[static_cast<size_t>(r)]);
      for (int q = 0; q < N; ++q)
        streams[static_cast<size_t>(r)]->wait(*slot.used[static_cast<size_t>(q)]);
    }
  }
  const DType pt = options_.param_dtype;
  if (!up.replicated && N == 1) {
    // One rank's shard is the whole (padded) unit: the all-gather would copy it unchanged, so
    // the unit is used where it lies, resident or in the caller's buffer.
    out[0].params =
        shards.empty() ? ranks_[0]->params[static_cast<size_t>(u)].data() : shards[0].data;
  } else if (!up.replicated) {
    Slot& slot = *slots_[static_cast<size_t>(s)];
    std::vector<TensorView> send, recv;
    for (int r = 0; r < N; ++r) {
      send.push_back(
          shards.empty()
              ? TensorView{ranks_[static_cast<size_t>(r)]->params[static_cast<size_t>(u)].data(),
                           pt,
                           {static_cast<int64_t>(up.shard)},
                           &device(r)}
              : shards[static_cast<size_t>(r)]);
      recv.push_back(TensorView{slot.params[static_cast<size_t>(r)].data(),
                                pt,
                                {static_cast<int64_t>(up.padded)},
                                &device(r)});
    }
    comm_.all_gather(send, recv, streams);
    for (int r = 0; r < N; ++r)
      out[static_cast<size_t>(r)].params = recv[static_cast<size_t>(r)].data;
  } else {
    for (int r = 0; r < N; ++r)
      out[static_cast<size_t>(r)].params =
          ranks_[static_cast<size_t>(r)]->params[static_cast<size_t>(u)].data();
  }
  if (for_backward) {
    Slot& slot = *slots_[static_cast<size_t>(s)];
    for (int r = 0; r < N; ++r) {
      void* g = slot.grads[static_cast<size_t>(r)].data();
      device(r).fill_zero(g, up.padded * dtype_size(options_.grad_dtype),
                          *streams[static_cast<size_t>(r)]);
      out[static_cast<size_t>(r)].grads = g;
    }
  }
  st = UnitState{true, for_backward, s};
  return out;
}

void ZeroModel::clear_working_grads(int u, const std::vector<Stream*>& streams) {
  check_unit(u, "clear_working_grads");
  check_streams(streams, "clear_working_grads");
  const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
  const UnitState& st = state_[static_cast<size_t>(u)];
  if (!st.gathered || !st.for_backward)
    fail(
        "clearing unit {}'s working gradients: the unit is not gathered for backward; this is a "
        "bug in strata",
        up.name);
  Slot& slot = *slots_[static_cast<size_t>(st.slot)];
  for (int r = 0; r < ranks(); ++r)
    device(r).fill_zero(slot.grads[static_cast<size_t>(r)].data(),
                        up.padded * dtype_size(options_.grad_dtype),
                        *streams[static_cast<size_t>(r)]);
}

void ZeroModel::release(int u, const std::vector<Stream*>& streams) {
  check_unit(u, "release");
  check_streams(streams, "release");
  UnitState& st = state_[static_cast<size_t>(u)];
  if (!st.gathered)
    fail("release of unit {}: it is not gathered; release only what gather() returned",
         partition_.units[static_cast<size_t>(u)].name);
  if (st.slot >= 0) {
    Slot& slot = *slots_[static_cast<size_t>(st.slot)];
    for (int r = 0; r < ranks(); ++r)
      streams[static_cast<size_t>(r)]->record(*slot.released[static_cast<size_t>(r)]);
    slot.unit = -1;
  }
  st = UnitState{};
}

void ZeroModel::reduce_scatter_grads(int u, const std::vector<Stream*>& streams,
                                     const std::vector<TensorView>& out) {
  check_unit(u, "reduce-scatter");
  check_streams(streams, "reduce-scatter");
  const UnitPartition& up = partition_.units[static_cast<size_t>(u)];
  const UnitState& st = state_[static_cast<size_t>(u)];
  if (!st.gathered || !st.for_backward)
    fail(
        "reduce-scatter of unit {}'s gradients: the unit is not gathered for backward; call "
        "gather(u, streams, true) before its backward",
        up.name);
  check_external(out, !grad_resident(u), ranks(), up, options_.grad_dtype, "reduce-scatter", comm_);
  Slot& slot = *slots_[static_cast<size_t>(st.slot)];
  const int N = ranks();
  const DType gt = options_.grad_dtype;
  if (!out.empty()) {
    // Not resident (so not replicated): the sum goes straight to the caller's buffer.
    std::vector<TensorView> send;
    for (int r = 0; r < N; ++r)
      send.push_back(TensorView{slot.grads[static_cast<size_t>(r)].data(),
                                gt,
                                {static_cast<int64_t>(up.padded)},
                                &device(r)});
    comm_.reduce_scatter(send, out, streams);
    for (int r = 0; r < N; ++r)
      streams[static_cast<size_t>(r)]->record(*slot.used[static_cast<size_t>(r)]);
    return;
  }
  std::vector<TensorView> partial;  // per rank, the sum this rank adds into its shard
  if (N == 1) {
    // One rank: the reduce-scatter would copy the working gradients unchanged; add them in place.
    partial.push_back(TensorView{slot.grads[0].data(),
                                 gt,
                                 {static_cast<int64_t>(up.replicated ? up.numel : up.shard)},
                                 &device(0)});
  } else if (up.replicated) {
    for (int r = 0; r < N; ++r)
      partial.push_back(TensorView{slot.grads[static_cast<size_t>(r)].data(),
                                   gt,
                                   {static_cast<int64_t>(up.numel)},
                                   &device(r)});
    comm_.all_reduce(partial, streams);
  } else {
    std::vector<TensorView> send;
    for (int r = 0; r < N; ++r) {
      Rank& rank = *ranks_[static_cast<size_t>(r)];
      streams[static_cast<size_t>(r)]->wait(*rank.scratch_used);
      send.push_back(TensorView{slot.grads[static_cast<size_t>(r)].data(),
                                gt,
                                {static_cast<int64_t>(up.padded)},
                                &device(r)});
      partial.push_back(
          TensorView{rank.scratch.data(), gt, {static_cast<int64_t>(up.shard)}, &device(r)});
    }
    comm_.reduce_scatter(send, partial, streams);
  }
  for (int r = 0; r < N; ++r) {
    Stream& s = *streams[static_cast<size_t>(r)];
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    const TensorView shard{rank.grads[static_cast<size_t>(u)].data(), gt,
                           partial[static_cast<size_t>(r)].shape, &device(r)};
    device(r).kernels().add(shard, shard, partial[static_cast<size_t>(r)], s);
    if (!up.replicated && N > 1) s.record(*rank.scratch_used);
    s.record(*slot.used[static_cast<size_t>(r)]);
  }
}

// ---- ZeroRunner ----

ZeroRunner::ZeroRunner(ZeroModel& zero, const std::vector<LlamaModel*>& models)
    : zero_(zero), models_(models) {
  const int N = zero.ranks();
  if (models.size() != static_cast<size_t>(N))
    fail("ZeRO-3 runner: {} models given for {} ranks; give one LlamaModel per device",
         models.size(), N);
  for (int r = 0; r < N; ++r) {
    const LlamaModel* m = models[static_cast<size_t>(r)];
    if (m == nullptr) fail("ZeRO-3 runner: the model of rank {} is null", r);
    if (&m->device() != &zero.device(r))
      fail(
          "ZeRO-3 runner: rank {}'s model runs on {}, but rank {} of the model state is {}; "
          "build each rank's LlamaModel on that rank's device",
          r, m->device().name(), r, zero.device(r).name());
    const ModelLayout& a = m->layout();
    const ModelLayout& b = zero.layout();
    bool same = a.units.size() == b.units.size();
    for (size_t u = 0; same && u < a.units.size(); ++u) same = a.units[u].numel == b.units[u].numel;
    if (!same)
      fail(
          "ZeRO-3 runner: rank {}'s model ({}) has another layout than the model state; build "
          "both from the same config",
          r, m->config().name);
    if (m->options().param_dtype != zero.options().param_dtype ||
        (zero.options().with_grads && m->options().grad_dtype != zero.options().grad_dtype))
      fail(
          "ZeRO-3 runner: rank {}'s model computes in {} with {} gradients, the model state holds "
          "{} parameters and {} gradients; give both the same dtypes",
          r, dtype_name(m->options().param_dtype), dtype_name(m->options().grad_dtype),
          dtype_name(zero.options().param_dtype), dtype_name(zero.options().grad_dtype));
  }
  tied_ = models[0]->config().tie_word_embeddings;
  if (tied_ && zero.options().working_buffers < 2)
    fail(
        "ZeRO-3 runner: model {} ties its embeddings, so the head and the embedding are used "
        "together; make the model state with at least 2 working buffers (it has {})",
        models[0]->config().name, zero.options().working_buffers);
  views_.assign(static_cast<size_t>(N),
                std::vector<UnitBuffers>(static_cast<size_t>(zero.layout().num_units())));
  if (zero.options().with_grads)
    for (int r = 0; r < N; ++r) {
      const LlamaModel& m = *models[static_cast<size_t>(r)];
      const uint64_t bytes = static_cast<uint64_t>(m.options().max_batch * m.options().seq_len *
                                                   m.config().hidden_size) *
                             dtype_size(m.options().param_dtype);
      grad_a_.emplace_back(m.device(), bytes, "activation gradient", MemoryKind::activations);
      grad_b_.emplace_back(m.device(), bytes, "activation gradient", MemoryKind::activations);
    }
}

void ZeroRunner::check(const std::vector<RankBatch>& batches,
                       const std::vector<Stream*>& streams) const {
  const size_t N = models_.size();
  if (batches.size() != N || streams.size() != N)
    fail("ZeRO-3 runner: {} batches and {} streams given for {} ranks; give one of each per rank",
         batches.size(), streams.size(), N);
  for (size_t r = 0; r < N; ++r) {
    const RankBatch& b = batches[r];
    const int64_t max = models_[r]->options().max_batch;
    if (b.batch < 0 || b.batch > max)
      fail(
          "ZeRO-3 runner: rank {} has a batch of {} sequences, outside 0..{} (its model's max "
          "batch); split the data differently",
          r, b.batch, max);
    if (b.batch > 0 && (b.ids == nullptr || b.targets == nullptr))
      fail("ZeRO-3 runner: rank {} has {} sequences but no ids or targets", r, b.batch);
  }
}

void ZeroRunner::gather(int u, const std::vector<Stream*>& streams, bool for_backward) {
  const std::vector<UnitBuffers> g = zero_.gather(u, streams, for_backward);
  for (size_t r = 0; r < g.size(); ++r) views_[r][static_cast<size_t>(u)] = g[r];
}

void ZeroRunner::release(int u, const std::vector<Stream*>& streams) {
  zero_.release(u, streams);
  for (auto& v : views_) v[static_cast<size_t>(u)] = UnitBuffers{};
}

void ZeroRunner::forward(const std::vector<RankBatch>& batches,
                         const std::vector<Stream*>& streams) {
  check(batches, streams);
  const ModelLayout& layout = zero_.layout();
  const int U = layout.num_units();
  for (int u = 0; u < U; ++u) {
    // With tied embeddings the head's logits come from the embedding's table.
    const int table = layout.tied_table(u);
    const bool with_table = table >= 0;
    if (with_table) gather(table, streams, false);
    gather(u, streams, false);
    for (size_t r = 0; r < models_.size(); ++r) {
      const RankBatch& b = batches[r];
      if (b.batch == 0) continue;
      LlamaModel& m = *models_[r];
      const TensorView in = u == 0 ? TensorView{} : m.checkpoint(u, b.batch);
      const TensorView out = u + 1 < U ? m.checkpoint(u + 1, b.batch) : TensorView{};
      m.forward_unit(u, views_[r], b.ids, b.targets, in, out, b.batch, *streams[r]);
    }
    release(u, streams);
    if (with_table) release(table, streams);
  }
}

void ZeroRunner::backward(const std::vector<RankBatch>& batches, float loss_scale,
                          const std::vector<Stream*>& streams) {
  check(batches, streams);
  if (!zero_.options().with_grads)
    fail("ZeRO-3 backward: the model state was made without gradients (with_grads = false)");
  const ModelLayout& layout = zero_.layout();
  const int U = layout.num_units(), head = U - 1;
  // Whole, the tied table stays gathered from the head's backward to the embedding's; cut, each
  // head piece's share of its table's gradients is reduced right after it.
  const bool hold = tied_ && layout.vocab_pieces == 1;
  const size_t N = models_.size();
  std::vector<TensorView> dout(N), din(N);
  for (size_t r = 0; r < N; ++r) {
    const LlamaModel& m = *models_[r];
    const int64_t rows = batches[r].batch * m.options().seq_len, D = m.config().hidden_size;
    const DType t = m.options().param_dtype;
    dout[r] = grad_a_[r].view(t, {rows, D});
    din[r] = grad_b_[r].view(t, {rows, D});
  }
  for (int u = head; u >= 0; --u) {
    const int table = layout.tied_table(u);
    if (u == head && hold) {
      gather(head, streams, true);
      // The head accumulates into the embedding's gradients too: unit 0 stays gathered from
      // here to its own backward, and is reduce-scattered once, after both.
      gather(0, streams, true);
    } else if (!(hold && u == 0)) {
      if (table >= 0) gather(table, streams, true);
      gather(u, streams, true);
    }
    for (size_t r = 0; r < N; ++r) {
      const RankBatch& b = batches[r];
      if (b.batch == 0) continue;
      LlamaModel& m = *models_[r];
      const TensorView in = u == 0 ? TensorView{} : m.checkpoint(u, b.batch);
      m.backward_unit(u, views_[r], b.ids, b.targets, loss_scale, in, dout[r], din[r], b.batch,
                      *streams[r]);
      std::swap(dout[r], din[r]);
    }
    zero_.reduce_scatter_grads(u, streams);
    release(u, streams);
    if (table >= 0 && !hold) {
      zero_.reduce_scatter_grads(table, streams);
      release(table, streams);
    }
  }
}

}  // namespace strata
