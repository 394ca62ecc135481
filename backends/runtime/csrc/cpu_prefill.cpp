// torch.ops.pd_runtime.prefill_attention: causal attention of prompts over themselves (every
// sequence starts at position 0), float32, in blocks on the BLAS sgemm that torch is linked
// with (built with cpu_ops.cpp into one library by backends/runtime/cpu_kernels.py).
//
//   q    [T, H, Dk]    the batch's tokens, flat over sequences (last dim contiguous)
//   k    [T, Hkv, Dk]  (last dim contiguous; any token stride)
//   v    [T, Hkv, Dv]  may be a view of k (MLA: the latent's first Dv channels)
//   cu   [B + 1] int64 sequence b is tokens [cu[b], cu[b + 1])
//   window             > 0: a query at position i sees keys (i - window, i]; else [0, i]
//   sinks [H] float32 or None: a sink logit per query head in every softmax's denominator, with
//                       no value (gpt-oss): folded into the running max and sum at the end
//   -> out [T, H, Dv]
//
// Work: one task per (sequence, KV head, block of queries), the largest first, taken by the
// threads from a shared counter. A task stacks the G query heads of its KV head over its query
// block (G * Bq rows), so each key and value row is read once per KV head, and walks the keys
// it can see in chunks with an online softmax (running max and sum, flash-attention style):
// S = Q K^T and O += P V are two sgemm calls a chunk. Only the diagonal chunk is masked.
// The softmax between them runs on 16-float vectors on an AVX-512 CPU (wide_cpu()), 8 else;
// with its row max vectorized too (it was a scalar loop) a layer at 8 x 512 (SmolLM2's heads,
// 2 threads) went from 24-26 to 17-19 ms and at 1 x 2048 from 38-39 to 24-27.
//
// prefill_attention_available() says whether torch exports the sgemm symbol (an MKL or
// OpenBLAS build does); the runtime uses SDPA where it does not.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "vec.h"

namespace {

using namespace pd;

// Fortran BLAS sgemm (column-major): C = alpha op(A) op(B) + beta C.
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*,
                          const float*, const float*, const int*, const float*, const int*,
                          const float*, float*, const int*);

sgemm_fn blas_sgemm() {
  static const sgemm_fn fn = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "sgemm_"));
  return fn;
}

// Row-major C [m, n] (ldc) = A [m, k] (lda) . B^T, B [n, k] (ldb); beta 0 or 1.
void gemm_abt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
              float* c, int ldc) {
  const float one = 1.f;  // column-major: C^T [n, m] = B [n, k] . A^T
  blas_sgemm()("T", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

// Row-major C [m, n] (ldc) = A [m, k] (lda) . B, B [k, n] (ldb); beta 0 or 1.
void gemm_ab(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
             float* c, int ldc) {
  const float one = 1.f;  // column-major: C^T [n, m] = B^T [n, k] . A^T
  blas_sgemm()("N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

constexpr int64_t kRowsPerTask = 96;  // G * Bq: query rows stacked per task
constexpr int64_t kKeyChunk = 512;     // keys per sgemm

struct Task {
  int64_t start, len, h, q0, q1;  // sequence [start, start + len), KV head, query block
  int64_t cost() const { return q1 * (q1 - q0); }  // keys seen x queries, roughly
};

struct Problem {
  const float *q, *k, *v;
  float* out;
  int64_t H, Hkv, G, Dk, Dv, qs0, ks0, vs0, window;
  float scale;
  const float* sinks;  // [H] or nullptr
};

// Keys query position i sees: [lo(i), i].
PD_INLINE int64_t first_key(const Problem& p, int64_t i) {
  return p.window > 0 ? std::max<int64_t>(0, i - p.window + 1) : 0;
}

// Scores s [rows, n] of keys [c0, c0 + n) -> their exponentials against the running max m,
// with the running sum l and the output rows o rescaled to the new max. Row r is query
// q0 + r / G.
template <typename V>
PD_INLINE void softmax_rows(const Problem& p, int64_t q0, int64_t rows, int64_t c0, int64_t n,
                            float* s, float* m, float* l, float* o) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = q0 + r / p.G;
    const int64_t lo = std::max<int64_t>(first_key(p, i) - c0, 0);
    const int64_t hi = std::min<int64_t>(i + 1 - c0, n);  // keys [lo, hi) of the chunk
    float* sr = s + r * n;
    float mx = m[r];
    if (hi > lo) mx = std::max(mx, row_max<V>(sr + lo, hi - lo) * p.scale);  // scale > 0
    if (hi <= lo || mx == ninf) {  // nothing visible here: P = 0
      std::fill(sr, sr + n, 0.f);
      continue;
    }
    const float alpha = m[r] == ninf ? 0.f : std::exp(m[r] - mx);
    std::fill(sr, sr + lo, 0.f);
    const float sum = exp_sum<V>(sr + lo, hi - lo, p.scale, mx);
    std::fill(sr + hi, sr + n, 0.f);
    l[r] = l[r] * alpha + sum;
    m[r] = mx;
    if (alpha != 1.f)
      for (int64_t d = 0; d < p.Dv; ++d) o[r * p.Dv + d] *= alpha;
  }
}

PD_MULTIVERSION void online_softmax(const Problem& p, int64_t q0, int64_t rows, int64_t c0,
                                    int64_t n, float* s, float* m, float* l, float* o) {
  softmax_rows<v8>(p, q0, rows, c0, n, s, m, l, o);
}

// The same on 16-float vectors, for CPUs with AVX-512 (wide_cpu()).
PD_WIDE void online_softmax_wide(const Problem& p, int64_t q0, int64_t rows, int64_t c0,
                                 int64_t n, float* s, float* m, float* l, float* o) {
  softmax_rows<v16>(p, q0, rows, c0, n, s, m, l, o);
}

struct Scratch {
  std::vector<float> q, s, o, m, l;
};

void run_task(const Problem& p, const Task& t, Scratch& w) {
  const int64_t G = p.G, rows = (t.q1 - t.q0) * G, Dk = p.Dk, Dv = p.Dv;
  w.q.resize(rows * Dk);
  w.o.assign(rows * Dv, 0.f);
  w.m.assign(rows, -std::numeric_limits<float>::infinity());
  w.l.assign(rows, 0.f);
  for (int64_t i = t.q0; i < t.q1; ++i)  // the G heads of KV head h, query by query
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(p.q + (t.start + i) * p.qs0 + (t.h * G + g) * Dk, Dk,
                  w.q.data() + ((i - t.q0) * G + g) * Dk);
  const auto softmax = wide_cpu() ? online_softmax_wide : online_softmax;
  const float* kb = p.k + t.start * p.ks0 + t.h * Dk;
  const float* vb = p.v + t.start * p.vs0 + t.h * Dv;
  for (int64_t c0 = first_key(p, t.q0); c0 < t.q1; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, t.q1 - c0);
    w.s.resize(rows * n);
    gemm_abt(rows, n, Dk, w.q.data(), Dk, kb + c0 * p.ks0, p.ks0, 0.f, w.s.data(), n);
    softmax(p, t.q0, rows, c0, n, w.s.data(), w.m.data(), w.l.data(), w.o.data());
    gemm_ab(rows, Dv, n, w.s.data(), n, vb + c0 * p.vs0, p.vs0, 1.f, w.o.data(), Dv);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t.q0 + r / G, g = r % G;
    float* dst = p.out + ((t.start + i) * p.H + t.h * G + g) * Dv;
    float inv = 1.f / w.l[r];
    if (p.sinks != nullptr) {  // the sink joins the sum (every row saw its own key: m finite)
      const float sink = p.sinks[t.h * G + g], m = std::max(w.m[r], sink);
      const float alpha = std::exp(w.m[r] - m);
      inv = alpha / (w.l[r] * alpha + std::exp(sink - m));
    }
    for (int64_t d = 0; d < Dv; ++d) dst[d] = w.o[r * Dv + d] * inv;
  }
}

std::vector<Task> make_tasks(const int64_t* cu, int64_t B, int64_t Hkv, int64_t G) {
  const int64_t block = std::max<int64_t>(8, kRowsPerTask / G);
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t q0 = 0; q0 < cu[b + 1] - cu[b]; q0 += block)
        tasks.push_back({cu[b], cu[b + 1] - cu[b], h, q0, std::min(q0 + block, cu[b + 1] - cu[b])});
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost() > b.cost(); });
  return tasks;
}

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& cu) {
  TORCH_CHECK(blas_sgemm() != nullptr, "prefill_attention: torch exports no sgemm");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "prefill_attention: float32 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 &&
                  v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == k.stride(1),
              "prefill_attention: heads must be packed rows (q [T, H, Dk], k [T, Hkv, Dk])");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "prefill_attention: shapes of q, k, v differ");
  TORCH_CHECK(cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.numel() >= 2 &&
                  cu.is_contiguous(),
              "prefill_attention: cu_seqlens must be contiguous int64 [B + 1]");
  const int64_t* c = cu.data_ptr<int64_t>();
  TORCH_CHECK(c[0] == 0 && c[cu.numel() - 1] == q.size(0), "prefill_attention: cu_seqlens ",
              "must run from 0 to T");
  for (int64_t b = 0; b + 1 < cu.numel(); ++b)
    TORCH_CHECK(c[b] < c[b + 1], "prefill_attention: empty or unordered sequence ", b);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu, double scale, int64_t window,
                             const std::optional<at::Tensor>& sinks) {
  check_args(q, k, v, cu);
  const int64_t H = q.size(1), Hkv = k.size(1);
  at::Tensor sinks_c;
  if (sinks.has_value()) {
    sinks_c = sinks->contiguous();
    TORCH_CHECK(sinks_c.scalar_type() == at::kFloat && sinks_c.numel() == H,
                "prefill_attention: sinks must be float32 [H]");
  }
  auto out = at::empty({q.size(0), H, v.size(2)}, q.options());
  const Problem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  out.data_ptr<float>(), H, Hkv, H / Hkv, q.size(2), v.size(2), q.stride(0),
                  k.stride(0), v.stride(0), window, static_cast<float>(scale),
                  sinks.has_value() ? sinks_c.data_ptr<float>() : nullptr};
  const auto tasks = make_tasks(cu.data_ptr<int64_t>(), cu.numel() - 1, Hkv, p.G);
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t a, int64_t b) {
    for (int64_t worker = a; worker < b; ++worker) {
      Scratch w;
      for (int64_t i = next++; i < n; i = next++) run_task(p, tasks[i], w);
    }
  });
  return out;
}

bool prefill_attention_available() { return blas_sgemm() != nullptr; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_runtime, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, "
        "int window, Tensor? sinks=None) -> Tensor");
  m.def("prefill_attention_available() -> bool", &prefill_attention_available);
}

TORCH_LIBRARY_IMPL(pd_runtime, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
