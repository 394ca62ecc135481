// Linear layers for a few rows (decode): y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), with w in
// float32, bfloat16 or float16 (widened to float32 as it is loaded; float32 sums, one rounding
// of y).
//
// At decode a linear layer reads its whole weight to multiply it with a handful of rows, so
// the weight's trip from memory is the cost. Each task here streams a slice of w's rows from
// memory exactly once: a tile of NR rows of w is multiplied with all M rows of x (MR at a time,
// from L1/L2) before the next tile is read, with NR x MR independent 8-float accumulators
// (register blocking) so the FMA units never wait for each other. Threads split w's rows.
//
// Measured against oneDNN's packed sgemm and MKL on the 2-core AVX2 machine: see
// backends/runtime/kernels.py's docstring (the runtime runs this kernel up to SMALL_ROWS rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "vec.h"

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in the AVX2 clone

namespace {

// How many strips ahead the first tile of a strip prefetches w (measured: 1 -> 4 strips took
// the 30-layer projections at 8 rows from 30.8 to 28.6 ms; 8 strips, or prefetching into L2
// only, changed nothing).
constexpr int kAhead = 4;

using pd::i8;
using pd::load8;
using pd::sum8;
using pd::v8;


// IEEE half -> float with integer vector ops (no F16C needed, so both clones build): normal
// numbers re-bias the exponent, inf/NaN keep an all-ones exponent, subnormals are formed as
// 2^-14 * (1 + m / 1024) and then 2^-14 subtracted (exact).
PD_INLINE v8 load8(const c10::Half* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  u16x8 h;
  __builtin_memcpy(&h, p, sizeof h);
  const i8 x = __builtin_convertvector(h, i8);
  const i8 sign = (x & 0x8000) << 16;
  i8 o = (x & 0x7fff) << 13;
  const i8 e = o & (0x7c00 << 13);
  o += (127 - 15) << 23;
  o = e == (0x7c00 << 13) ? o + ((128 - 16) << 23) : o;
  const i8 sub_bits = o + (1 << 23);
  v8 sub, norm;
  __builtin_memcpy(&sub, &sub_bits, sizeof sub);
  __builtin_memcpy(&norm, &o, sizeof norm);
  sub = sub - 6.103515625e-05f;  // 2^-14
  const v8 mag = e == 0 ? sub : norm;
  i8 bits;
  __builtin_memcpy(&bits, &mag, sizeof bits);
  bits |= sign;
  v8 r;
  __builtin_memcpy(&r, &bits, sizeof r);
  return r;
}

using pd::sumv;
using pd::v16;

// A weight vector: 16 float32 or bfloat16 weights (the AVX-512 variant), or 8 of any dtype.
template <typename V, typename W>
PD_INLINE V wload(const W* p) {
  if constexpr (sizeof(V) == sizeof(v16) && std::is_same_v<W, c10::BFloat16>) {
    const v8 lo = load8(p), hi = load8(p + 8);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  } else if constexpr (sizeof(V) == sizeof(v16)) {
    return pd::loadv<v16>(p);
  } else {
    return load8(p);
  }
}

template <typename W>
struct Problem {
  const float* x;  // [M, K], row stride ldx
  const W* w;  // [N, K] contiguous
  const float* bias;  // [N] or null
  float* y;  // [M, N] contiguous
  int64_t M, N, K, ldx;
};

// y[m0 : m0 + MR, n0 : n0 + NR]: every w row of the tile is read once per call. PF (the first
// tile of a strip): also prefetch the rows kAhead strips on, so memory streams while this
// strip computes.
template <int NR, int MR, bool PF, typename V, typename W>
PD_INLINE void tile(const Problem<W>& p, int64_t n0, int64_t m0) {
  constexpr int VW = sizeof(V) / sizeof(float);
  V acc[NR][MR] = {};
  const W* w = p.w + n0 * p.K;
  const float* x = p.x + m0 * p.ldx;
  int64_t k = 0;
  for (; k + VW <= p.K; k += VW) {
    if constexpr (PF) {
      if (k % (64 / sizeof(W)) == 0) {  // once per 64-byte line
        for (int r = 0; r < NR; ++r) __builtin_prefetch(w + (kAhead * NR + r) * p.K + k);
      }
    }
    V wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = wload<V>(w + r * p.K + k);
    for (int m = 0; m < MR; ++m) {
      V xv = wload<V>(x + m * p.ldx + k);
      if constexpr (sizeof(V) == sizeof(v16)) asm("" : "+v"(xv));  // one load, not NR folded
      for (int r = 0; r < NR; ++r) acc[r][m] += wv[r] * xv;
    }
  }
  for (int r = 0; r < NR; ++r) {
    float sums[MR];
    if constexpr (MR == 8 && sizeof(V) == sizeof(v16)) {
      pd::storev(sums, pd::sums8(acc[r]));
    } else {
      for (int m = 0; m < MR; ++m) sums[m] = sumv(acc[r][m]);
    }
    for (int m = 0; m < MR; ++m) {
      float s = sums[m];
      for (int64_t j = k; j < p.K; ++j) s += static_cast<float>(w[r * p.K + j]) * x[m * p.ldx + j];
      if (p.bias != nullptr) s += p.bias[n0 + r];
      p.y[(m0 + m) * p.N + n0 + r] = s;
    }
  }
}

template <int NR, int MR, typename V, typename W>
PD_INLINE void tile_maybe_prefetch(const Problem<W>& p, int64_t n0, int64_t m0) {
  if (m0 == 0) {
    tile<NR, MR, true, V>(p, n0, m0);
  } else {
    tile<NR, MR, false, V>(p, n0, m0);
  }
}

// All M rows of x against w rows [n0, n0 + NR): full MR tiles, then the remaining rows (one
// tile of each smaller size that the remainder holds: 8 > 4 > 2 > 1, or 4 > 3 > 2 > 1).
template <int NR, int MR, typename V, typename W>
PD_INLINE void strip(const Problem<W>& p, int64_t n0) {
  int64_t m = 0;
  for (; m + MR <= p.M; m += MR) tile_maybe_prefetch<NR, MR, V>(p, n0, m);
  int64_t rest = p.M - m;
  if constexpr (MR > 4) {
    if (rest >= 4) tile_maybe_prefetch<NR, 4, V>(p, n0, m), m += 4, rest -= 4;
  }
  if constexpr (MR > 3) {
    if (rest == 3) tile_maybe_prefetch<NR, 3, V>(p, n0, m), m += 3, rest -= 3;
  }
  if constexpr (MR > 2) {
    if (rest >= 2) tile_maybe_prefetch<NR, 2, V>(p, n0, m), m += 2, rest -= 2;
  }
  if constexpr (MR > 1) {
    if (rest == 1) tile_maybe_prefetch<NR, 1, V>(p, n0, m);
  }
}

// w rows [n_begin, n_end) against all of x. Tile shapes keep NR * MR accumulators plus NR
// weight vectors and one x vector within the 16 vector registers: 8 x 1 for one row (eight
// independent sums), 4 x 2 for two, 3 x 4 from three rows up.
template <int NR, int MR, typename V = v8, typename W>
PD_INLINE void rows_range(const Problem<W>& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) strip<NR, MR, V>(p, n);
  for (; n < n_end; ++n) strip<1, MR, V>(p, n);
}

template <typename W>
PD_MULTIVERSION void linear_rows(const Problem<W>& p, int64_t n_begin, int64_t n_end) {
  if (p.M == 1) {
    rows_range<8, 1>(p, n_begin, n_end);
  } else if (p.M == 2) {
    rows_range<4, 2>(p, n_begin, n_end);
  } else {
    rows_range<3, 4>(p, n_begin, n_end);
  }
}

// float32 or bfloat16 weights from three rows on, on a CPU with AVX-512: 16-float vectors and
// the 32 registers (3 x 8 tiles: 24 accumulators, 3 weight vectors, one x vector), so each
// weight vector loaded feeds 8 FMAs of 16 lanes. Each x vector is loaded once a k-step: GCC
// folded it into each of its 3 FMAs (27 loads a step for 24 FMAs; one thread, 16 rows, K =
// 4608: 72 -> 105 GFLOP/s, against MKL's 140 at 4096 rows). A tile's 24 sums are reduced 8 at
// a time (pd::sums8: ~3 instructions a sum, not 7, where K = 576 is only 36 steps a tile).
// Up to kTallRows rows, 8 x 4 tiles instead: eight weight rows stream from memory at once,
// which is what a few rows wait on (SmolLM2's 30 layers of projections + LM head, float32, 2-core
// AVX-512 host, 3 x 8 tiles = 1, medians of 15 interleaved passes: 3 rows 0.94, 4 rows 0.93,
// 5 rows 0.90, 6 rows 0.86; 8 rows 1.06, so 3 x 8 stays from 7 rows on).
constexpr int64_t kTallRows = 6;

template <typename W>
PD_WIDE void linear_rows_wide(const Problem<W>& p, int64_t n_begin, int64_t n_end) {
  if (p.M <= kTallRows) {
    rows_range<8, 4, v16>(p, n_begin, n_end);
  } else {
    rows_range<3, 8, v16>(p, n_begin, n_end);
  }
}

constexpr int64_t kRowsPerTask = 48;  // w rows per parallel task (a multiple of 8, 4 and 3)

template <typename W>
void run(const Problem<W>& p) {
  const int64_t tasks = (p.N + kRowsPerTask - 1) / kRowsPerTask;
  constexpr bool has_wide = std::is_same_v<W, float> || std::is_same_v<W, c10::BFloat16>;
  const bool wide = has_wide && p.M >= 3 && pd::wide_cpu();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kRowsPerTask, n1 = std::min(p.N, end * kRowsPerTask);
    if constexpr (has_wide) {
      if (wide) return linear_rows_wide(p, n0, n1);
    }
    linear_rows(p, n0, n1);
  });
}

// x, bias and y in w's dtype (float32, bfloat16 or float16), or in float32 with a half w (weights
// kept in half precision, activations in float32); x and bias are widened to float32 up front (a
// few rows), y rounded once at the end to x's dtype.
at::Tensor linear_small(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_small: x [M, K] and w [N, K] expected");
  const auto dtype = w.scalar_type();
  const auto xtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                  (xtype == dtype || xtype == at::kFloat),
              "linear_small: float32, bfloat16 or float16 w with x of its dtype or float32, got x ",
              xtype, " and w ", dtype);
  TORCH_CHECK(x.size(1) == w.size(1), "linear_small: x has ", x.size(1), " features, w ",
              w.size(1));
  TORCH_CHECK(w.is_contiguous(), "linear_small: w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const at::Tensor xf = x.stride(1) == 1 ? x.to(at::kFloat) : x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N &&
                    (bias->scalar_type() == dtype || bias->scalar_type() == xtype),
                "linear_small: bias must be [", N, "] in ", dtype, " or ", xtype);
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M > 0 && N > 0) {
    const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
    const int64_t ldx = M > 1 ? xf.stride(0) : K;
    if (dtype == at::kFloat) {
      run(Problem<float>{xf.data_ptr<float>(), w.data_ptr<float>(), b, y.data_ptr<float>(), M,
                         N, K, ldx});
    } else if (dtype == at::kBFloat16) {
      run(Problem<c10::BFloat16>{xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), b,
                                 y.data_ptr<float>(), M, N, K, ldx});
    } else {
      run(Problem<c10::Half>{xf.data_ptr<float>(), w.data_ptr<c10::Half>(), b,
                             y.data_ptr<float>(), M, N, K, ldx});
    }
  }
  return xtype == at::kFloat ? y : y.to(xtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_runtime, m) {
  m.def("linear_small(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pd_runtime, CPU, m) { m.impl("linear_small", &linear_small); }
