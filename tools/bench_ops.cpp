// bench_ops.cpp: `strata bench ops`, each kernel of one Llama block, forward and backward, timed
// on one device at the model's shapes, beside a large square matmul (the device's own matmul
// rate, the peak the others are measured against). Where `bench model` says how fast the
// whole model runs, this says which op holds it back.
//
// Ops (a block without activation checkpointing; counts are calls per block and step):
// - matmuls: each projection's forward y = x W^T, its input gradient dx = dy W, and its weight
//   gradient dW += dy^T x into f32 (model FLOPs 2 m n k);
// - attention forward and backward (model FLOPs as `bench attention`: 2 B H T^2 hd forward,
//   twice that backward);
// - the memory-bound ops: RMSNorm forward and backward, RoPE (forward, and its inverse in
//   backward), SwiGLU forward and backward, the residual adds, and where the model has them
//   the projections' biases (broadcast into the output, and the gradient's column sums) and
//   Qwen3's q and k norms (each head a row); reported in GB/s of the tensors each reads and
//   writes once.
//
// Before it reports a speed it runs every op on a cut of its shape (at most 128 tokens in
// one sequence; the weights' own dimensions kept) on the device and on the host backend in
// f32, from the same random inputs, and checks each output: a normalised error within 1e-3
// (f32) or 3e-2 (bf16). Times are the median over 3 windows of --steps calls each, after a
// warm-up call.
#include "bench_check.h"
#include "commands.h"
#include "core/error.h"
#include "core/kernels.h"
#include "core/tensor.h"
#include "device_args.h"
#include "host/host_device.h"
#include "model/config.h"
#include "model/llama.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

namespace strata::cli {
namespace {

struct BenchOpsArgs {
  std::string model = "tiny";
  int64_t seq_len = 128, batch = 1, square = 0;
  int steps = 10;
  std::string devices, device_memory, dtype;
  bool json = false;
};

enum class Fill { kRandom, kZero, kRope };

// One tensor of an op: its shape, whether it is f32 whatever the model's dtype (statistics,
// weight gradients, the RoPE table), how it starts, and whether the op's result is checked.
struct Spec {
  Shape shape;
  bool f32;
  Fill fill;
  bool checked;
};

using Body = std::function<void(Kernels&, const std::vector<TensorView>&, Stream&)>;

struct Op {
  std::string name, shape;  // shape: what the line shows ("m 2048 n 4096 k 4096")
  enum Kind { kMatmul, kAttention, kMemory } kind;
  int count;         // calls per block and step
  double flops = 0;  // model FLOPs per call (matmul, attention)
  double bytes = 0;  // bytes read and written per call (memory-bound ops)
  std::vector<Spec> tensors;
  Body setup, run;  // setup (may be empty) runs once before run
};

Spec in(Shape s, bool f32 = false) {
  return {s, f32, Fill::kRandom, false};
}
Spec out(Shape s, bool f32 = false) {
  return {s, f32, Fill::kZero, true};
}

// The ops of one block at `batch` x `T` tokens, and the square matmul of edge `square`.
std::vector<Op> block_ops(const LlamaConfig& c, int64_t batch, int64_t T, int64_t square,
                          DType dtype) {
  const int64_t N = batch * T, H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t heads = c.num_attention_heads, kv = c.num_key_value_heads;
  const double e = static_cast<double>(dtype_size(dtype));
  std::vector<Op> ops;
  ops.push_back({"square matmul (peak)",
                 fmt::format("m n k {}", square),
                 Op::kMatmul,
                 0,
                 2.0 * static_cast<double>(square) * static_cast<double>(square) *
                     static_cast<double>(square),
                 0,
                 {in({square, square}), in({square, square}), out({square, square})},
                 {},
                 [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                   k.matmul(t[2], t[0], false, t[1], true, 1.0f, 0.0f, s);
                 }});
  struct Linear {
    const char* name;
    int64_t in, out;
    int count;
    bool bias;
  };
  const Linear linears[] = {{"q_proj", H, heads * hd, 1, c.qkv_bias},
                            {"k_proj v_proj", H, kv * hd, 2, c.qkv_bias},
                            {"o_proj", heads * hd, H, 1, c.o_bias},
                            {"gate_proj up_proj", H, I, 2, c.mlp_bias},
                            {"down_proj", I, H, 1, c.mlp_bias}};
  for (const Linear& l : linears) {
    const double flops =
        2.0 * static_cast<double>(N) * static_cast<double>(l.in) * static_cast<double>(l.out);
    ops.push_back({fmt::format("{} forward", l.name),
                   fmt::format("m {} n {} k {}", N, l.out, l.in),
                   Op::kMatmul,
                   l.count,
                   flops,
                   0,
                   {in({N, l.in}), in({l.out, l.in}), out({N, l.out})},
                   {},
                   [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.matmul(t[2], t[0], false, t[1], true, 1.0f, 0.0f, s);
                   }});
    ops.push_back({fmt::format("{} dx", l.name),
                   fmt::format("m {} n {} k {}", N, l.in, l.out),
                   Op::kMatmul,
                   l.count,
                   flops,
                   0,
                   {in({N, l.out}), in({l.out, l.in}), out({N, l.in})},
                   {},
                   [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.matmul(t[2], t[0], false, t[1], false, 1.0f, 0.0f, s);
                   }});
    ops.push_back({fmt::format("{} dW", l.name),
                   fmt::format("m {} n {} k {}", l.out, l.in, N),
                   Op::kMatmul,
                   l.count,
                   flops,
                   0,
                   {in({N, l.out}), in({N, l.in}), out({l.out, l.in}, true)},
                   {},
                   [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.matmul(t[2], t[0], true, t[1], false, 1.0f, 1.0f, s);
                   }});
  }
  const Shape qs{batch, T, heads, hd}, ks{batch, T, kv, hd}, ls{batch, heads, T};
  const double att = 2.0 * static_cast<double>(batch * heads * hd) * static_cast<double>(T) *
                     static_cast<double>(T);
  const std::string att_shape =
      fmt::format("B {} T {} heads {} kv {} hd {}", batch, T, heads, kv, hd);
  // The model's scores (Gemma 2's scale and cap); no window: the bench's sequences are the whole
  // context.
  const AttentionMask scores = attention_scores(c);
  ops.push_back({"attention forward",
                 att_shape,
                 Op::kAttention,
                 1,
                 att,
                 0,
                 {in(qs), in(ks), in(ks), out(qs), out(ls, true)},
                 {},
                 [scores](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                   k.attention_forward(t[3], t[4], t[0], t[1], t[2], scores, s);
                 }});
  // q, k, v, dout; out and lse from the forward (setup); dq, dk, dv.
  ops.push_back(
      {"attention backward",
       att_shape,
       Op::kAttention,
       1,
       2 * att,
       0,
       {in(qs), in(ks), in(ks), in(qs), out(qs), out(ls, true), out(qs), out(ks), out(ks)},
       [scores](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
         k.attention_forward(t[4], t[5], t[0], t[1], t[2], scores, s);
       },
       [scores](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
         k.attention_backward(t[6], t[7], t[8], t[3], t[0], t[1], t[2], t[4], t[5], scores, s);
       }});
  const double nh = static_cast<double>(N * H) * e;
  const float eps = static_cast<float>(c.rms_norm_eps), offset = norm_weight_offset(c);
  // An RMSNorm's forward and backward over `rows` rows of `dim`, `count` of each per block.
  const auto rmsnorm_ops = [&](const std::string& label, const std::string& shape, int64_t rows,
                               int64_t dim, int count) {
    const double bytes = static_cast<double>(rows * dim) * e;
    ops.push_back({label + " forward",
                   shape,
                   Op::kMemory,
                   count,
                   0,
                   2 * bytes,
                   {in({rows, dim}), in({dim}), out({rows, dim}), out({rows}, true)},
                   {},
                   [eps, offset](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.rmsnorm_forward(t[2], t[3], t[0], t[1], eps, offset, s);
                   }});
    // x, w, dy; y and rstd from the forward (setup); dx, dw (f32).
    ops.push_back({label + " backward",
                   shape,
                   Op::kMemory,
                   count,
                   0,
                   4 * bytes,
                   {in({rows, dim}), in({dim}), in({rows, dim}), out({rows, dim}),
                    out({rows}, true), out({rows, dim}), out({dim}, true)},
                   [eps, offset](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.rmsnorm_forward(t[3], t[4], t[0], t[1], eps, offset, s);
                   },
                   [offset](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.rmsnorm_backward(t[5], t[6], t[2], t[0], t[1], t[4], offset, s);
                   }});
  };
  // Two norms a block, four with Gemma 2's on the sublayers' outputs.
  rmsnorm_ops("rmsnorm", fmt::format("N {} D {}", N, H), N, H, sandwich_norms(c) ? 4 : 2);
  for (const auto& [label, n_heads] : {std::pair{"rope q", heads}, std::pair{"rope k", kv}}) {
    // In place: x is both what is read and what is checked.
    ops.push_back({label,
                   fmt::format("N {} heads {} hd {}", N, n_heads, hd),
                   Op::kMemory,
                   2,
                   0,
                   2.0 * static_cast<double>(N * n_heads * hd) * e,
                   {{Shape{N, n_heads, hd}, false, Fill::kRandom, true},
                    {Shape{T, hd}, true, Fill::kRope, false}},
                   {},
                   [T](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.rope(t[0], t[1], T, false, s);
                   }});
  }
  const double ni = static_cast<double>(N * I) * e;
  // SwiGLU, or GeGLU for the models whose gate is a GELU (Gemma's).
  const Activation act = c.hidden_act;
  const std::string glu = act == Activation::silu ? "swiglu" : "geglu";
  ops.push_back({glu + " forward",
                 fmt::format("N {} I {}", N, I),
                 Op::kMemory,
                 1,
                 0,
                 3 * ni,
                 {in({N, I}), in({N, I}), out({N, I})},
                 {},
                 [act](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                   k.glu_forward(t[2], t[0], t[1], act, s);
                 }});
  ops.push_back({glu + " backward",
                 fmt::format("N {} I {}", N, I),
                 Op::kMemory,
                 1,
                 0,
                 5 * ni,
                 {in({N, I}), in({N, I}), in({N, I}), out({N, I}), out({N, I})},
                 {},
                 [act](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                   k.glu_backward(t[3], t[4], t[2], t[0], t[1], act, s);
                 }});
  for (const Linear& l : linears) {
    if (!l.bias) continue;
    const double rows = static_cast<double>(N * l.out) * e;
    ops.push_back({fmt::format("{} bias", l.name),
                   fmt::format("N {} C {}", N, l.out),
                   Op::kMemory,
                   l.count,
                   0,
                   rows,
                   {in({l.out}), out({N, l.out})},
                   {},
                   [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.broadcast_rows(t[1], t[0], s);
                   }});
    ops.push_back({fmt::format("{} bias grad", l.name),
                   fmt::format("N {} C {}", N, l.out),
                   Op::kMemory,
                   l.count,
                   0,
                   rows,
                   {in({N, l.out}), out({l.out}, true)},
                   {},
                   [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                     k.bias_backward(t[1], t[0], s);
                   }});
  }
  if (c.qk_norm)  // Qwen3's q and k norms: a row per head
    for (const auto& [label, n_heads] : {std::pair{"q norm", heads}, std::pair{"k norm", kv}})
      rmsnorm_ops(label, fmt::format("rows {} hd {}", N * n_heads, hd), N * n_heads, hd, 1);
  ops.push_back({"residual add",
                 fmt::format("N {} D {}", N, H),
                 Op::kMemory,
                 2,
                 0,
                 3 * nh,
                 {in({N, H}), in({N, H}), out({N, H})},
                 {},
                 [](Kernels& k, const std::vector<TensorView>& t, Stream& s) {
                   k.add(t[2], t[0], t[1], s);
                 }});
  return ops;
}

// Deterministic values in [-1, 1) for element i of tensor `which` (splitmix64).
float random_value(uint64_t which, uint64_t i) {
  uint64_t z = (which << 40) + i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

// v as `t` holds it, back in f32.
float round_to(DType t, float v) {
  uint8_t raw[4];
  store_f32(raw, t, 0, v);
  return load_f32(raw, t, 0);
}

// An op's tensors on one device, filled: in `dtype`, but f32 for the specs that say so. The
// random values are first rounded to `values_in` (the device's dtype), so the host reference in
// f32 starts from the values the device was given.
class Tensors {
 public:
  Tensors(Device& device, const Op& op, DType dtype, DType values_in, const LlamaConfig& config,
          int64_t T, Stream& s) {
    for (size_t i = 0; i < op.tensors.size(); ++i) {
      const Spec& spec = op.tensors[i];
      const DType t = spec.f32 ? DType::f32 : dtype;
      const auto n = static_cast<size_t>(spec.shape.numel());
      std::vector<float> values(n, 0.0f);
      if (spec.fill == Fill::kRandom)
        for (size_t e = 0; e < n; ++e) values[e] = round_to(values_in, random_value(i + 1, e));
      if (spec.fill == Fill::kRope) values = rope_table(config, T);
      std::vector<uint8_t> raw(n * dtype_size(t));
      for (size_t e = 0; e < n; ++e) store_f32(raw.data(), t, e, values[e]);
      buffers_.emplace_back(device, raw.size(), "bench ops");
      device.copy_to_device(buffers_.back().data(), raw.data(), raw.size(), s);
      views_.push_back(buffers_.back().view(t, spec.shape));
      s.synchronize();  // before `raw` goes
    }
  }
  const std::vector<TensorView>& views() const { return views_; }

 private:
  std::vector<DeviceBuffer> buffers_;
  std::vector<TensorView> views_;
};

// A FLOP rate as TF/s, or GF/s below one TF/s (the host backend).
std::string flop_rate(double per_s) {
  return per_s >= 1e12 ? fmt::format("{:.1f} TF/s", per_s / 1e12)
                       : fmt::format("{:.1f} GF/s", per_s / 1e9);
}

uint64_t f32_bytes(const Op& op) {
  uint64_t b = 0;
  for (const Spec& s : op.tensors) b += static_cast<uint64_t>(s.shape.numel()) * 4 + 4096;
  return b;
}

void verify(const std::vector<Op>& cut, Device& device, DType dtype, const LlamaConfig& config,
            int64_t T) {
  uint64_t arena = 0;
  for (const Op& op : cut) arena = std::max(arena, f32_bytes(op));
  auto host = open_host_device(99, arena + (64ull << 20));
  auto ds = device.create_stream("bench ops verify");
  auto hs = host->create_stream("bench ops verify");
  const double tol = dtype == DType::f32 ? 1e-3 : 3e-2;
  for (const Op& op : cut) {
    Tensors got(device, op, dtype, dtype, config, T, *ds);
    Tensors want(*host, op, DType::f32, dtype, config, T, *hs);
    for (Tensors* t : {&got, &want}) {
      Device& d = t == &got ? device : *host;
      Stream& s = t == &got ? *ds : *hs;
      if (op.setup) op.setup(d.kernels(), t->views(), s);
      op.run(d.kernels(), t->views(), s);
      s.synchronize();
    }
    for (size_t i = 0; i < op.tensors.size(); ++i) {
      if (!op.tensors[i].checked) continue;
      const double err = normalised_error(fetch_f32(device, got.views()[i], *ds),
                                          fetch_f32(*host, want.views()[i], *hs));
      if (!(err <= tol))
        fail(
            "bench ops: verification failed: {} ({}) on {} gives output {} with a normalised "
            "error of {:.3g} against the host backend in f32 (the bound is {:.0e}); not reporting "
            "a speed",
            op.name, op.shape, device.name(), i, err, tol);
    }
  }
}

double time_op(const Op& op, Device& device, DType dtype, const LlamaConfig& config, int64_t T,
               int steps) {
  auto s = device.create_stream("bench ops");
  Tensors t(device, op, dtype, dtype, config, T, *s);
  Kernels& k = device.kernels();
  if (op.setup) op.setup(k, t.views(), *s);
  op.run(k, t.views(), *s);  // warm-up
  s->synchronize();
  std::vector<double> windows;
  for (int w = 0; w < 3; ++w) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) op.run(k, t.views(), *s);
    s->synchronize();
    windows.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                      steps);
  }
  std::sort(windows.begin(), windows.end());
  return windows[1];
}

int run_bench_ops(const BenchOpsArgs& a) {
  const LlamaConfig config = resolve_model(a.model);
  if (a.seq_len < 1 || a.batch < 1)
    fail("bench ops: --seq-len {} and --batch {} must each be at least 1", a.seq_len, a.batch);
  if (a.steps < 1) fail("bench ops: --steps {} must be at least 1", a.steps);
  if (a.square < 0) fail("bench ops: --square {} must be at least 1 (0: the default)", a.square);
  auto devices = open_cli_devices(a.devices, a.device_memory, 1);
  Device& device = *devices.at(0);
  const DType dtype = model_dtype(device, a.dtype);
  const int64_t square = a.square > 0 ? a.square : device.backend() == Backend::cuda ? 8192 : 512;

  const int64_t cut_t = std::min<int64_t>(a.seq_len, 128);
  verify(block_ops(config, 1, cut_t, std::min<int64_t>(square, 256), dtype), device, dtype, config,
         cut_t);

  std::vector<Op> ops = block_ops(config, a.batch, a.seq_len, square, dtype);
  std::vector<double> seconds;
  for (const Op& op : ops)
    seconds.push_back(time_op(op, device, dtype, config, a.seq_len, a.steps));
  const double peak = ops[0].flops / seconds[0];
  double block_s = 0, block_flops = 0, matmul_s = 0, attention_s = 0, memory_s = 0;
  for (size_t i = 1; i < ops.size(); ++i) {
    const double s = ops[i].count * seconds[i];
    block_s += s;
    block_flops += ops[i].count * ops[i].flops;
    (ops[i].kind == Op::kMatmul      ? matmul_s
     : ops[i].kind == Op::kAttention ? attention_s
                                     : memory_s) += s;
  }
  const double block_rate = block_flops / block_s;

  if (a.json) {
    nlohmann::json list = nlohmann::json::array();
    for (size_t i = 0; i < ops.size(); ++i) {
      nlohmann::json o = {{"op", ops[i].name},
                          {"shape", ops[i].shape},
                          {"count", ops[i].count},
                          {"seconds", seconds[i]}};
      if (ops[i].flops > 0) {
        o["tflops"] = ops[i].flops / seconds[i] / 1e12;
        o["of_peak"] = ops[i].flops / seconds[i] / peak;
      } else {
        o["gb_per_s"] = ops[i].bytes / seconds[i] / 1e9;
      }
      list.push_back(o);
    }
    const nlohmann::json j = {{"model", config.name},
                              {"device", device.name()},
                              {"dtype", dtype_name(dtype)},
                              {"batch", a.batch},
                              {"seq_len", a.seq_len},
                              {"peak_tflops", peak / 1e12},
                              {"ops", list},
                              {"block_s", block_s},
                              {"block_tflops", block_rate / 1e12},
                              {"block_of_peak", block_rate / peak},
                              {"matmul_s", matmul_s},
                              {"attention_s", attention_s},
                              {"memory_s", memory_s},
                              {"verified", true}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "bench ops: one block of {} ({}) on {}, batch {} x {} tokens; every op verified against "
      "the host backend\n",
      config.name, dtype_name(dtype), device.name(), a.batch, a.seq_len);
  fmt::print("  {:<26} {:<36} {:>5} {:>11} {:>10}  {}\n", "op", "shape", "calls", "ms/call", "rate",
             "of the square matmul");
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const std::string rate = op.flops > 0 ? fmt::format("{:.1f} TF/s", op.flops / seconds[i] / 1e12)
                                          : fmt::format("{:.1f} GB/s", op.bytes / seconds[i] / 1e9);
    const std::string share =
        op.flops > 0 ? fmt::format("{:.1f}%", 100 * op.flops / seconds[i] / peak) : "";
    fmt::print("  {:<26} {:<36} {:>5} {:>11.4f} {:>10}  {}\n", op.name, op.shape, op.count,
               seconds[i] * 1e3, rate, share);
  }
  fmt::print(
      "  block forward+backward: {:.3f} ms (matmuls {:.3f}, attention {:.3f}, memory-bound "
      "{:.3f}), {} = {:.1f}% of the square matmul's {}\n",
      block_s * 1e3, matmul_s * 1e3, attention_s * 1e3, memory_s * 1e3, flop_rate(block_rate),
      100 * block_rate / peak, flop_rate(peak));
  fmt::print("  (median of 3 windows of {} calls; no activation recomputation counted)\n", a.steps);
  return 0;
}

}  // namespace

Command add_bench_ops(CLI::App& bench) {
  auto args = std::make_shared<BenchOpsArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "ops", "each kernel of one Llama block at the model's shapes beside a square matmul");
  cmd->add_option("--model", args->model, "preset or checkpoint directory (its config is used)")
      ->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len, "tokens per sequence")->capture_default_str();
  cmd->add_option("--batch", args->batch, "sequences")->capture_default_str();
  cmd->add_option("--square", args->square,
                  "edge of the square matmul, the peak (default 8192 on a GPU, 512 on the host)");
  cmd->add_option("--steps", args->steps, "calls per timed window (3 windows, after a warm-up)")
      ->capture_default_str();
  cmd->add_option("--devices", args->devices, "host or cuda:N (default: cuda:0 if usable)");
  cmd->add_option("--device-memory", args->device_memory, "cap of the device's memory");
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  cmd->add_flag("--json", args->json, "one JSON object: ops[] with seconds, tflops, of_peak, ...");
  return {cmd, [args] { return run_bench_ops(*args); }};
}

}  // namespace strata::cli
