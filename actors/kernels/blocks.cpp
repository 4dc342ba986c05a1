// GGUF block matmul on the CPU: y = x @ W^T with W in its own Q4_1 / Q8_0 blocks of 32 weights and
// x quantized per row to Q8 blocks (int8 q, one fp32 scale per 32, as llama.cpp's Q8 dot products
// do), for every width of pass (actors/kernels/__init__.py, actors/native.py).
//
// Flat in width: a thread owns a tile of 16 outputs; for each block of 32 inputs it unpacks the
// tile's weights once into registers and applies them to every row of the call (up to ROWS rows a
// sweep), so a call of 8 rows reads the weights as often as a call of one.
//
// Row-invariant by construction, and the same bits on every ISA path: for one output of one row the
// sum over a block is an exact integer (int8 x 4-bit or int8, int32 lanes), and the blocks are then
// accumulated in block order with the same fp32 operations on every path (a float of the integer,
// times the weight block's scale, fused-multiply-added at the row's scale; Q4_1's minimum terms
// fused-multiply-added at the row's block sums into a second sum, added to the first at the end). Nothing about the row depends on the other rows, the
// number of rows or the thread count (no reduction is split across threads), and AVX-512 VNNI,
// AVX2 and the scalar loop compute the same integers and the same fp32 sequence.
//
// ISA paths: AMX (int8 tiles: one tile op per block for up to 16 rows, calls of 8 rows or more; fewer
// take the AVX-512 path, whose bits are the same), AVX-512 (F/BW/VL/VNNI: vpdpbusd over 16 outputs),
// AVX2+FMA+F16C (vpmaddubsw over 8 outputs, twice per tile), and scalar C++ (any CPU; the tests'
// reference). Each is compiled with a
// target attribute, so the library runs on any x86-64 CPU; `isa()` says what this CPU can run and
// the caller picks at most that (SPECD_ISA forces a lower one to test it).
//
// Layouts (built in Python by actors/native.py::pack): for tile t of 16 outputs and block b,
//   Q4_1 weights: 256 bytes = [i 0..3][lane 0..15][byte 0..3]; the low nibble of byte (i, j, c) is
//                 the weight of output 16t+j at input 32b+4i+c, its high nibble the one at 32b+16+4i+c;
//                 scales: 32 fp16 = the 16 outputs' d, then their m (w = d*q + m).
//   Q8_0 weights: 512 bytes = [i 0..7][lane 0..15][byte 0..3], int8 at input 32b+4i+c;
//                 scales: 16 fp16 d (w = d*q).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SPECD_X86 1
#endif

namespace {

constexpr int G = 32;      // weights per block
constexpr int NT = 16;     // outputs per tile
constexpr int ROWS = 32;   // rows a sweep over one tile's blocks takes
constexpr int PREFETCH = 8;  // blocks ahead whose weights a sweep prefetches (past a tile's end: the next tile's)
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, AMX = 3 };
constexpr int64_t AMX_ROWS = 16;  // rows of one AMX tile; calls of fewer than AMX_MIN rows take the AVX-512 path
// (measured on a 2-core Sapphire Rapids KVM guest: AMX loses at 4 rows, gains 10% at 8 and 25% at 16)
constexpr int64_t AMX_MIN = 8;
enum Kind : int64_t { Q4_1 = 0, Q8_0 = 1 };

int tile_bytes(int64_t kind) { return kind == Q4_1 ? 256 : 512; }
int tile_scales(int64_t kind) { return kind == Q4_1 ? 32 : 16; }

// One call's rows as Q8 blocks: q [M, K], per block its scale d and the integer sum of its q.
struct Act {
  const int8_t* q;
  const float* d;
  const int32_t* isum;
  int64_t K, nb;
};

float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// ---- activation quantization: d = max|x| / 127, q = round-to-nearest-even(x / d) computed as
// x * (1 / d); the same operations on every path.
void quant_block_scalar(const float* x, int8_t* q, float* d, int32_t* isum) {
  float amax = 0.f;
  for (int k = 0; k < G; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
  int32_t s = 0;
  for (int k = 0; k < G; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[k] * id));
    q[k] = static_cast<int8_t>(v);
    s += v;
  }
  *d = dd;
  *isum = s;
}

// ---- the scalar path: the reference every other path agrees with bitwise
void tile_scalar(int64_t kind, const uint8_t* W, const uint16_t* S, const Act& a, int64_t r0, int64_t rows,
                 float* acc) {
  float accm[ROWS * NT] = {};
  std::fill(acc, acc + rows * NT, 0.f);
  const int tb = tile_bytes(kind), ts = tile_scales(kind);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = W + b * tb;
    const uint16_t* sb = S + b * ts;
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* xq = a.q + (r0 + r) * a.K + b * G;
      const float dx = a.d[(r0 + r) * a.nb + b];
      const float sx = static_cast<float>(a.isum[(r0 + r) * a.nb + b]) * dx;
      for (int j = 0; j < NT; ++j) {
        int32_t dot = 0;
        if (kind == Q4_1) {
          for (int i = 0; i < 4; ++i)
            for (int c = 0; c < 4; ++c) {
              const uint8_t byte = wb[(i * NT + j) * 4 + c];
              dot += static_cast<int32_t>(byte & 0xF) * xq[4 * i + c] + static_cast<int32_t>(byte >> 4) * xq[16 + 4 * i + c];
            }
        } else {
          for (int i = 0; i < 8; ++i)
            for (int c = 0; c < 4; ++c)
              dot += static_cast<int32_t>(static_cast<int8_t>(wb[(i * NT + j) * 4 + c])) * xq[4 * i + c];
        }
        const float u = static_cast<float>(dot) * half_to_float(sb[j]);
        acc[r * NT + j] = std::fma(u, dx, acc[r * NT + j]);
        if (kind == Q4_1) accm[r * NT + j] = std::fma(half_to_float(sb[NT + j]), sx, accm[r * NT + j]);
      }
    }
  }
  for (int64_t i = 0; i < rows * NT; ++i) acc[i] += accm[i];
}

#ifdef SPECD_X86
// ---- AVX2 + FMA + F16C: a tile as two halves of 8 outputs
__attribute__((target("avx2,fma,f16c"))) void quant_block_avx2(const float* x, int8_t* q, float* d, int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int k = 0; k < G; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i s = _mm256_setzero_si256();
  alignas(32) int32_t v[G];
  for (int k = 0; k < G; k += 8) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vid));  // MXCSR: nearest-even
    _mm256_store_si256(reinterpret_cast<__m256i*>(v + k), qi);
    s = _mm256_add_epi32(s, qi);
  }
  for (int k = 0; k < G; ++k) q[k] = static_cast<int8_t>(v[k]);
  alignas(32) int32_t sl[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sl), s);
  int32_t t = 0;
  for (int32_t e : sl) t += e;
  *d = dd;
  *isum = t;
}

__attribute__((target("avx2,fma,f16c"))) void tile_avx2(int64_t kind, const uint8_t* W, const uint16_t* S,
                                                        const Act& a, int64_t r0, int64_t rows, float* acc) {
  const int tb = tile_bytes(kind), ts = tile_scales(kind);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float accm[ROWS * NT];
  for (int64_t r = 0; r < rows * NT; r += 8) {
    _mm256_storeu_ps(acc + r, _mm256_setzero_ps());
    _mm256_storeu_ps(accm + r, _mm256_setzero_ps());
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = W + b * tb;
    const uint16_t* sb = S + b * ts;
    for (int c = 0; c < tb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH * tb + c), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];
      if (kind == Q4_1) {
        for (int i = 0; i < 4; ++i) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
          w[i] = _mm256_and_si256(raw, low);
          w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
      } else {
        for (int i = 0; i < 8; ++i) w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8 * h)));
      const __m256 m = kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + NT + 8 * h)))
                                    : _mm256_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + (r0 + r) * a.K + b * G);
        __m256i dot;
        if (kind == Q4_1) {  // u4 x s8 pairs <= 2*15*127, eight of them fit an int16
          __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xq[0]));
          for (int i = 1; i < 8; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(xq[i])));
          dot = _mm256_madd_epi16(p, ones);
        } else {  // |w| x (x signed as w): pairs <= 2*128*127
          dot = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xq[i]), w[i]);
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[i]), xs), ones));
          }
        }
        const float dx = a.d[(r0 + r) * a.nb + b];
        float* ar = acc + r * NT + 8 * h;
        _mm256_storeu_ps(ar, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), d), _mm256_set1_ps(dx),
                                             _mm256_loadu_ps(ar)));
        if (kind == Q4_1) {
          const float sx = static_cast<float>(a.isum[(r0 + r) * a.nb + b]) * dx;
          float* mr = accm + r * NT + 8 * h;
          _mm256_storeu_ps(mr, _mm256_fmadd_ps(m, _mm256_set1_ps(sx), _mm256_loadu_ps(mr)));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows * NT; r += 8)
    _mm256_storeu_ps(acc + r, _mm256_add_ps(_mm256_loadu_ps(acc + r), _mm256_loadu_ps(accm + r)));
}

// ---- AVX-512 F/BW/VL/VNNI: a tile in one register of 16 int32 lanes
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void quant_block_avx512(
    const float* x, int8_t* q, float* d, int32_t* isum) {
  const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(x)), a1 = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), vid));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  *d = dd;
  *isum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

// R rows of one tile, their accumulators in registers across the blocks (d-terms and Q4_1's m-terms apart).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) inline void rows_avx512(
    int64_t kind, const uint8_t* W, const uint16_t* S, const Act& a, int64_t r0, float* acc) {
  const int tb = tile_bytes(kind), ts = tile_scales(kind);
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 ad[R], am[R];
  for (int r = 0; r < R; ++r) ad[r] = am[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = W + b * tb;
    const uint16_t* sb = S + b * ts;
    for (int c = 0; c < tb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH * tb + c), _MM_HINT_T0);
    __m512i w[8];
    if (kind == Q4_1) {
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(wb + i * 64);
        w[i] = _mm512_and_si512(raw, low);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
    } else {  // int8 w as the unsigned w + 128; the row's 128 * sum(q) taken off after
      for (int i = 0; i < 8; ++i) w[i] = _mm512_xor_si512(_mm512_loadu_si512(wb + i * 64), flip);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    for (int r = 0; r < R; ++r) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + (r0 + r) * a.K + b * G);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[i], _mm512_set1_epi32(xq[i]));
        s1 = _mm512_dpbusd_epi32(s1, w[i + 1], _mm512_set1_epi32(xq[i + 1]));
      }
      __m512i dot = _mm512_add_epi32(s0, s1);
      const int32_t isum = a.isum[(r0 + r) * a.nb + b];
      if (kind == Q8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * isum));
      const float dx = a.d[(r0 + r) * a.nb + b];
      ad[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), _mm512_set1_ps(dx), ad[r]);
      if (kind == Q4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + NT)));
        am[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(static_cast<float>(isum) * dx), am[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * NT, _mm512_add_ps(ad[r], am[r]));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void tile_avx512(
    int64_t kind, const uint8_t* W, const uint16_t* S, const Act& a, int64_t r0, int64_t rows, float* acc) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) rows_avx512<4>(kind, W, S, a, r0 + r, acc + r * NT);
  switch (rows - r) {
    case 3: rows_avx512<3>(kind, W, S, a, r0 + r, acc + r * NT); break;
    case 2: rows_avx512<2>(kind, W, S, a, r0 + r, acc + r * NT); break;
    case 1: rows_avx512<1>(kind, W, S, a, r0 + r, acc + r * NT); break;
    default: break;
  }
}

// ---- AMX (int8 tiles): one tile op per block computes the block's integer dots of up to 16 rows x
// 16 outputs (TDPBSUD: int8 activations x unsigned 4-bit weights; TDPBSSD: x int8 weights), the
// same integers as vpdpbusd; the fp32 sequence after is the AVX-512 path's.
struct TileConfig {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two sets of tiles, for two blocks in flight: C, A, B = tmm0-2 (even blocks) and tmm3-5 (odd ones).
__attribute__((target("amx-tile,amx-int8"))) void amx_begin(int rows) {
  alignas(64) TileConfig c;
  for (int set = 0; set < 6; set += 3) {
    c.rows[set] = rows, c.colsb[set] = NT * 4;    // C: rows x 16 int32
    c.rows[set + 1] = rows, c.colsb[set + 1] = G;  // A: rows x 32 int8 (one block of each row)
    c.rows[set + 2] = G / 4, c.colsb[set + 2] = NT * 4;  // B: 8 quads x 16 outputs x 4 bytes (the packed layout)
  }
  asm volatile("" : : "r"(&c) : "memory");  // the stores above must reach memory: ldtilecfg reads them
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile,amx-int8"))) void amx_end() { _tile_release(); }

// The block's weights as a B tile: Q4_1 nibbles unpacked into `buf`, Q8_0's int8 as packed.
__attribute__((target("avx512f,avx512bw"))) inline const uint8_t* amx_b(int64_t kind, const uint8_t* wb, uint8_t* buf) {
  if (kind != Q4_1) return wb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i raw = _mm512_loadu_si512(wb + i * 64);
    _mm512_store_si512(buf + i * 64, _mm512_and_si512(raw, low));
    _mm512_store_si512(buf + (i + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
  }
  return buf;
}

// One block's integer dots (rows x 16, from a C tile) into the rows' sums: the AVX-512 path's fp32 sequence.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline void amx_scale(
    int64_t kind, const uint16_t* sb, const Act& a, int64_t b, const int32_t* dots, int64_t r0, int64_t rows,
    float* acc, float* am) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
  const __m512 m = kind == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + NT)))
                                : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i dot = _mm512_load_si512(dots + r * NT);
    const int64_t i = (r0 + r) * a.nb + b;
    const float dx = a.d[i];
    float* ar = acc + r * NT;
    _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), _mm512_set1_ps(dx),
                                         _mm512_loadu_ps(ar)));
    if (kind == Q4_1)
      _mm512_store_ps(am + r * NT, _mm512_fmadd_ps(m, _mm512_set1_ps(static_cast<float>(a.isum[i]) * dx),
                                                   _mm512_load_ps(am + r * NT)));
  }
}

// xa: the rows' blocks as [block][rc rows][32] int8 (rc = the configured tile rows; rows past the call's zero)
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void tile_amx(
    int64_t kind, const uint8_t* W, const uint16_t* S, const Act& a, const int8_t* xa, int64_t rc, int64_t r0,
    int64_t rows, float* acc) {
  const int tb = tile_bytes(kind), ts = tile_scales(kind);
  alignas(64) uint8_t B[2][8 * 64];
  alignas(64) int32_t C[2][AMX_ROWS * NT];
  alignas(64) float am[AMX_ROWS * NT];
  for (int64_t r = 0; r < rows; ++r) {
    _mm512_storeu_ps(acc + r * NT, _mm512_setzero_ps());
    _mm512_store_ps(am + r * NT, _mm512_setzero_ps());
  }
  int64_t b = 0;
  for (; b + 1 < a.nb; b += 2) {
    for (int c = 0; c < 2 * tb; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(W + (b + PREFETCH) * tb + c), _MM_HINT_T0);
    const uint8_t* b0 = amx_b(kind, W + b * tb, B[0]);
    const uint8_t* b1 = amx_b(kind, W + (b + 1) * tb, B[1]);
    _tile_zero(0);
    _tile_zero(3);
    _tile_loadd(1, xa + b * rc * G, G);
    _tile_loadd(2, b0, 64);
    _tile_loadd(4, xa + (b + 1) * rc * G, G);
    _tile_loadd(5, b1, 64);
    if (kind == Q4_1) {
      _tile_dpbsud(0, 1, 2);
      _tile_dpbsud(3, 4, 5);
    } else {
      _tile_dpbssd(0, 1, 2);
      _tile_dpbssd(3, 4, 5);
    }
    _tile_stored(0, C[0], NT * 4);
    _tile_stored(3, C[1], NT * 4);
    amx_scale(kind, S + b * ts, a, b, C[0], r0, rows, acc, am);
    amx_scale(kind, S + (b + 1) * ts, a, b + 1, C[1], r0, rows, acc, am);
  }
  if (b < a.nb) {
    _tile_zero(0);
    _tile_loadd(1, xa + b * rc * G, G);
    _tile_loadd(2, amx_b(kind, W + b * tb, B[0]), 64);
    if (kind == Q4_1)
      _tile_dpbsud(0, 1, 2);
    else
      _tile_dpbssd(0, 1, 2);
    _tile_stored(0, C[0], NT * 4);
    amx_scale(kind, S + b * ts, a, b, C[0], r0, rows, acc, am);
  }
  for (int64_t r = 0; r < rows; ++r)
    _mm512_storeu_ps(acc + r * NT, _mm512_add_ps(_mm512_loadu_ps(acc + r * NT), _mm512_load_ps(am + r * NT)));
}
#endif

int64_t isa() {
#ifdef SPECD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni")) {
    // AMX's tile data is granted per process by the kernel (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    static const bool amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                            syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx ? AMX : AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return AVX2;
#endif
  return SCALAR;
}

void quant_block(int64_t path, const float* x, int8_t* q, float* d, int32_t* isum) {
#ifdef SPECD_X86
  if (path >= AVX512) return quant_block_avx512(x, q, d, isum);
  if (path == AVX2) return quant_block_avx2(x, q, d, isum);
#endif
  quant_block_scalar(x, q, d, isum);
}

void tile(int64_t path, int64_t kind, const uint8_t* W, const uint16_t* S, const Act& a, int64_t r0, int64_t rows,
          float* acc) {
#ifdef SPECD_X86
  if (path >= AVX512) return tile_avx512(kind, W, S, a, r0, rows, acc);
  if (path == AVX2) return tile_avx2(kind, W, S, a, r0, rows, acc);
#endif
  tile_scalar(kind, W, S, a, r0, rows, acc);
}

// The row's RMSNorm in one order at every width and on every path: x^2 summed in 16 partial sums
// by index (mul then add: built without contraction), combined pairwise; y = (x * (1 / sqrt(mean + eps))) * w.
void rms_row(const float* x, const float* w, float eps, int64_t K, float* y) {
  float part[16] = {};
  int64_t k0 = 0;
  for (; k0 + 16 <= K; k0 += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[k0 + j] * x[k0 + j];
  for (int j = 0; k0 + j < K; ++j) part[j] += x[k0 + j] * x[k0 + j];
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) part[i] += part[i + width];
  const float r = 1.f / std::sqrt(part[0] / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = (x[k] * r) * w[k];
}

// y [..., n] = prep(x [..., K]) @ W^T (+ residual); W packed [tiles, K/32 * tile bytes] uint8, S [tiles, K/32 *
// tile scales] fp16 bits (int16). prep: x as is, or RMSNorm(x) with `norm` (fp32 [K]) and `eps`
// where norm is defined (x is then normalised per row before its quantization: a norm and the
// matmul after it in one call). residual, where defined, is [..., n] and added to the result. x in
// fp32 or bf16; y in x's dtype (the residual's, where given).
torch::Tensor matmul(torch::Tensor x_in, torch::Tensor W, torch::Tensor S, int64_t kind, int64_t n, int64_t path,
                     c10::optional<torch::Tensor> norm, double eps, c10::optional<torch::Tensor> residual) {
  RECORD_FUNCTION("specd::block_matmul", std::vector<c10::IValue>());  // what the profiler shows
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "x must be a CPU tensor");
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "kind must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(path >= SCALAR && path <= isa(), "ISA path ", path, " is not supported by this CPU (best: ", isa(), ")");
  const int64_t M = x.size(0), K = x.size(1), nb = K / G, tiles = W.size(0);
  TORCH_CHECK(K % G == 0, "in_features ", K, " is not a multiple of ", G);
  TORCH_CHECK(W.dtype() == torch::kUInt8 && W.is_contiguous() && W.size(1) == nb * tile_bytes(kind), "bad packed weight");
  TORCH_CHECK(S.dtype() == torch::kInt16 && S.is_contiguous() && S.size(1) == nb * tile_scales(kind), "bad scales");
  TORCH_CHECK(n <= tiles * NT, "n ", n, " exceeds the packed tiles");
  torch::Tensor nw;
  if (norm.has_value()) {
    nw = norm->to(torch::kFloat32).contiguous();
    TORCH_CHECK(nw.numel() == K, "norm weight has ", nw.numel(), " elements for ", K, " features");
  }
  torch::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.numel() == M * n && res.size(-1) == n, "residual must be [..., n] with x's rows");
  }
  const auto xf = x.to(torch::kFloat32).contiguous();
  // The quantized rows in buffers kept per thread across calls (a call is a few microseconds at one row).
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> is;
  q.resize(M * K);
  d.resize(M * nb);
  is.resize(M * nb);
  {
    const float* xp = xf.data_ptr<float>();
    const float* np = nw.defined() ? nw.data_ptr<float>() : nullptr;
    int8_t* qp = q.data();
    float* dp = d.data();
    int32_t* ip = is.data();
    auto quantize = [&](int64_t lo, int64_t hi) {
      std::vector<float> row(np ? K : 0);
      for (int64_t r = lo; r < hi; ++r) {
        const float* src = xp + r * K;
        if (np) {
          rms_row(src, np, static_cast<float>(eps), K, row.data());
          src = row.data();
        }
        for (int64_t b = 0; b < nb; ++b)
          quant_block(path, src + b * G, qp + r * K + b * G, dp + r * nb + b, ip + r * nb + b);
      }
    };
    if (M == 1) quantize(0, 1); else at::parallel_for(0, M, 1, quantize);
  }
  const Act a{q.data(), d.data(), is.data(), K, nb};
  auto y = torch::empty({M, n}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const uint8_t* Wp = W.data_ptr<uint8_t>();
  const uint16_t* Sp = reinterpret_cast<const uint16_t*>(S.data_ptr<int16_t>());
  const int64_t wstride = W.size(1), sstride = S.size(1);
#ifdef SPECD_X86
  if (path == AMX && M >= AMX_MIN) {
    // the rows' blocks as AMX A tiles: [row group][block][rc rows][32], rows past M zero
    const int64_t rc = std::min<int64_t>(M, AMX_ROWS), groups = (M + rc - 1) / rc;
    thread_local std::vector<int8_t> xa;
    xa.assign(groups * nb * rc * G, 0);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b)
        std::memcpy(xa.data() + ((r / rc * nb + b) * rc + r % rc) * G, a.q + r * K + b * G, G);
    const int8_t* xp = xa.data();
    at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
      amx_begin(static_cast<int>(rc));
      alignas(64) float acc[AMX_ROWS * NT];
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t cols = std::min<int64_t>(NT, n - t * NT);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = g * rc, rows = std::min<int64_t>(rc, M - r0);
          tile_amx(kind, Wp + t * wstride, Sp + t * sstride, a, xp + g * nb * rc * G, rc, r0, rows, acc);
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(yp + (r0 + r) * n + t * NT, acc + r * NT, cols * sizeof(float));
        }
      }
      amx_end();
    });
  } else
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float acc[ROWS * NT];
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t cols = std::min<int64_t>(NT, n - t * NT);
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int64_t rows = std::min<int64_t>(ROWS, M - r0);
        tile(path, kind, Wp + t * wstride, Sp + t * sstride, a, r0, rows, acc);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(yp + (r0 + r) * n + t * NT, acc + r * NT, cols * sizeof(float));
      }
    }
  });
  if (res.defined()) {
    y.add_(res.to(torch::kFloat32).view({M, n}));  // one rounding per element, at every width
    return (res.scalar_type() == torch::kFloat32 ? y : y.to(res.scalar_type())).view(out_shape);
  }
  return (x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type())).view(out_shape);
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  RECORD_FUNCTION("specd::rms_norm", std::vector<c10::IValue>());
  const int64_t K = x.size(-1), M = x.numel() / K;
  const auto xf = x.to(torch::kFloat32).contiguous();
  const auto wf = w.to(torch::kFloat32).contiguous();
  auto y = torch::empty_like(xf);
  const float* xp = xf.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_row(xp + r * K, wp, static_cast<float>(eps), K, yp + r * K);
  });
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

using AttendRope = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor,
                                     torch::Tensor, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                     int64_t, int64_t, int64_t, double, double);

// A stack of plain Llama layers over block tiles in one call (LlamaRunner.forward's fused path): per layer
// RMSNorm + qkv, then RoPE + the KV write + attention (attention.cpp's attend_rope, by its address), the
// output projection + residual, RMSNorm + gate/up, SiLU(gate) * up, down + residual. x [B, T, E] fp32;
// w: per layer the (tiles, scales) of qkv, o, gate/up, down; kinds, ns: per layer their kind and outputs;
// norms: per layer the attention and MLP norm weights (fp32); kc, vc [L, N, bs, Hkv, D] with each row's
// blocks in table int64 [B, P] (attention.cpp's `attend`). Returns the last
// layer's output, then the outputs of the layers in `taps`, in that order.
std::vector<torch::Tensor> run_layers(torch::Tensor x, const std::vector<torch::Tensor>& w,
                                      const std::vector<int64_t>& kinds, const std::vector<int64_t>& ns,
                                      const std::vector<torch::Tensor>& norms, int64_t path, double eps,
                                      const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kc,
                                      const torch::Tensor& vc, const torch::Tensor& table,
                                      const torch::Tensor& positions, const torch::Tensor& mask, int64_t lo,
                                      int64_t end, int64_t H, double scale, int64_t attend_address,
                                      const std::vector<int64_t>& taps) {
  const int64_t L = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 8 * L && static_cast<int64_t>(kinds.size()) == 4 * L &&
              static_cast<int64_t>(ns.size()) == 4 * L && kc.size(0) >= L, "run_layers: inconsistent layer lists");
  const auto attend = reinterpret_cast<AttendRope>(attend_address);
  std::vector<torch::Tensor> out(1);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* lw = w.data() + 8 * l;
    const int64_t* k = kinds.data() + 4 * l;
    const int64_t* n = ns.data() + 4 * l;
    const auto qkv = matmul(x, lw[0], lw[1], k[0], n[0], path, norms[2 * l], eps, c10::nullopt);
    const auto a = attend(qkv, cos, sin, kc.select(0, l), vc.select(0, l), table, positions, mask, lo, end, H,
                          scale, 0.0);
    x = matmul(a, lw[2], lw[3], k[1], n[1], path, c10::nullopt, 0.0, x);
    const auto gu = matmul(x, lw[4], lw[5], k[2], n[2], path, norms[2 * l + 1], eps, c10::nullopt);
    const int64_t I = n[2] / 2;
    x = matmul(at::silu(gu.narrow(-1, 0, I)) * gu.narrow(-1, I, I), lw[6], lw[7], k[3], n[3], path, c10::nullopt,
               0.0, x);
    if (std::find(taps.begin(), taps.end(), l) != taps.end()) out.push_back(x);
  }
  out[0] = x;
  return out;
}

}  // namespace

// Each call lets go of the GIL, as ATen's own ops do: a serving replica's event loop (streaming the
// last step's tokens) runs on another core while a pass computes, instead of waiting for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("matmul", &matmul, "x @ W^T over GGUF Q4_1 / Q8_0 blocks, activations as Q8 blocks", py::arg("x"),
        py::arg("W"), py::arg("S"), py::arg("kind"), py::arg("n"), py::arg("path"), py::arg("norm") = py::none(),
        py::arg("eps") = 0.0, py::arg("residual") = py::none(), nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, in one order at every width", nogil());
  m.def("run_layers", &run_layers, "a stack of plain Llama layers over block tiles in one call", nogil());
  m.def("isa", &isa, "the best ISA path this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX (int8 tiles)");
}
