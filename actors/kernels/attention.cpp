// Row-invariant attention over the runner's slotted KV cache (actors/kernels/__init__.py).
//
// One query row is computed in one fixed order, whatever the width of the pass or the batch it
// sits in: its visible keys in increasing cache position; each score a dot product over D with
// LANES partial sums combined pairwise; the softmax's max, its exponentials (one branch-free
// polynomial for every element), their sum in LANES partial sums by key rank (keys past the last
// add exact zeros); the output accumulated over keys in key order. A token tree's node sees the context and
// its ancestors in the same order as the chain of its path does after compaction, so a tree row
// computes what the chain's single-token pass computes. No reduction is split across threads: a
// thread owns a (row, head) pair. Built without -ffast-math, so that no reduction is reassociated
// by the compiler with a length-dependent tail.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;
// GCC vector types: the same instructions for every element on every call (AVX-512: one register;
// AVX2: two), never left to the auto-vectoriser's choices.
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load_tail(const float* p, int64_t n) {  // n < LANES values, zeros after
  vf v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef float vf2 __attribute__((vector_size(2 * sizeof(float))));

// The lanes of v summed pairwise in one fixed order: lane l + w onto lane l for w = 8, 4, 2, 1.
inline float combine(vf v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vf2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

// The dot products of q with N keys (N = 4 or 1), each with the same operations in the same order:
// lane l sums q[d] * k[d] for d = l, l + LANES, ...; the lanes are then combined. Interleaving four keys
// only overlaps their chains.
template <int N>
inline void dots(const float* q, const float* const* k, int64_t D, float* out) {
  vf acc[N] = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    const vf qv = load(q + d);
    for (int n = 0; n < N; ++n) acc[n] += qv * load(k[n] + d);
  }
  if (d < D) {
    const vf qv = load_tail(q + d, D - d);
    for (int n = 0; n < N; ++n) acc[n] += qv * load_tail(k[n] + d, D - d);
  }
  for (int n = 0; n < N; ++n) out[n] = combine(acc[n]);
}

// exp(x) of LANES values: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error under 2e-7), times 2^n built in the exponent bits; x below -87 gives 0.
inline vf exp_lanes(vf x) {
  const vf lo = x < -87.f ? vf{} - 87.f : x;
  const vf v = lo > 88.f ? vf{} + 88.f : lo;
  const vf n = (v * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const vf r = (v - n * 0.693145751953125f) - n * 1.42860682e-6f;
  vf p = vf{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? vf{} : p * scale;
}

// acc[0..D) = sum over i < n of p[i] * v[i][0..D), in key order; for D a multiple of LANES up to
// 256 the accumulators live in registers (NC chunks of LANES), else in memory, same arithmetic.
template <int NC>
inline void weigh_chunks(const float* p, const float* const* v, int64_t n, float* acc) {
  vf a[NC] = {};
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < NC; ++c) a[c] += p[i] * load(v[i] + c * LANES);
  std::memcpy(acc, a, sizeof a);
}

inline void weigh(const float* p, const float* const* v, int64_t n, int64_t D, float* acc) {
  switch (D % LANES ? 0 : D / LANES) {
    case 4: return weigh_chunks<4>(p, v, n, acc);
    case 8: return weigh_chunks<8>(p, v, n, acc);
    case 2: return weigh_chunks<2>(p, v, n, acc);
    case 16: return weigh_chunks<16>(p, v, n, acc);
    default: break;
  }
  std::fill(acc, acc + D, 0.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[i] * v[i][d];
}

}  // namespace

// q [B, T, H, D] fp32 (any strides, D contiguous); kc, vc [S, L, Hkv, D] fp32 (one layer's cache,
// contiguous); slots int64 [B]; mask bool [B, T, end - lo] or empty (every key of [lo, end) visible).
// Returns [B, T, H * D] fp32.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                     const torch::Tensor& slots, const torch::Tensor& mask, int64_t lo, int64_t end,
                     double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, "q: [B, T, H, D] fp32");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
              vc.sizes() == kc.sizes() && vc.scalar_type() == at::kFloat, "kc, vc: contiguous [S, L, Hkv, D] fp32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64 [B]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t L = kc.size(1), Hkv = kc.size(2), S = end - lo;
  TORCH_CHECK(kc.size(3) == D && H % Hkv == 0 && slots.size(0) == B, "shapes disagree");
  TORCH_CHECK(0 <= lo && lo <= end && end <= L, "keys [lo, end) outside the cache");
  const bool masked = mask.numel() > 0;
  if (masked)
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3 &&
                mask.size(0) == B && mask.size(1) == T && mask.size(2) == S, "mask: contiguous bool [B, T, end - lo]");
  auto out = torch::empty({B, T, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = L * Hkv * D, ks1 = Hkv * D;
  const int64_t rep = H / Hkv;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t cap_s = (S + LANES - 1) / LANES * LANES + LANES;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> s(cap_s), acc(D);
    std::vector<const float*> keys(cap_s), vals(cap_s);
    for (int64_t bh = begin; bh < stop; ++bh) {
      const int64_t b = bh / H, h = bh % H, kvh = h / rep, slot = sp[b];
      const float* kb = kp + slot * ks0 + kvh * D;
      const float* vb = vp + slot * ks0 + kvh * D;
      for (int64_t t = 0; t < T; ++t) {
        const float* qr = qp + b * qs0 + t * qs1 + h * qs2;
        const bool* mr = masked ? mp + (b * T + t) * S : nullptr;
        int64_t n = 0;  // the visible keys, in cache order
        for (int64_t j = lo; j < end; ++j) {
          if (mr && !mr[j - lo]) continue;
          keys[n] = kb + j * ks1;
          vals[n++] = vb + j * ks1;
        }
        float* orow = op + (b * T + t) * H * D + h * D;
        if (!n) {
          std::fill(orow, orow + D, 0.f);
          continue;
        }
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) dots<4>(qr, &keys[i], D, &s[i]);
        for (; i < n; ++i) dots<1>(qr, &keys[i], D, &s[i]);
        float m = -std::numeric_limits<float>::infinity();
        for (i = 0; i < n; ++i) {
          float x = s[i] * fscale;
          if (cap > 0.f) x = cap * std::tanh(x / cap);
          s[i] = x;
          m = x > m ? x : m;
        }
        const int64_t padded = (n + LANES - 1) / LANES * LANES;
        for (i = 0; i < n; ++i) s[i] -= m;
        for (; i < padded; ++i) s[i] = -std::numeric_limits<float>::infinity();  // exp gives exactly 0
        vf lanes = {};
        for (i = 0; i < padded; i += LANES) {
          const vf e = exp_lanes(load(&s[i]));
          std::memcpy(&s[i], &e, sizeof e);
          lanes += e;
        }
        const float sum = combine(lanes);
        weigh(s.data(), vals.data(), n, D, acc.data());
        for (int64_t d = 0; d < D; ++d) orow[d] = acc[d] / sum;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention over a slotted KV cache");
}
