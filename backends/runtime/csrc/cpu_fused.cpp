// The runtime's fused elementwise CPU ops (built with cpu_ops.cpp into one library by
// backends/runtime/cpu_kernels.py). Each does in one pass over its rows what several ATen ops
// do one after the other; at decode batch sizes the dispatch of those small ops costs more than
// their arithmetic. The arithmetic is the unfused torch code's: float32 math, and in a bfloat16
// or float16 model each intermediate is rounded to the model dtype where torch rounds it (no
// fused multiply-adds either), so results equal torch's up to the summation order of the norm.
//
// torch.ops.pd_runtime.
//   rms_norm(x [T, D], w [D], eps) -> x * rsqrt(mean(x^2) + eps) * w    [T, D]
//   add_rms_norm(x [T, D], delta [T, D], w, eps) -> (x + delta, rms_norm(x + delta, w, eps))
//   silu_mul(gate_up [T, 2I]) -> silu(gate_up[:, :I]) * gate_up[:, I:]  [T, I]
//   rope_write_kv(qkv [T, (H + 2 Hkv) D], cos [P, D/2], sin [P, D/2], positions [T],
//                 slots [T], k_cache [S, Hkv, D], v_cache [S, Hkv, D], H, Hkv)
//     -> (q [T, H, D], k [T, Hkv, D]): q and k rotated (rotate-half style) at their positions;
//     k and v written to their pool slots. Every position and slot is checked before any write.
#pragma GCC optimize("fp-contract=off")  // a * b - c * d rounds like ATen's separate ops

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "vec.h"

namespace {

using namespace pd;

// Rows per task of at::parallel_for: a decode batch (a few rows) stays on the calling thread.
constexpr int64_t kGrainElements = 32768;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / row_elements); }

// x rounded to the model dtype T and back (a no-op for float32).
template <typename T>
PD_INLINE float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// Each lane's bfloat16 bits (low half), rounded as c10::BFloat16 rounds a float: to nearest
// even, NaN to 0x7fc0. Integer vector ops: 8 lanes at once, where the scalar cast is a branch
// and a call per element.
PD_INLINE u32x8 bf16_bits8(v8 x) {
  u32x8 b;
  __builtin_memcpy(&b, &x, sizeof b);
  const u32x8 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  u32x8 nan;
  const i8 is_nan = x != x;
  __builtin_memcpy(&nan, &is_nan, sizeof nan);
  return (rounded & ~nan) | (nan & 0x7fc0u);
}

template <typename T>
PD_INLINE v8 load8_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load8(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return load8(p);
  } else {
    v8 r;
    for (int j = 0; j < 8; ++j) r[j] = static_cast<float>(p[j]);
    return r;
  }
}

// One row: y = rnd(x * inv) * w with inv = 1 / sqrt(mean(x^2) + eps).
template <typename T>
PD_INLINE void rms_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  v8 acc = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const v8 v = load8_as_float(x + d);
    acc += v * v;
  }
  float ss = sum8(acc);
  for (; d < D; ++d) ss += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d)
    y[d] = static_cast<T>(rnd<T>(static_cast<float>(x[d]) * inv) * static_cast<float>(w[d]));
}

template <typename T>
PD_MULTIVERSION void rms_rows(const T* x, int64_t xs, const T* delta, int64_t ds, const T* w,
                              T* sum, T* y, int64_t begin, int64_t end, int64_t D, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * xs;
    if (delta != nullptr) {  // sum = x + delta, normalised
      const T* dr = delta + r * ds;
      T* sr = sum + r * D;
      for (int64_t d = 0; d < D; ++d)
        sr[d] = static_cast<T>(static_cast<float>(xr[d]) + static_cast<float>(dr[d]));
      xr = sr;
    }
    rms_row(xr, w, y + r * D, D, eps);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, D] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), op,
              ": weight must be [D], contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": x and weight dtypes differ");
}

std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x, const at::Tensor* delta,
                                             const at::Tensor& w, double eps, const char* op) {
  check_rows(x, w, op);
  const int64_t rows = x.size(0), D = x.size(1);
  auto y = at::empty({rows, D}, x.options());
  auto sum = delta != nullptr ? at::empty({rows, D}, x.options()) : at::Tensor();
  if (delta != nullptr) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->stride(1) == 1, op,
                ": delta must be shaped like x, with contiguous rows");
    TORCH_CHECK(delta->scalar_type() == x.scalar_type(), op, ": x and delta dtypes differ");
  }
  dispatch_float_types(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* dp = delta != nullptr ? delta->data_ptr<T>() : nullptr;
    const int64_t ds = delta != nullptr ? delta->stride(0) : 0;
    T* sp = delta != nullptr ? sum.data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, grain(D), [&](int64_t begin, int64_t end) {
      rms_rows<T>(x.data_ptr<T>(), x.stride(0), dp, ds, w.data_ptr<T>(), sp, y.data_ptr<T>(),
                  begin, end, D, static_cast<float>(eps));
    });
  });
  return {sum, y};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return std::get<1>(norm_impl(x, nullptr, w, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& w, double eps) {
  return norm_impl(x, &delta, w, eps, "add_rms_norm");
}

// silu(g) = g / (1 + e^-g), from e = e^-|g| <= 1 (so the exponential never overflows):
// g / (1 + e) for g >= 0, g * e / (1 + e) below.
template <typename V>
PD_INLINE V siluv(V g) {
  const auto neg = g < 0.f;
  const V e = expv(neg ? g : -g);
  const V num = neg ? g * e : g;
  return num / (1.f + e);
}

template <typename T>
PD_INLINE v8 round8(v8 x) {  // each lane rounded to T (a no-op for float32)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const u32x8 bits = bf16_bits8(x) << 16;
    __builtin_memcpy(&x, &bits, sizeof x);
  } else if constexpr (!std::is_same_v<T, float>) {
    for (int j = 0; j < 8; ++j) x[j] = rnd<T>(x[j]);
  }
  return x;
}

template <typename T>
PD_INLINE void store8_as(T* p, v8 x) {
  if constexpr (std::is_same_v<T, float>) {
    store8(p, x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const u16x8 h = __builtin_convertvector(bf16_bits8(x), u16x8);
    __builtin_memcpy(p, &h, sizeof h);
  } else {
    for (int j = 0; j < 8; ++j) p[j] = static_cast<T>(x[j]);
  }
}

// Row r's outputs [i, I): o = silu(g) * u.
template <typename T>
PD_INLINE void silu_mul_row(const T* g, const T* u, T* o, int64_t i, int64_t I) {
  for (; i + 8 <= I; i += 8) {
    const v8 s = round8<T>(siluv(load8_as_float(g + i)));
    store8_as(o + i, s * load8_as_float(u + i));
  }
  for (; i < I; ++i) {
    const float gf = static_cast<float>(g[i]);
    o[i] = static_cast<T>(rnd<T>(gf / (1.f + std::exp(-gf))) * static_cast<float>(u[i]));
  }
}

template <typename T>
PD_MULTIVERSION void silu_mul_rows(const T* __restrict__ gu, T* __restrict__ out, int64_t begin,
                                   int64_t end, int64_t I) {
  for (int64_t r = begin; r < end; ++r)
    silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, 0, I);
}

// float32 on 16-float vectors (wide_cpu()), twice as fast: the same operations a lane, so the
// same bits.
PD_WIDE void silu_mul_rows_wide(const float* __restrict__ gu, float* __restrict__ out,
                                int64_t begin, int64_t end, int64_t I) {
  for (int64_t r = begin; r < end; ++r) {
    const float *g = gu + r * 2 * I, *u = g + I;
    float* o = out + r * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) storev(o + i, siluv(loadv<v16>(g + i)) * loadv<v16>(u + i));
    silu_mul_row(g, u, o, i, I);
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using S = decltype(tag);
    at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<S, float>) {
        if (wide_cpu())
          return silu_mul_rows_wide(gate_up.data_ptr<float>(), out.data_ptr<float>(), begin,
                                    end, I);
      }
      silu_mul_rows<S>(gate_up.data_ptr<S>(), out.data_ptr<S>(), begin, end, I);
    });
  });
  return out;
}

// Rotate-half rotation of one head x [D] by (c, s) [D/2] into o:
// o[j] = x[j] c[j] - x[j + h] s[j], o[j + h] = x[j + h] c[j] + x[j] s[j], each product and
// sum rounded to T.
template <typename T>
PD_INLINE void rotate(const T* x, const T* c, const T* s, T* o, int64_t half) {
  int64_t j = 0;
  for (; j + 8 <= half; j += 8) {
    const v8 x1 = load8_as_float(x + j), x2 = load8_as_float(x + j + half);
    const v8 cj = load8_as_float(c + j), sj = load8_as_float(s + j);
    store8_as(o + j, round8<T>(x1 * cj) - round8<T>(x2 * sj));
    store8_as(o + j + half, round8<T>(x2 * cj) + round8<T>(x1 * sj));
  }
  for (; j < half; ++j) {
    const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
    const float cj = static_cast<float>(c[j]), sj = static_cast<float>(s[j]);
    o[j] = static_cast<T>(rnd<T>(x1 * cj) - rnd<T>(x2 * sj));
    o[j + half] = static_cast<T>(rnd<T>(x2 * cj) + rnd<T>(x1 * sj));
  }
}

struct RopeShapes {
  int64_t H, Hkv, D, row;  // row: qkv row length (H + 2 Hkv) D
};

template <typename T>
PD_MULTIVERSION void rope_rows(const RopeShapes& z, const T* qkv, const T* cos, const T* sin,
                               const int64_t* pos, const int64_t* slots, T* kc, T* vc, T* q,
                               T* k, int64_t begin, int64_t end) {
  const int64_t D = z.D, half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* x = qkv + t * z.row;
    const T* c = cos + pos[t] * half;
    const T* s = sin + pos[t] * half;
    for (int64_t h = 0; h < z.H; ++h) rotate(x + h * D, c, s, q + (t * z.H + h) * D, half);
    T* kdst = kc + slots[t] * z.Hkv * D;
    T* vdst = vc + slots[t] * z.Hkv * D;
    for (int64_t h = 0; h < z.Hkv; ++h) {
      T* kt = k + (t * z.Hkv + h) * D;
      rotate(x + (z.H + h) * D, c, s, kt, half);
      for (int64_t d = 0; d < D; ++d) kdst[h * D + d] = kt[d];
    }
    const T* v = x + (z.H + z.Hkv) * D;
    for (int64_t d = 0; d < z.Hkv * D; ++d) vdst[d] = v[d];
  }
}

void check_rope_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& pos, const at::Tensor& slots, const at::Tensor& kc,
                     const at::Tensor& vc, int64_t H, int64_t Hkv) {
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0, "rope_write_kv: bad head counts");
  TORCH_CHECK(kc.dim() == 3 && kc.is_contiguous() && vc.is_contiguous() &&
                  vc.sizes() == kc.sizes() && kc.size(1) == Hkv,
              "rope_write_kv: caches must be contiguous [S, Hkv, D], alike");
  const int64_t D = kc.size(2), T = qkv.size(0);
  TORCH_CHECK(D % 2 == 0, "rope_write_kv: head size must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * Hkv) * D,
              "rope_write_kv: qkv must be contiguous [T, (H + 2 Hkv) D]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) * 2 == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rope_write_kv: cos and sin must be contiguous [P, D/2]");
  for (const auto* t : {&cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rope_write_kv: dtypes differ");
  TORCH_CHECK(pos.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  pos.numel() == T && slots.numel() == T && pos.is_contiguous() &&
                  slots.is_contiguous(),
              "rope_write_kv: positions and slots must be contiguous int64 [T]");
  const int64_t *pp = pos.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // all checked before the first write
    TORCH_CHECK(0 <= pp[t] && pp[t] < cos.size(0), "rope_write_kv: position ", pp[t],
                " outside [0, ", cos.size(0), ")");
    TORCH_CHECK(0 <= sp[t] && sp[t] < kc.size(0), "rope_write_kv: slot ", sp[t],
                " outside [0, ", kc.size(0), ")");
  }
}

std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& pos,
                                                 const at::Tensor& slots, at::Tensor k_cache,
                                                 at::Tensor v_cache, int64_t H, int64_t Hkv) {
  check_rope_args(qkv, cos, sin, pos, slots, k_cache, v_cache, H, Hkv);
  const RopeShapes z{H, Hkv, k_cache.size(2), qkv.size(1)};
  const int64_t T = qkv.size(0);
  auto q = at::empty({T, H, z.D}, qkv.options());
  auto k = at::empty({T, Hkv, z.D}, qkv.options());
  dispatch_float_types(qkv.scalar_type(), "rope_write_kv", [&](auto tag) {
    using S = decltype(tag);
    at::parallel_for(0, T, grain(z.row), [&](int64_t begin, int64_t end) {
      rope_rows<S>(z, qkv.data_ptr<S>(), cos.data_ptr<S>(), sin.data_ptr<S>(),
                   pos.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), k_cache.data_ptr<S>(),
                   v_cache.data_ptr<S>(), q.data_ptr<S>(), k.data_ptr<S>(), begin, end);
    });
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_runtime, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slots, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int num_heads, int num_kv_heads) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pd_runtime, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_write_kv", &rope_write_kv);
}
