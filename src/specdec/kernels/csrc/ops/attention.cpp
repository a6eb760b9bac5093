#include "../common.h"
#include "../ops.h"

namespace SPECDEC_QLIB {
namespace {
// Attention of each query over the keys it may see, one query at a time: softmax(q . k / sqrt(D)) . v.
//
// Row invariance, by construction: a query's output depends on its own q and on the keys and values it
// sees, in the order it sees them, and on nothing else (not on the number of queries or rows in the pass,
// the masked slots, the padding, or the thread count).  Each dot product q . k runs over 16 fp32 lanes
// (lane l takes dims l, l + 16, ...; a multiply then an add, no fused multiply-add) and one fixed
// horizontal sum; the softmax sums and each output dimension's weighted sum of values run over the
// visible keys in order.  The lanes are plain loops the compiler vectorizes (or not, in the portable
// build) without changing any operation, so every build computes the same bits.
//
// q: [B, T, H, D] (any strides); keys, values: [rows, KV, capacity, D] (the cache, contiguous); visible:
// [B, T, S] bool, key j of query (b, t) being cache slot j, or key_index[b, t, j] when given (a tree:
// each node's keys in the order its path, decoded token by token, would see them).  Returns [B, T, H, D].
constexpr int kLanes = 16;

inline void to_f32(const float* x, float* y, int64_t n) { std::memcpy(y, x, n * sizeof(float)); }

inline void to_f32(const at::BFloat16* x, float* y, int64_t n) {  // bf16 -> fp32: the top 16 bits
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  uint32_t* v = reinterpret_cast<uint32_t*>(y);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>(u[i]) << 16;
}

inline float dot_lanes(const float* a, const float* b, int64_t D) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < D; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// exp(x) for x <= 0 (scores less their maximum), in place: Cephes' expf (2^n times a degree-6 polynomial
// on [-ln2/2, ln2/2], within 2 ulp), written in basic operations only so that the compiler vectorizes it
// and every build computes the same bits (std::exp is a library call, scalar).
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];  // exp(-87) ~ 1.6e-38: still a normal float
    const float r = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(v / ln2)
    float f = v - r * 0.693359375f;  // v - r * ln2, ln2 in two parts
    f = f - r * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = (p * (f * f) + f) + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(r) + 127) << 23;  // 2^r
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[i] = p * scale;
  }
}

template <typename T>
void attend_queries(const at::Tensor& q, const T* kc, const T* vc, int64_t kv_heads, int64_t capacity,
                    const bool* visible, const int64_t* key_index, int64_t S, T* out) {
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), G = H / kv_heads;
  const T* qp = q.data_ptr<T>();
  const int64_t sb = q.stride(0), st = q.stride(1), sh = q.stride(2), sd = q.stride(3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * Tn * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), row(D), acc(G * D), scores, sums(G);
    std::vector<int64_t> slots;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item % kv_heads, bt = item / kv_heads, b = bt / Tn, t = bt % Tn;
      slots.clear();
      const bool* vis = visible + bt * S;
      const int64_t* idx = key_index ? key_index + bt * S : nullptr;
      for (int64_t j = 0; j < S; ++j)
        if (vis[j]) slots.push_back(idx ? idx[j] : j);
      const int64_t n = static_cast<int64_t>(slots.size());
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = f32(qp[b * sb + t * st + (g * G + h) * sh + d * sd]);
      const T* keys = kc + (b * kv_heads + g) * capacity * D;
      const T* values = vc + (b * kv_heads + g) * capacity * D;
      scores.assign(G * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        to_f32(keys + slots[j] * D, row.data(), D);
        for (int64_t h = 0; h < G; ++h) scores[h * n + j] = dot_lanes(qf.data() + h * D, row.data(), D) * scale;
      }
      for (int64_t h = 0; h < G; ++h) {
        float* sc = scores.data() + h * n;
        float top = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < n; ++j) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < n; ++j) sc[j] -= top;
        exp_nonpositive(sc, n);
        for (int64_t j = 0; j < n; ++j) sum += sc[j];
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        to_f32(values + slots[j] * D, row.data(), D);
        for (int64_t h = 0; h < G; ++h) {
          const float p = scores[h * n + j];
          float* a = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        T* o = out + (bt * H + g * G + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(n ? acc[h * D + d] / sums[h] : 0.f);
      }
    }
  });
}

}  // namespace

at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                     c10::optional<at::Tensor> key_index) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "attention: q [B, T, H, D], keys and values [rows, KV, capacity, D]");
  TORCH_CHECK(q.device().is_cpu() && keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "attention: CPU tensors of one dtype");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "attention: the cache must be contiguous");
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), KV = keys.size(1);
  TORCH_CHECK(keys.size(3) == D && KV > 0 && H % KV == 0 && keys.size(0) >= B, "attention: shapes do not match");
  TORCH_CHECK(visible.dim() == 3 && visible.size(0) == B && visible.size(1) == Tn &&
              visible.scalar_type() == at::kBool, "attention: visible must be bool [B, T, S]");
  visible = visible.contiguous();
  const int64_t S = visible.size(2);
  const int64_t* idx = nullptr;
  at::Tensor index;
  if (key_index.has_value()) {
    index = key_index->contiguous();
    TORCH_CHECK(index.sizes() == visible.sizes() && index.scalar_type() == at::kLong, "attention: key_index [B, T, S] int64");
    idx = index.data_ptr<int64_t>();
    const int64_t* end = idx + index.numel();
    TORCH_CHECK(std::all_of(idx, end, [&](int64_t s) { return s >= 0 && s < keys.size(2); }),
                "attention: key_index outside the cache");
  } else {
    TORCH_CHECK(S <= keys.size(2), "attention: more key slots than the cache holds");
  }
  auto out = at::empty({B, Tn, H, D}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend_queries<float>(q, keys.data_ptr<float>(), values.data_ptr<float>(), KV, keys.size(2),
                          visible.data_ptr<bool>(), idx, S, out.data_ptr<float>());
  else if (q.scalar_type() == at::kBFloat16)
    attend_queries<at::BFloat16>(q, keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), KV, keys.size(2),
                                 visible.data_ptr<bool>(), idx, S, out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "attention: bf16 or fp32");
  return out;
}

}  // namespace SPECDEC_QLIB
