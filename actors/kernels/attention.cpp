// Row-invariant attention over the runner's KV cache of blocks (actors/kv.py, actors/kernels/__init__.py).
//
// One query row is computed in one fixed order, whatever the width of the pass or the batch it
// sits in: its visible keys in increasing cache position; each score a dot product over D with
// LANES partial sums combined pairwise; the softmax's max, its exponentials (one branch-free
// polynomial for every element), their sum in LANES partial sums by key rank (keys past the last
// add exact zeros); the output accumulated over keys in key order (keys it does not see add exact
// zeros). Up to four queries that read the same KV head share each key's loads. A token tree's
// node sees the context and its ancestors in the same order as the chain of its path does after
// compaction, so a tree row computes what the chain's single-token pass computes. No reduction is
// split across threads: a thread owns a group of queries. Built without -ffast-math, so that the
// compiler reassociates no reduction with a length-dependent tail.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
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

// The dot products of N queries with one key, each with the same operations in the same order: lane l
// sums q[d] * k[d] for d = l, l + LANES, ...; the lanes are then combined. Grouping queries only shares
// the key's loads: a pair's bits do not depend on N.
template <int N>
inline void dots(const float* const* q, const float* k, int64_t D, float* const* out, int64_t j) {
  vf acc[N] = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    const vf kv = load(k + d);
    for (int n = 0; n < N; ++n) acc[n] += load(q[n] + d) * kv;
  }
  if (d < D) {
    const vf kv = load_tail(k + d, D - d);
    for (int n = 0; n < N; ++n) acc[n] += load_tail(q[n] + d, D - d) * kv;
  }
  for (int n = 0; n < N; ++n) out[n][j] = combine(acc[n]);
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

// out[n][0..D) = sum over keys j of p[n][j] * v_j[0..D), in key order, for N queries at once (their
// weights p are 0 at keys they do not see: adding an exact zero changes no sum). For D a multiple of
// LANES up to 128 the accumulators live in registers (NC chunks of LANES); else in memory, same
// arithmetic. Key j's values start at v + offs[j] (its block's row).
template <int N, int NC>
inline void weigh_chunks(const float* const* p, const float* v, const int64_t* offs, int64_t n, float* const* out) {
  vf a[N][NC] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + offs[j];
    for (int c = 0; c < NC; ++c) {
      const vf vv = load(vr + c * LANES);
      for (int q = 0; q < N; ++q) a[q][c] += p[q][j] * vv;
    }
  }
  for (int q = 0; q < N; ++q) std::memcpy(out[q], a[q], sizeof a[q]);
}

template <int N>
inline void weigh(const float* const* p, const float* v, const int64_t* offs, int64_t n, int64_t D,
                  float* const* out) {
  switch (D % LANES ? 0 : D / LANES) {
    case 4: return weigh_chunks<N, 4>(p, v, offs, n, out);
    case 8: return weigh_chunks<N, 8>(p, v, offs, n, out);
    case 2: return weigh_chunks<N, 2>(p, v, offs, n, out);
    default: break;
  }
  for (int q = 0; q < N; ++q) std::fill(out[q], out[q] + D, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int q = 0; q < N; ++q)
      for (int64_t d = 0; d < D; ++d) out[q][d] += p[q][j] * v[offs[j] + d];
}

}  // namespace

// q [B, T, H, D] fp32 (any strides, D contiguous); kc, vc [N, bs, Hkv, D] fp32 (one layer's cache: N blocks
// of bs positions, contiguous); table int64 [B, P]: row b's position p lives in block table[b][p / bs] at
// p % bs; mask bool [B, T, end - lo] or empty (every key of [lo, end) visible). Returns [B, T, H * D] fp32.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                     const torch::Tensor& table, const torch::Tensor& mask, int64_t lo, int64_t end,
                     double scale, double softcap) {
  RECORD_FUNCTION("specd::attention", std::vector<c10::IValue>());  // what the profiler shows
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, "q: [B, T, H, D] fp32");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
              vc.sizes() == kc.sizes() && vc.scalar_type() == at::kFloat, "kc, vc: contiguous [N, bs, Hkv, D] fp32");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous(), "table: int64 [B, P]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t NB = kc.size(0), bs = kc.size(1), Hkv = kc.size(2), S = end - lo, P = table.size(1);
  TORCH_CHECK(kc.size(3) == D && H % Hkv == 0 && table.size(0) == B, "shapes disagree");
  TORCH_CHECK(0 <= lo && lo <= end && end <= P * bs, "keys [lo, end) outside the block table");
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * P; ++i) TORCH_CHECK(0 <= tp[i] && tp[i] < NB, "block ", tp[i], " outside the cache");
  const bool masked = mask.numel() > 0;
  if (masked)
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3 &&
                mask.size(0) == B && mask.size(1) == T && mask.size(2) == S, "mask: contiguous bool [B, T, end - lo]");
  auto out = torch::empty({B, T, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks1 = Hkv * D;
  const int64_t rep = H / Hkv;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // Work units: (row, KV head, a group of up to QG of the row's T * rep queries that read that KV head).
  // A group shares each key's and value's loads; how queries are grouped changes no query's bits.
  const int64_t nq = T * rep;
  const int64_t want = 2 * at::get_num_threads();
  const int64_t QG = B * Hkv * ((nq + 3) / 4) >= want ? 4 : (B * Hkv * ((nq + 1) / 2) >= want ? 2 : 1);
  const int64_t groups = (nq + QG - 1) / QG;
  const int64_t cap_s = (S + LANES - 1) / LANES * LANES + LANES;
  at::parallel_for(0, B * Hkv * groups, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> dense(4 * cap_s), compact(cap_s), acc(4 * D);
    std::vector<int64_t> offs(S);
    for (int64_t u = begin; u < stop; ++u) {
      const int64_t b = u / (Hkv * groups), kvh = u / groups % Hkv, g = u % groups;
      const int64_t* tb = tp + b * P;
      const float* kb = kp + kvh * D;
      const float* vb = vp + kvh * D;
      const int64_t q0 = g * QG, nqg = std::min(QG, nq - q0);
      const float* qs[4];
      const bool* ms[4];
      float* ps[4];
      float* os[4];
      int64_t jlo = end, jhi = lo;  // the keys any query of the group sees: [jlo, jhi)
      for (int64_t i = 0; i < nqg; ++i) {
        const int64_t t = (q0 + i) / rep, h = kvh * rep + (q0 + i) % rep;
        qs[i] = qp + b * qs0 + t * qs1 + h * qs2;
        ms[i] = masked ? mp + (b * T + t) * S : nullptr;
        ps[i] = dense.data() + i * cap_s;
        os[i] = acc.data() + i * D;
        int64_t a = lo, z = end;
        if (ms[i]) {
          while (a < end && !ms[i][a - lo]) ++a;
          while (z > a && !ms[i][z - 1 - lo]) --z;
        }
        jlo = std::min(jlo, a);
        jhi = std::max(jhi, z);
      }
      const int64_t n = std::max<int64_t>(jhi - jlo, 0);
      for (int64_t j = 0; j < n;) {  // where key jlo + j's row starts, block by block
        const int64_t p = jlo + j, o = p % bs, run = std::min(bs - o, n - j), at = (tb[p / bs] * bs + o) * ks1;
        for (int64_t r = 0; r < run; ++r) offs[j + r] = at + r * ks1;
        j += run;
      }
      for (int64_t j = 0; j < n; ++j) {  // every pair's score, the key's loads shared
        const float* k = kb + offs[j];
        switch (nqg) {
          case 4: dots<4>(qs, k, D, ps, j); break;
          case 3: dots<3>(qs, k, D, ps, j); break;
          case 2: dots<2>(qs, k, D, ps, j); break;
          default: dots<1>(qs, k, D, ps, j);
        }
      }
      float sums[4];
      for (int64_t i = 0; i < nqg; ++i) {  // each query's softmax over the keys it sees, by their rank
        float* p = ps[i];
        const bool* mr = ms[i] ? ms[i] + (jlo - lo) : nullptr;
        int64_t c = 0;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          if (mr && !mr[j]) continue;
          float x = p[j] * fscale;
          if (cap > 0.f) x = cap * std::tanh(x / cap);
          compact[c++] = x;
          m = x > m ? x : m;
        }
        const int64_t padded = (c + LANES - 1) / LANES * LANES;
        for (int64_t r = 0; r < c; ++r) compact[r] -= m;
        for (int64_t r = c; r < padded; ++r) compact[r] = -std::numeric_limits<float>::infinity();  // exp: 0
        vf lanes = {};
        for (int64_t r = 0; r < padded; r += LANES) {
          const vf e = exp_lanes(load(&compact[r]));
          std::memcpy(&compact[r], &e, sizeof e);
          lanes += e;
        }
        sums[i] = combine(lanes);
        for (int64_t j = 0, r = 0; j < n; ++j) p[j] = (mr && !mr[j]) ? 0.f : compact[r++];  // back by key
      }
      switch (nqg) {
        case 4: weigh<4>(ps, vb, offs.data(), n, D, os); break;
        case 3: weigh<3>(ps, vb, offs.data(), n, D, os); break;
        case 2: weigh<2>(ps, vb, offs.data(), n, D, os); break;
        default: weigh<1>(ps, vb, offs.data(), n, D, os);
      }
      for (int64_t i = 0; i < nqg; ++i) {
        const int64_t t = (q0 + i) / rep, h = kvh * rep + (q0 + i) % rep;
        float* orow = op + (b * T + t) * H * D + h * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = n ? os[i][d] / sums[i] : 0.f;
      }
    }
  });
  return out;
}

// `attend` fed by a fused qkv projection: qkv [B, T, (H + 2 Hkv) * D] fp32 (contiguous) is split
// into heads; the query and key heads are rotated (HF's rotate_half RoPE over the first R dims: x *
// cos + rotate_half(x) * sin, per element, with cos, sin [B, T, R] fp32 at each token's RoPE
// position); the keys and values are written into kc, vc at cache positions [B, T] (int64) of each
// row's blocks (`table`, as `attend` reads it); then attention as `attend`. One call for what takes a
// dozen small ops otherwise.
torch::Tensor attend_rope(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor kc, torch::Tensor vc, const torch::Tensor& table,
                          const torch::Tensor& positions, const torch::Tensor& mask, int64_t lo, int64_t end,
                          int64_t H, double scale, double softcap) {
  RECORD_FUNCTION("specd::rope_kv_write", std::vector<c10::IValue>());
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv: contiguous fp32 [B, T, *]");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
              vc.sizes() == kc.sizes() && vc.scalar_type() == at::kFloat, "kc, vc: contiguous [N, bs, Hkv, D] fp32");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
              table.size(0) == qkv.size(0), "table: int64 [B, P]");
  const int64_t B = qkv.size(0), T = qkv.size(1), bs = kc.size(1), Hkv = kc.size(2), D = kc.size(3);
  const int64_t NB = kc.size(0), P = table.size(1);
  TORCH_CHECK(qkv.size(2) == (H + 2 * Hkv) * D, "qkv has ", qkv.size(2), " features, expected (H + 2 Hkv) D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == sin.numel() && cos.numel() % (B * T) == 0, "cos, sin: fp32 [B, T, R]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == B * T,
              "positions: int64 [B, T]");
  const int64_t R = cos.numel() / (B * T), half = R / 2;
  TORCH_CHECK(R % 2 == 0 && R <= D, "rotary dims ", R, " for head dim ", D);
  auto q = torch::empty({B, T, H, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  for (int64_t i = 0; i < B * T; ++i) {
    TORCH_CHECK(0 <= pp[i] && pp[i] < P * bs, "cache position ", pp[i], " outside the block table (", P * bs, ")");
    const int64_t blk = tp[i / T * P + pp[i] / bs];
    TORCH_CHECK(0 <= blk && blk < NB, "block ", blk, " outside the cache");
  }
  at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t stop) {
    for (int64_t i = begin; i < stop; ++i) {
      const float* row = src + i * (H + 2 * Hkv) * D;
      const float* c = cp + i * R;
      const float* s = sp + i * R;
      const int64_t base = (tp[i / T * P + pp[i] / bs] * bs + pp[i] % bs) * Hkv * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* x = row + h * D;
        float* y = h < H ? qp + (i * H + h) * D : kp + base + (h - H) * D;
        for (int64_t d = 0; d < half; ++d) {
          y[d] = x[d] * c[d] + (-x[d + half]) * s[d];
          y[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
        }
        for (int64_t d = R; d < D; ++d) y[d] = x[d];
      }
      std::memcpy(vp + base, row + (H + Hkv) * D, Hkv * D * sizeof(float));
    }
  });
  return attend(q, kc, vc, table, mask, lo, end, scale, softcap);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as ATen's ops (and blocks.cpp's) run
  m.def("attend", &attend, "row-invariant attention over a KV cache of blocks",
        py::call_guard<py::gil_scoped_release>());
  // RoPE, the KV write and attention from a fused qkv, for the block kernel's layer loop (blocks.cpp
  // run_layers), which calls it by address, without a trip through Python
  m.def("attend_rope_address", []() { return reinterpret_cast<int64_t>(&attend_rope); });
}
