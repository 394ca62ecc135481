// Helpers shared by the runtime's CPU kernels (cpu_ops.cpp, cpu_fused.cpp, cpu_prefill.cpp):
// the float dtype dispatch, 8-float vectors and 16-float ones for AVX-512 CPUs.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace pd {

#if defined(__x86_64__) && defined(__GNUC__)
#define PD_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PD_MULTIVERSION
#endif

#define PD_INLINE inline __attribute__((always_inline))

// 8 floats as one value (GCC/Clang vector extension): AVX2 registers in the x86-64-v3 clone,
// SSE pairs in the default one, NEON elsewhere.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

PD_INLINE v8 load8(const float* p) {
  v8 r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}

PD_INLINE void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }

PD_INLINE v8 load8(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  u16x8 h;
  __builtin_memcpy(&h, p, sizeof h);
  const i8 bits = __builtin_convertvector(h, i8) << 16;
  v8 r;
  __builtin_memcpy(&r, &bits, sizeof r);
  return r;
}

PD_INLINE float sum8(v8 x) {  // pairwise: three dependent adds, not seven
  typedef float v4 __attribute__((vector_size(16)));
  const v4 a = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  const float b0 = a[0] + a[2], b1 = a[1] + a[3];
  return b0 + b1;
}

// 16 floats: one AVX-512 register. Kernels with a `PD_WIDE` variant run it on such CPUs
// (wide_cpu()): it halves their FMA count and has 32 registers for accumulators.
typedef float v16 __attribute__((vector_size(64)));

// V (v8 or v16) loads, stores and sums over float32 memory.
template <typename V>
PD_INLINE V loadv(const float* p) {
  V r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}

template <typename V>
PD_INLINE void storev(float* p, V x) {
  __builtin_memcpy(p, &x, sizeof x);
}

template <typename V>
PD_INLINE float sumv(V x) {
  if constexpr (sizeof(V) == sizeof(v16)) {
    return sum8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
  } else {
    return sum8(x);
  }
}

// The sums of eight 16-float vectors, {sumv(a[0]), ..., sumv(a[7])}, bit for bit (the same
// pairs added in the same order), with 2-vector shuffles that serve all eight at once: about 3
// instructions a sum against 7 for sumv's.
PD_INLINE v8 sums8(const v16 (&a)[8]) {
  v16 p[4], q[2];
  for (int i = 0; i < 4; ++i)  // [a_2i | a_2i+1]: lanes j + (j + 8), 8 each
    p[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // [a_4i | a_4i+2 | a_4i+1 | a_4i+3]: lanes j + (j + 4), 4 each
    q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                   15, 28, 29, 30, 31);
  // [a0 a4 a2 a6 a1 a5 a3 a7], 2 lanes each: (j + 2) added to j
  const v16 t = __builtin_shufflevector(q[0], q[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                        13, 28, 29) +
                __builtin_shufflevector(q[0], q[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                        15, 30, 31);
  return __builtin_shufflevector(t, t, 0, 8, 4, 12, 2, 10, 6, 14) +  // back in order
         __builtin_shufflevector(t, t, 1, 9, 5, 13, 3, 11, 7, 15);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PD_WIDE __attribute__((target("arch=x86-64-v4")))
inline bool wide_cpu() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}
#else
#define PD_WIDE
inline bool wide_cpu() { return false; }
#endif

// exp(x) for x <= 0 (scores minus their maximum) on V = v8 or v16: 2^k * e^r with |r| <= ln2 /
// 2, e^r by a degree-6 polynomial (relative error ~2e-7, like ATen's vectorized exp); -inf and
// below -87 give 0. k is read from the bits of x * log2(e) + 1.5 * 2^23, whose last mantissa
// bits hold it once the add has rounded (GCC 12's __builtin_convertvector rejects a
// template-dependent vector type).
template <typename V>
PD_INLINE V expv(V x) {
  using I = decltype(x < x);  // the int32 vector of V's width
  const V lo = V{} - 87.f;
  const I under = x < lo;
  x = x < lo ? lo : x;
  const V magic = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const V kf = x * 1.44269504088896341f + magic;
  const V k = kf - magic;
  V r = x - k * 0.693359375f;  // ln2 in two parts, exact product with the first
  r = r - k * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  I bits;
  __builtin_memcpy(&bits, &kf, sizeof bits);
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^k
  V two_k;
  __builtin_memcpy(&two_k, &bits, sizeof two_k);
  return under ? V{} : p * two_k;
}

PD_INLINE v8 exp8(v8 x) { return expv(x); }

// max(x[0], ..., x[n - 1]), n >= 1, a V (v8 or v16) at a time (scores: no NaN).
template <typename V>
PD_INLINE float row_max(const float* x, int64_t n) {
  constexpr int W = sizeof(V) / sizeof(float);
  V mv = V{} + x[0];
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V xv = loadv<V>(x + j);
    mv = xv > mv ? xv : mv;
  }
  float mx = mv[0];
  for (int i = 1; i < W; ++i) mx = mx > mv[i] ? mx : mv[i];
  for (; j < n; ++j) mx = mx > x[j] ? mx : x[j];
  return mx;
}

// Softmax numerators in place: x[j] = exp(x[j] * scale - mx) for j in [0, n); -> their sum.
template <typename V>
PD_INLINE float exp_sum(float* x, int64_t n, float scale, float mx) {
  constexpr int W = sizeof(V) / sizeof(float);
  V acc = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V e = expv(loadv<V>(x + j) * scale - mx);
    storev(x + j, e);
    acc += e;
  }
  float sum = sumv(acc);
  if constexpr (W > 8) return sum + exp_sum<v8>(x + j, n - j, scale, mx);  // an 8-float tail
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] * scale - mx);
    sum += x[j];
  }
  return sum;
}

// f(T{}) for the tensor dtype's C++ type T: float32, bfloat16 or float16 (else a clear error).
template <typename F>
void dispatch_float_types(c10::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case c10::kFloat: f(float{}); break;
    case c10::kBFloat16: f(c10::BFloat16{}); break;
    case c10::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t);
  }
}

}  // namespace pd
