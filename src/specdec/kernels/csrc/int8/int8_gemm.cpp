// Weight-only int8 GEMM for CPUs with AVX2 + FMA:  y[M,N] = x[M,K] @ (w[N,K] * scale[N]).T
//
// The weight stream (memory traffic + int8 -> fp32 conversion) is paid once per group of up to 6 rows,
// so a call with a few rows costs about as much as a call with one row.
//
// Row invariance (bit-identical output for row m whatever M is, whatever the other rows are, wherever
// the row sits): every (m, n) pair owns exactly one 8-lane fp32 accumulator, updated by
//     acc = fma(x[m, k:k+8], float(w[n, k:k+8]), acc)        for k = 0, 8, 16, ... in increasing order
// (the last, partial chunk uses zero-padded x and w), then reduced by one fixed horizontal sum and
// multiplied by scale[n].  Row grouping, channel blocking, K blocking (accumulators are stored to and
// reloaded from fp32 memory, which is exact) and the thread split (over N only) change which pairs are
// computed together or when, never the sequence of operations applied to one pair's accumulator.

// Light headers (no torch/extension.h, no pybind11) keep the first-use compile short; the op is
// registered with the dispatcher as torch.ops.specdec_int8.int8_mm.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxRows = 6;  // rows per register group

// One micro-kernel: MR rows x NB output channels, k chunks [k0, k1) (multiples of 8, all full chunks),
// plus the partial tail chunk at k1 when `tail` (k1 == K & ~7 and K % 8 != 0).
// x: fp32 rows padded with zeros to a multiple of 8, row stride ldx.
// acc: [NB][M][8] with stride acc_n between channels and 8 between rows.
template <int MR, int NB>
static inline void micro(const float* __restrict x, int64_t ldx, const int8_t* __restrict w, int64_t ldw,
                         int64_t k0, int64_t k1, int64_t K, bool tail, float* __restrict acc,
                         int64_t acc_n, bool first) {
  __m256 a[MR][NB];
  if (first) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) a[m][j] = _mm256_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) a[m][j] = _mm256_loadu_ps(acc + j * acc_n + m * 8);
  }
  for (int64_t k = k0; k < k1; k += 8) {
    if (MR == 1) {
      const __m256 xv = _mm256_loadu_ps(x + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * ldw + k))));
        a[0][j] = _mm256_fmadd_ps(xv, wv, a[0][j]);
      }
    } else {
      __m256 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * ldw + k))));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
        if (NB > 1) __asm__("" : "+x"(xv));  // one load per row, not one per (row, channel)
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
      }
    }
  }
  if (tail) {
    const int64_t k = k1;
    const int rem = static_cast<int>(K - k);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      alignas(16) int8_t buf[16] = {0};
      std::memcpy(buf, w + j * ldw + k, rem);
      const __m256 wv =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(buf))));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) a[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, a[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(acc + j * acc_n + m * 8, a[m][j]);
}

using MicroFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int64_t, bool, float*,
                         int64_t, bool);

struct Config {
  int nb;
  MicroFn full;  // MR x nb
  MicroFn one;   // MR x 1 (channel remainder)
};

template <int MR, int NB>
static Config make_config() {
  return Config{NB, &micro<MR, NB>, &micro<MR, 1>};
}

static const Config kConfigs[kMaxRows + 1] = {
    Config{0, nullptr, nullptr}, make_config<1, 8>(), make_config<2, 5>(), make_config<3, 4>(),
    make_config<4, 3>(),         make_config<5, 2>(), make_config<6, 2>(),
};

// The one fixed horizontal sum.
static inline float hsum8(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename OutT>
static void run(const float* xf, int64_t M, int64_t K, int64_t Kp, const int8_t* w, const float* scale, OutT* y,
                int64_t N) {
  // Row groups: balanced groups of at most kMaxRows rows.
  const int64_t ngroups = (M + kMaxRows - 1) / kMaxRows;
  std::vector<int64_t> gstart(ngroups + 1);
  for (int64_t g = 0; g <= ngroups; ++g) gstart[g] = (M * g) / ngroups;

  const int64_t kfull = K & ~int64_t(7);
  const bool has_tail = kfull != K;
  // K blocking keeps the fp32 activations of a block in L2 when there are many rows; with few rows
  // the whole K is one block so each weight row is streamed sequentially.  (Numerics do not depend on it.)
  int64_t kc = K;
  if (M * Kp * 4 > (256 << 10)) {
    kc = std::max<int64_t>(256, ((int64_t(256) << 10) / (M * 4)) & ~int64_t(63));
  }
  // Channels per block: a multiple of every nb used for this M (groups of 1..6 rows when M <= 16,
  // of 4..6 rows above), keeping the accumulator block small when M is large.
  int64_t nc = M <= 16 ? 120 : 60;
  if (N < 8 * nc) nc = 24;  // small N: more blocks to share between threads
  const int64_t nblocks = (N + nc - 1) / nc;

  // Blocks of channels are claimed dynamically, so a thread that is descheduled (shared machine) does
  // not hold up the call by a whole static half.  Only N is split: numerics are thread-count independent.
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), nblocks);
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<float> accbuf(static_cast<size_t>(nc * M * 8 + 8));
    float* acc = accbuf.data();
    for (int64_t blk = next.fetch_add(1, std::memory_order_relaxed); blk < nblocks;
         blk = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t nb0 = blk * nc;
      const int64_t n_end = N;
      const int64_t nn = std::min(nc, n_end - nb0);
      const int64_t acc_n = M * 8;
      for (int64_t kb = 0; kb < K; kb += kc) {
        const int64_t ke = std::min(K, kb + kc);
        const bool last = ke == K;
        const int64_t k1 = last ? kfull : ke;  // full chunks end
        const bool tail = last && has_tail;
        const bool first = kb == 0;
        for (int64_t g = 0; g < ngroups; ++g) {
          const int64_t m0 = gstart[g];
          const int mr = static_cast<int>(gstart[g + 1] - m0);
          const Config& cfg = kConfigs[mr];
          int64_t j = 0;
          for (; j + cfg.nb <= nn; j += cfg.nb)
            cfg.full(xf + m0 * Kp, Kp, w + (nb0 + j) * K, K, kb, k1, K, tail, acc + j * acc_n + m0 * 8, acc_n,
                     first);
          for (; j < nn; ++j)
            cfg.one(xf + m0 * Kp, Kp, w + (nb0 + j) * K, K, kb, k1, K, tail, acc + j * acc_n + m0 * 8, acc_n,
                    first);
        }
      }
      for (int64_t j = 0; j < nn; ++j) {
        const float s = scale[nb0 + j];
        for (int64_t m = 0; m < M; ++m) y[m * N + nb0 + j] = static_cast<OutT>(hsum8(acc + j * acc_n + m * 8) * s);
      }
    }
  });
}

at::Tensor int8_mm(at::Tensor x, at::Tensor w, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "int8_mm: x [M,K] and w [N,K] expected");
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_mm: weight must be int8");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int8_mm: x must be bf16 or fp32");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "int8_mm: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "int8_mm: shape mismatch");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "int8_mm: scale must be [N]");
  x = x.contiguous();
  w = w.contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();

  const int64_t Kp = (K + 7) & ~int64_t(7);
  // Activations -> fp32 once per call, rows padded with zeros to a multiple of 8 (plus slack).
  at::Tensor xf = at::empty({M * Kp + 8}, x.options().dtype(at::kFloat));
  float* xp = xf.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(xp + m * Kp, src + m * K, K * sizeof(float));
      for (int64_t k = K; k < Kp; ++k) xp[m * Kp + k] = 0.f;
    }
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* s = src + m * K;
      float* d = xp + m * Kp;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k)));
        _mm256_storeu_ps(d + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
      for (; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(s[k]) << 16;
        std::memcpy(d + k, &bits, 4);
      }
      for (; k < Kp; ++k) d[k] = 0.f;
    }
  }
  for (int64_t i = M * Kp; i < M * Kp + 8; ++i) xp[i] = 0.f;

  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    run<float>(xp, M, K, Kp, wp, sp, y.data_ptr<float>(), N);
  else
    run<at::BFloat16>(xp, M, K, Kp, wp, sp, y.data_ptr<at::BFloat16>(), N);
  return y;
}

}  // namespace

// y = x @ (w_int8 * scale[:, None]).T  (AVX2/FMA, row-invariant)
TORCH_LIBRARY(specdec_int8, m) { m.def("int8_mm(Tensor x, Tensor w, Tensor scale) -> Tensor", &int8_mm); }
