// The fused attention of ops.h on the CPU, f32 and f64: softmax(scale q k^T, causally masked)
// v per head, without the T x T scores. The forward walks each block of query rows over blocks
// of keys with an online softmax (Milakov and Gimelshein, "Online normalizer calculation for
// softmax", 2018; the loop of FlashAttention, Dao et al. 2022): a running row maximum m, a
// running sum l of exp(s - m) and a running output, rescaled by exp(m_old - m_new) when the
// maximum grows. The forward also writes each row's log-sum-exp, lse_i = m_i + log l_i, where
// the plan gives it a second output (the tensor it saves for the backward: [..., T], f32 for
// f32, f64 for f64; graph/src/passes/plan_builder.cpp); the backward reads it, or recomputes it
// where it has none (a kernel run outside a training plan), then the probabilities
// p = exp(s - lse) pair by pair, as FlashAttention-2's backward does:
//   dv_j += p_ij do_i;   dp_ij = do_i . v_j;   ds_ij = p_ij (dp_ij - D_i),  D_i = do_i . o_i;
//   dq_i += scale ds_ij k_j;   dk_j += scale ds_ij q_i.
// Everything accumulates in double for both element types, so the f32 kernel is a close
// reference for the GPU's and the f64 kernel agrees with the unfused composition (matmul,
// scale, causal_mask, softmax, matmul) to rounding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "kernel_args.h"

namespace baton {

namespace {

using detail::AttentionAttrs;
using detail::AttentionDims;
using detail::need_input;
using detail::need_output;

template <class T>
const T* typed(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_of<T>()) {
    throw std::invalid_argument(fmt::format("{}: {} must be {}, got {}", op, role, name(dtype_of<T>()), t.describe()));
  }
  return static_cast<const T*>(t.raw());
}

template <class T>
T* typed_out(Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_of<T>()) {
    throw std::invalid_argument(fmt::format("{}: {} must be {}, got {}", op, role, name(dtype_of<T>()), t.describe()));
  }
  return static_cast<T*>(t.raw());
}

// The forward's second output, the rows' log-sum-exp [..., T] (null where the plan gives none).
template <class T>
T* saved_stats(KernelContext& ctx, const Tensor& q, const char* op) {
  if (ctx.outputs.size() < 2 || ctx.outputs[1] == nullptr) return nullptr;
  Tensor& s = *ctx.outputs[1];
  detail::check_attention_stats(s, q, op);
  return typed_out<T>(s, op, "stats");
}

// The backward's sixth input, the forward's stats (null where it has none).
template <class T>
const T* saved_lse(const KernelContext& ctx, const Tensor& q, const char* op) {
  if (ctx.inputs.size() < 6 || ctx.inputs[5] == nullptr) return nullptr;
  const Tensor& s = *ctx.inputs[5];
  detail::check_attention_stats(s, q, op);
  return typed<T>(s, op, "stats");
}

template <class T>
double dot(const T* a, const T* b, std::size_t d) {
  double s = 0;
  for (std::size_t c = 0; c < d; ++c) s += static_cast<double>(a[c]) * static_cast<double>(b[c]);
  return s;
}

// Query rows and keys per tile of the forward: a tile's scores are query_block x key_block
// doubles, and the running outputs query_block x D.
constexpr std::size_t query_block = 32;
constexpr std::size_t key_block = 64;

template <class T>
class AttentionKernel final : public Kernel {
 public:
  explicit AttentionKernel(AttentionAttrs attrs) : attrs_(attrs) {}

  void compute(KernelContext& ctx) override {
    const char* op = "attention";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    Tensor& o = need_output(ctx, 0, op, "o");
    const AttentionDims a = detail::attention_dims(q, k, v, op);
    if (o.shape() != q.shape()) {
      throw std::invalid_argument(fmt::format("{}: o {} must have q's shape {}", op, o.describe(), to_string(q.shape())));
    }
    const T* qp = typed<T>(q, op, "q");
    const T* kp = typed<T>(k, op, "k");
    const T* vp = typed<T>(v, op, "v");
    T* op_out = typed_out<T>(o, op, "o");
    T* lse = saved_stats<T>(ctx, q, op);
    const auto t = static_cast<std::size_t>(a.t), d = static_cast<std::size_t>(a.d);
    const double scale = attrs_.scale_for(a.d);
    scores_.resize(key_block);
    acc_.resize(query_block * d);
    max_.resize(query_block);
    sum_.resize(query_block);
    for (std::int64_t h = 0; h < a.heads; ++h) {
      const std::size_t base = static_cast<std::size_t>(h) * t * d;
      const std::size_t kv = static_cast<std::size_t>(h / a.group()) * t * d;  // its key and value head
      for (std::size_t i0 = 0; i0 < t; i0 += query_block) {
        const std::size_t rows = std::min(query_block, t - i0);
        std::fill(acc_.begin(), acc_.begin() + static_cast<std::ptrdiff_t>(rows * d), 0.0);
        std::fill(max_.begin(), max_.end(), -std::numeric_limits<double>::infinity());
        std::fill(sum_.begin(), sum_.end(), 0.0);
        const std::size_t key_end = attrs_.causal ? std::min(t, i0 + rows) : t;
        for (std::size_t j0 = 0; j0 < key_end; j0 += key_block) {
          const std::size_t cols = std::min(key_block, key_end - j0);
          for (std::size_t r = 0; r < rows; ++r) {
            tile_row(qp + base + (i0 + r) * d, kp + kv, vp + kv, i0 + r, j0, cols, d, scale, r);
          }
        }
        for (std::size_t r = 0; r < rows; ++r) {
          T* out = op_out + base + (i0 + r) * d;
          for (std::size_t c = 0; c < d; ++c) out[c] = static_cast<T>(acc_[r * d + c] / sum_[r]);
          if (lse != nullptr) lse[static_cast<std::size_t>(h) * t + i0 + r] = static_cast<T>(max_[r] + std::log(sum_[r]));
        }
      }
    }
  }

 private:
  // Row r of the query block (query i) against keys [j0, j0 + cols): the online softmax step.
  void tile_row(const T* qi, const T* k, const T* v, std::size_t i, std::size_t j0, std::size_t cols, std::size_t d,
                double scale, std::size_t r) {
    // Causal: keys after i are hidden (none of this tile's if it starts past i).
    const std::size_t visible = attrs_.causal ? std::min(cols, i + 1 > j0 ? i + 1 - j0 : 0) : cols;
    if (visible == 0) return;
    double tile_max = -std::numeric_limits<double>::infinity();
    for (std::size_t c = 0; c < visible; ++c) {
      scores_[c] = scale * dot(qi, k + (j0 + c) * d, d);
      tile_max = std::max(tile_max, scores_[c]);
    }
    const double m = std::max(max_[r], tile_max);
    const double rescale = std::exp(max_[r] - m);  // exp(-inf) = 0 before the first key
    double* acc = acc_.data() + r * d;
    for (std::size_t c = 0; c < d; ++c) acc[c] *= rescale;
    double sum = sum_[r] * rescale;
    for (std::size_t c = 0; c < visible; ++c) {
      const double p = std::exp(scores_[c] - m);
      sum += p;
      const T* vj = v + (j0 + c) * d;
      for (std::size_t e = 0; e < d; ++e) acc[e] += p * static_cast<double>(vj[e]);
    }
    sum_[r] = sum;
    max_[r] = m;
  }

  AttentionAttrs attrs_;
  std::vector<double> scores_, acc_, max_, sum_;
};

template <class T>
class AttentionGradKernel final : public Kernel {
 public:
  explicit AttentionGradKernel(AttentionAttrs attrs) : attrs_(attrs) {}

  void compute(KernelContext& ctx) override {
    const char* op = "attention_grad";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    const Tensor& o = need_input(ctx, 3, op, "o");
    const Tensor& dout = need_input(ctx, 4, op, "do");
    const AttentionDims a = detail::attention_dims(q, k, v, op);
    if (o.shape() != q.shape() || dout.shape() != q.shape()) {
      throw std::invalid_argument(
          fmt::format("{}: o {} and do {} must have q's shape {}", op, o.describe(), dout.describe(), to_string(q.shape())));
    }
    const detail::AttentionGradOut out = detail::attention_grad_out(ctx, q, k, op);
    const T* qp = typed<T>(q, op, "q");
    const T* kp = typed<T>(k, op, "k");
    const T* vp = typed<T>(v, op, "v");
    const T* opp = typed<T>(o, op, "o");
    const T* dop = typed<T>(dout, op, "do");
    const T* saved = saved_lse<T>(ctx, q, op);
    T* const dq_out = static_cast<T*>(out.dq);
    T* const dk_out = static_cast<T*>(out.dk);
    T* const dv_out = static_cast<T*>(out.dv);
    const auto ld = static_cast<std::size_t>(out.ld);
    const auto t = static_cast<std::size_t>(a.t), d = static_cast<std::size_t>(a.d);
    const double scale = attrs_.scale_for(a.d);
    lse_.resize(t);
    delta_.resize(t);
    dq_.resize(t * d);
    dk_.resize(t * d);
    dv_.resize(t * d);
    // Row i of head h of an output: side by side in [..., T, 3 D], or in tensors of their own.
    auto write = [&](T* to, std::int64_t h, const std::vector<double>& from) {
      const std::size_t head = static_cast<std::size_t>(h) * t * ld;
      for (std::size_t i = 0; i < t; ++i) {
        for (std::size_t c = 0; c < d; ++c) to[head + i * ld + c] = static_cast<T>(from[i * d + c]);
      }
    };
    // Per key and value head, its query heads in turn: dk and dv add up over them (in double,
    // rounded once), as the repeated heads' gradients summed.
    for (std::int64_t hk = 0; hk < a.kv_heads; ++hk) {
      const std::size_t kv = static_cast<std::size_t>(hk) * t * d;
      const T *kh = kp + kv, *vh = vp + kv;
      std::fill(dk_.begin(), dk_.end(), 0.0);
      std::fill(dv_.begin(), dv_.end(), 0.0);
      for (std::int64_t h = hk * a.group(); h < (hk + 1) * a.group(); ++h) {
        const std::size_t base = static_cast<std::size_t>(h) * t * d;
        const T *qh = qp + base, *oh = opp + base, *doh = dop + base;
        row_statistics(qh, kh, oh, doh, t, d, scale, saved == nullptr ? nullptr : saved + static_cast<std::size_t>(h) * t);
        std::fill(dq_.begin(), dq_.end(), 0.0);
        for (std::size_t i = 0; i < t; ++i) {
          const std::size_t end = attrs_.causal ? i + 1 : t;
          const T* qi = qh + i * d;
          const T* doi = doh + i * d;
          double* dqi = dq_.data() + i * d;
          for (std::size_t j = 0; j < end; ++j) {
            const T* kj = kh + j * d;
            const T* vj = vh + j * d;
            const double p = std::exp(scale * dot(qi, kj, d) - lse_[i]);
            const double ds = p * (dot(doi, vj, d) - delta_[i]) * scale;
            double* dkj = dk_.data() + j * d;
            double* dvj = dv_.data() + j * d;
            for (std::size_t c = 0; c < d; ++c) {
              dvj[c] += p * static_cast<double>(doi[c]);
              dqi[c] += ds * static_cast<double>(kj[c]);
              dkj[c] += ds * static_cast<double>(qi[c]);
            }
          }
        }
        write(dq_out, h, dq_);
      }
      write(dk_out, hk, dk_);
      write(dv_out, hk, dv_);
    }
  }

 private:
  // lse_i = log sum_j exp(scale q_i . k_j) over the keys query i sees (the forward's, else
  // online, one pass), and D_i = do_i . o_i.
  void row_statistics(const T* qh, const T* kh, const T* oh, const T* doh, std::size_t t, std::size_t d, double scale,
                      const T* saved) {
    for (std::size_t i = 0; i < t; ++i) {
      delta_[i] = dot(doh + i * d, oh + i * d, d);
      if (saved != nullptr) {
        lse_[i] = static_cast<double>(saved[i]);
        continue;
      }
      const std::size_t end = attrs_.causal ? i + 1 : t;
      double m = -std::numeric_limits<double>::infinity(), l = 0;
      for (std::size_t j = 0; j < end; ++j) {
        const double s = scale * dot(qh + i * d, kh + j * d, d);
        if (s > m) {
          l = l * std::exp(m - s) + 1.0;
          m = s;
        } else {
          l += std::exp(s - m);
        }
      }
      lse_[i] = m + std::log(l);
    }
  }

  AttentionAttrs attrs_;
  std::vector<double> lse_, delta_, dq_, dk_, dv_;
};

// The CPU has one implementation: kernel cudnn asks for what only a CUDA device has.
AttentionAttrs cpu_attrs(const KernelConfig& cfg, const char* op) {
  AttentionAttrs a = AttentionAttrs::read(cfg.attrs, cfg.actor, op);
  if (a.kernel == AttentionAttrs::Kernel::cudnn) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): kernel cudnn (--attention cudnn) needs a CUDA device; "
                                            "{} is a CPU", op, cfg.actor, cfg.device.str()));
  }
  return a;
}

template <class T>
void add_attention_for(KernelRegistry& reg) {
  constexpr DType dt = dtype_of<T>();
  reg.add("attention", DeviceType::cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionKernel<T>>(cpu_attrs(cfg, "attention"));
  });
  reg.add("attention_grad", DeviceType::cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionGradKernel<T>>(cpu_attrs(cfg, "attention_grad"));
  });
}

}  // namespace

std::string attention_kv_mismatch(const Shape& q, const Shape& k) {
  if (k == q) return {};
  if (q.size() < 3 || k.size() != q.size()) {
    return "k and v must have q's shape [..., T, D], or [..., Hkv, T, D] with Hkv heads that divide q's "
           "(grouped-query heads)";
  }
  const std::size_t h = q.size() - 3;
  for (std::size_t i = 0; i < q.size(); ++i) {
    if (i != h && k[i] != q[i]) {
      return "k and v may differ from q only in their heads (axis -3, grouped-query heads), not on another axis";
    }
  }
  if (k[h] > q[h]) return fmt::format("k and v have more heads ({}) than q ({})", k[h], q[h]);
  if (k[h] < 1 || q[h] % k[h] != 0) {
    return fmt::format("q's {} heads are not a multiple of k's and v's {} (each key and value head serves H / Hkv "
                       "query heads)",
                       q[h], k[h]);
  }
  return {};
}

Shape attention_grad_shape(const Shape& q, const Shape& k) {
  if (k != q) return {detail::product(q, 0, q.size()) + 2 * detail::product(k, 0, k.size())};
  Shape s = q;
  if (!s.empty()) s.back() *= 3;
  return s;
}

void add_cpu_attention_ops(KernelRegistry& reg) {
  add_attention_for<float>(reg);
  add_attention_for<double>(reg);
}

}  // namespace baton
