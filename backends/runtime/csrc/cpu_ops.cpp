// The runtime's CPU kernels (built and loaded by backends/runtime/cpu_kernels.py).
//
// torch.ops.pd_runtime.paged_decode: decode attention, one query token per sequence, keys and
// values read in place from the KV pool's slots (no gathered copy of the context), float32
// accumulation.
//   q      [B, Hkv, G, Dk]  the G query heads that share each KV head, contiguous
//   k      [S, Hkv, Dk]     flat pool slots of one layer (last dim contiguous)
//   v      [S, Hkv, Dv]     may be a view of k (MLA: the latent's first Dv channels)
//   slots  [B, L] int64     each sequence's context slots, padded to the longest
//   lo, hi [B] int64        sequence b attends to keys [lo_b, hi_b) of its row of slots
//   sinks  [Hkv * G] float32 or None: a sink logit per query head, in every softmax's
//                           denominator and with no value (gpt-oss)
//   -> out [B, Hkv, G, Dv]  in q's dtype
// k and v are in q's dtype or float8_e4m3fn (an fp8 pool: rows widened through a 256-entry
// table as they are read; the caller folds the K scale into `scale` and applies the V scale).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace pd;

using Fp8 = c10::Float8_e4m3fn;

const std::array<float, 256> kFp8Table = [] {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i)
    t[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
  return t;
}();

// One cache element as float32.
template <typename C>
PD_INLINE float to_f(C x) {
  if constexpr (std::is_same_v<C, Fp8>) {
    return kFp8Table[x.x];
  } else {
    return static_cast<float>(x);
  }
}

// Row of a cache as float32: the row itself, or converted into buf.
template <typename C>
PD_INLINE const float* as_float(const C* row, int64_t n, float* buf) {
  if constexpr (std::is_same_v<C, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = to_f(row[d]);
    return buf;
  }
}

// Rows are scattered over pages: ask for row l + ahead while row l is computed, far enough
// ahead to cover a memory round trip (a key row costs more work than a value line).
constexpr int64_t kKeyAhead = 8, kValueAhead = 32;

template <typename T>
PD_INLINE void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, 1);
}

// Scores of GT query heads against rows row[0:n] of one KV head: score[g * n + l] =
// q_g . k_row(l). Each key row is loaded once, chunk by chunk (V: 8 or 16 floats), for the GT
// heads.
template <int GT, typename V, typename T>
PD_INLINE void score_rows(const float* qf, int64_t Dk, const T* kp, int64_t ks0,
                          const int64_t* row, int64_t n, float* score, float* buf) {
  constexpr int VW = sizeof(V) / sizeof(float);
  for (int64_t l = 0; l < n; ++l) {
    if (l + kKeyAhead < n) prefetch(kp + row[l + kKeyAhead] * ks0, Dk);
    const float* kr = as_float(kp + row[l] * ks0, Dk, buf);
    V acc[GT] = {};
    int64_t d = 0;
    for (; d + VW <= Dk; d += VW) {
      const V kc = loadv<V>(kr + d);
      for (int g = 0; g < GT; ++g) acc[g] += loadv<V>(qf + g * Dk + d) * kc;
    }
    for (int g = 0; g < GT; ++g) {
      float s = sumv(acc[g]);
      for (int64_t t = d; t < Dk; ++t) s += qf[g * Dk + t] * kr[t];
      score[g * n + l] = s;
    }
  }
}

// out[g, c0 : c0 + VW * CW] = sum_l p[g * n + l] * v_row(l)[c0 : ...] for GT heads: the
// accumulators stay in registers for the whole context; each pass reads CW vectors of every
// value row (16 floats with 8-float vectors, 64 with 16-float ones: a row of 64 in one pass).
template <int GT, int CW, typename V, typename T>
PD_INLINE void value_chunk(const float* p, const T* vp, int64_t vs0, const int64_t* row,
                           int64_t n, int64_t c0, float* out, int64_t Dv) {
  constexpr int VW = sizeof(V) / sizeof(float);
  V acc[GT][CW] = {};
  for (int64_t l = 0; l < n; ++l) {
    if (l + kValueAhead < n) prefetch(vp + row[l + kValueAhead] * vs0 + c0, VW * CW);
    const T* vr = vp + row[l] * vs0 + c0;
    V vc[CW];
    for (int c = 0; c < CW; ++c) {
      if constexpr (std::is_same_v<T, float>) {
        vc[c] = loadv<V>(vr + VW * c);
      } else {
        for (int j = 0; j < VW; ++j) vc[c][j] = to_f(vr[VW * c + j]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      const float pg = p[g * n + l];
      for (int c = 0; c < CW; ++c) acc[g][c] += pg * vc[c];
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CW; ++c) storev(out + g * Dv + c0 + VW * c, acc[g][c]);
}

// All Dv channels of GT heads: wide chunks, then one vector, then (16-float vectors) 8 floats,
// then one by one.
template <int GT, typename V, typename T>
PD_INLINE void value_rows(const float* p, const T* vp, int64_t vs0, const int64_t* row,
                          int64_t n, float* out, int64_t Dv) {
  constexpr int VW = sizeof(V) / sizeof(float), CW = VW == 8 ? 2 : 4;
  int64_t c0 = 0;
  if constexpr (GT <= 4) {
    for (; c0 + VW * CW <= Dv; c0 += VW * CW)
      value_chunk<GT, CW, V>(p, vp, vs0, row, n, c0, out, Dv);
  }
  for (; c0 + VW <= Dv; c0 += VW) value_chunk<GT, 1, V>(p, vp, vs0, row, n, c0, out, Dv);
  if constexpr (VW > 8) {
    for (; c0 + 8 <= Dv; c0 += 8) value_chunk<GT, 1, v8>(p, vp, vs0, row, n, c0, out, Dv);
  }
  for (; c0 < Dv; ++c0)
    for (int g = 0; g < GT; ++g) {
      float s = 0.f;
      for (int64_t l = 0; l < n; ++l) s += p[g * n + l] * to_f(vp[row[l] * vs0 + c0]);
      out[g * Dv + c0] = s;
    }
}

template <int GT, typename V, typename T, typename C>
PD_INLINE void attend_tile(const float* qf, int64_t Dk, int64_t Dv, const C* kp, int64_t ks0,
                           const C* vp, int64_t vs0, const int64_t* row, int64_t n,
                           float* score, float* buf, float* acc, const float* sink, T* out) {
  score_rows<GT, V>(qf, Dk, kp, ks0, row, n, score, buf);
  float total[GT];
  for (int g = 0; g < GT; ++g) {  // softmax numerators in place (the queries came scaled)
    float mx = row_max<V>(score + g * n, n);
    if (sink != nullptr) mx = std::max(mx, sink[g]);
    total[g] = exp_sum<V>(score + g * n, n, 1.f, mx);
    if (sink != nullptr) total[g] += std::exp(sink[g] - mx);  // the sink's share: no value
  }
  value_rows<GT, V>(score, vp, vs0, row, n, acc, Dv);
  for (int g = 0; g < GT; ++g)
    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = static_cast<T>(acc[g * Dv + d] / total[g]);
}

struct Shapes {
  int64_t Hkv, G, Dk, Dv, L, S, ks0, ks1, vs0, vs1;
};

// One (sequence, KV head): G queries over keys row[0:n], in tiles of up to 4 query heads.
// qf: the G scaled queries [G, Dk]; score: room for [4, n]; acc: [4, Dv]; buf: [max(Dk, Dv)];
// sink: the G heads' sink logits, or nullptr -> out [G, Dv].
template <typename V, typename T, typename C>
PD_INLINE void attend_heads(const Shapes& z, const float* qf, const C* kp, const C* vp,
                            const int64_t* row, int64_t n, float* score, float* acc,
                            float* buf, const float* sink, T* out) {
  const int64_t Dk = z.Dk, Dv = z.Dv;
  for (int64_t g = 0; g < z.G; g += 4) {
    const float* q = qf + g * Dk;
    const float* s = sink == nullptr ? nullptr : sink + g;
    T* o = out + g * Dv;
    const int64_t ks0 = z.ks0, vs0 = z.vs0;
    switch (std::min<int64_t>(z.G - g, 4)) {
      case 4: attend_tile<4, V>(q, Dk, Dv, kp, ks0, vp, vs0, row, n, score, buf, acc, s, o); break;
      case 3: attend_tile<3, V>(q, Dk, Dv, kp, ks0, vp, vs0, row, n, score, buf, acc, s, o); break;
      case 2: attend_tile<2, V>(q, Dk, Dv, kp, ks0, vp, vs0, row, n, score, buf, acc, s, o); break;
      default: attend_tile<1, V>(q, Dk, Dv, kp, ks0, vp, vs0, row, n, score, buf, acc, s, o);
    }
  }
}

template <typename T, typename C>
PD_MULTIVERSION void attend_one(const Shapes& z, const float* qf, const C* kp, const C* vp,
                                const int64_t* row, int64_t n, float* score, float* acc,
                                float* buf, const float* sink, T* out) {
  attend_heads<v8>(z, qf, kp, vp, row, n, score, acc, buf, sink, out);
}

// The same on 16-float vectors, for CPUs with AVX-512 (wide_cpu()).
template <typename T, typename C>
PD_WIDE void attend_one_wide(const Shapes& z, const float* qf, const C* kp, const C* vp,
                             const int64_t* row, int64_t n, float* score, float* acc,
                             float* buf, const float* sink, T* out) {
  attend_heads<v16>(z, qf, kp, vp, row, n, score, acc, buf, sink, out);
}

template <typename T, typename C>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& slots, const at::Tensor& lo, const at::Tensor& hi, double scale,
            const float* sinks, at::Tensor& out) {
  const Shapes z{q.size(1),   q.size(2),   q.size(3),   v.size(2),   slots.size(1),
                 k.size(0),   k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  const int64_t B = q.size(0), G = z.G, Dk = z.Dk, Dv = z.Dv;
  const T* qp = q.data_ptr<T>();
  const C* kp = reinterpret_cast<const C*>(k.data_ptr());
  const C* vp = reinterpret_cast<const C*>(v.data_ptr());
  T* op = out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* hip = hi.data_ptr<int64_t>();
  const bool wide = wide_cpu();
  at::parallel_for(0, B * z.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * Dk), acc(4 * Dv), buf(std::max(Dk, Dv)), score;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / z.Hkv, h = bh % z.Hkv;
      for (int64_t i = 0; i < G * Dk; ++i)
        qf[i] = static_cast<float>(qp[bh * G * Dk + i]) * static_cast<float>(scale);
      score.resize(4 * (hip[b] - lop[b]));
      auto one = wide ? attend_one_wide<T, C> : attend_one<T, C>;
      const float* sink = sinks == nullptr ? nullptr : sinks + h * G;
      one(z, qf.data(), kp + h * z.ks1, vp + h * z.vs1, sp + b * z.L + lop[b], hip[b] - lop[b],
          score.data(), acc.data(), buf.data(), sink, op + bh * G * Dv);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& slots, const at::Tensor& lo, const at::Tensor& hi,
                        double scale, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.dim() == 3, "paged_decode: bad ranks");
  TORCH_CHECK(q.is_contiguous(), "paged_decode: q must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "paged_decode: channels must be contiguous");
  const bool fp8 = k.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (fp8 || k.scalar_type() == q.scalar_type()),
              "paged_decode: k and v must be in q's dtype or both float8_e4m3fn");
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(2) == q.size(3),
              "paged_decode: head shapes differ");
  TORCH_CHECK(v.size(0) == k.size(0), "paged_decode: k and v slot counts differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lo.scalar_type() == at::kLong &&
                  hi.scalar_type() == at::kLong,
              "paged_decode: slots, lo, hi must be int64");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && slots.is_contiguous(),
              "paged_decode: slots must be contiguous [B, L]");
  TORCH_CHECK(lo.numel() == q.size(0) && hi.numel() == q.size(0), "paged_decode: lo/hi [B]");
  auto lo_c = lo.contiguous(), hi_c = hi.contiguous();
  const int64_t B = q.size(0), L = slots.size(1), S = k.size(0);
  const int64_t *lop = lo_c.data_ptr<int64_t>(), *hip = hi_c.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // every slot a sequence reads is inside the pool
    TORCH_CHECK(0 <= lop[b] && lop[b] < hip[b] && hip[b] <= L, "paged_decode: sequence ", b,
                " keys [", lop[b], ", ", hip[b], ") not inside [0, ", L, ")");
    for (int64_t l = lop[b]; l < hip[b]; ++l)
      TORCH_CHECK(0 <= sp[b * L + l] && sp[b * L + l] < S, "paged_decode: slot ",
                  sp[b * L + l], " outside [0, ", S, ")");
  }
  at::Tensor sinks_c;
  if (sinks.has_value()) {
    sinks_c = sinks->contiguous();
    TORCH_CHECK(sinks_c.scalar_type() == at::kFloat && sinks_c.numel() == q.size(1) * q.size(2),
                "paged_decode: sinks must be float32 [H]");
  }
  const float* sp_ = sinks.has_value() ? sinks_c.data_ptr<float>() : nullptr;
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(2)}, q.options());
  dispatch_float_types(q.scalar_type(), "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    if (fp8) {
      attend<T, Fp8>(q, k, v, slots, lo_c, hi_c, scale, sp_, out);
    } else {
      attend<T, T>(q, k, v, slots, lo_c, hi_c, scale, sp_, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pd_runtime, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lo, Tensor hi, "
        "float scale, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pd_runtime, CPU, m) { m.impl("paged_decode", &paged_decode); }
