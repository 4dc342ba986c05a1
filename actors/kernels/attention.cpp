// Row-invariant attention over the runner's slotted KV cache (actors/kernels/__init__.py).
//
// One query row is computed in one fixed order, whatever the width of the pass or the batch it
// sits in: its visible keys in increasing cache position; each score a dot product over D with
// LANES partial sums combined pairwise; the softmax's max, then its sum of exponentials in key
// order; the output accumulated over keys in key order. A token tree's node sees the context and
// its ancestors in the same order as the chain of its path does after compaction, so a tree row
// computes what the chain's single-token pass computes. No reduction is split across threads: a
// thread owns a (row, head) pair. Built without -ffast-math, so that no exp or sum is vectorised
// with a length-dependent tail.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;

inline float dot(const float* a, const float* b, int64_t D) {
  float acc[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += a[d + l] * b[d + l];
  for (int l = 0; d < D; ++d, ++l) acc[l] += a[d] * b[d];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
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
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> s(S > 0 ? S : 1), acc(D);
    std::vector<int64_t> idx(S > 0 ? S : 1);
    for (int64_t bh = begin; bh < stop; ++bh) {
      const int64_t b = bh / H, h = bh % H, kvh = h / rep, slot = sp[b];
      const float* kb = kp + slot * ks0 + kvh * D;
      const float* vb = vp + slot * ks0 + kvh * D;
      for (int64_t t = 0; t < T; ++t) {
        const float* qr = qp + b * qs0 + t * qs1 + h * qs2;
        const bool* mr = masked ? mp + (b * T + t) * S : nullptr;
        int64_t n = 0;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j < end; ++j) {
          if (mr && !mr[j - lo]) continue;
          float x = dot(qr, kb + j * ks1, D) * fscale;
          if (cap > 0.f) x = cap * std::tanh(x / cap);
          s[n] = x;
          idx[n++] = j;
          if (x > m) m = x;
        }
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - m);
          sum += s[i];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = 0; i < n; ++i) {
          const float p = s[i];
          const float* vr = vb + idx[i] * ks1;
          for (int64_t d = 0; d < D; ++d) acc[d] += p * vr[d];
        }
        float* orow = op + (b * T + t) * H * D + h * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = n ? acc[d] / sum : 0.f;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention over a slotted KV cache");
}
