// Helpers shared by the runtime's CPU kernels (cpu_ops.cpp, cpu_fused.cpp, cpu_prefill.cpp):
// the float dtype dispatch, 8-float vectors and 16-float ones for AVX-512 CPUs.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

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

// exp(x) for x <= 0 (scores minus their maximum): 2^k * e^r with |r| <= ln2 / 2, e^r by a
// degree-6 polynomial (relative error ~2e-7, like ATen's vectorized exp); -inf and below
// -87 give 0.
PD_INLINE v8 exp8(v8 x) {
  const v8 lo = v8{} - 87.f;
  const i8 under = x < lo;
  x = x < lo ? lo : x;
  const v8 magic = v8{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  v8 k = (x * 1.44269504088896341f + magic) - magic;
  v8 r = x - k * 0.693359375f;  // ln2 in two parts, exact product with the first
  r = r - k * -2.12194440e-4f;
  v8 p = v8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i8 bits = (__builtin_convertvector(k, i8) + 127) << 23;  // 2^k
  v8 two_k;
  __builtin_memcpy(&two_k, &bits, sizeof two_k);
  return under ? v8{} : p * two_k;
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
