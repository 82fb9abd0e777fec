// Kiln's CPU kernels for a step (kiln/kernels/cpu.py): paged attention for tiles of a few query rows (at
// the end), and products with quantized weights without the float32 copy of the weight that XLA:CPU
// writes and reads back before its matrix multiply: x [T, in] @ an int4 weight (the layers'
// projections), and x against an int8 table's rows (the LM head); a few rows streamed, more in panels.
//
// The weight is Kiln's Int4Weight (kiln/models/quant.py): levels q in 0..15, two per byte, one
// scale s and offset m (float16 or float32) per group of G input rows and output column, w = q * s + m. Pairs run
// along `in` (packed [in / 2, out]: row 2j in the low nibble, 2j + 1 in the high) or along `out`
// (packed [in, out / 2]: column j in the low nibble, out / 2 + j in the high). For each group,
//     y[t, o] += s[g, o] * sum_k x[t, k] q[k, o] + m[g, o] * sum_k x[t, k]
// with float32 sums. Output columns are split into blocks across XLA's intra-op threads.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;  // output columns a block keeps in registers (four AVX-512 vectors)
constexpr int64_t kTail = 16;   // the last columns' blocks: every width is a multiple of this
constexpr int64_t kMaxRows = 4;  // rows the streaming kernels take (more: the panels below)
// packed rows fetched ahead of the one multiplied: a block reads one cache line of each row, a stride
// apart, which the hardware's prefetchers follow too late (the default model's layers 1.2x faster)
constexpr int64_t kPrefetchRows = 16;

template <typename S>  // the scales' and offsets' type: float16 (GGUF's own) or float32
struct Problem {
  const float* x;        // [T, in]
  const uint8_t* packed;  // [in / 2, out] or [in, out / 2]
  const S* scale;        // [groups, out]
  const S* offset;       // [groups, out]
  float* y;              // [T, out]
  int64_t rows, in, out, groups;
  bool along_out;
};

// W output columns from o0 of pairs along `in`, for R rows: the partial sums stay in registers.
template <int R, int W, typename S>
void AlongIn(const Problem<S>& p, int64_t o0) {
  const int64_t per_group = p.in / p.groups;  // input rows per group (even)
  float acc[R][W] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    float part[R][W] = {};
    float xsum[R] = {};
    for (int64_t r = g * per_group / 2; r < (g + 1) * per_group / 2; ++r) {
      const uint8_t* b = p.packed + r * p.out + o0;
      for (int t = 0; t < R; ++t) {
        const float x0 = p.x[t * p.in + 2 * r], x1 = p.x[t * p.in + 2 * r + 1];
        xsum[t] += x0 + x1;
        for (int j = 0; j < W; ++j) {
          part[t][j] += x0 * static_cast<float>(b[j] & 15) + x1 * static_cast<float>(b[j] >> 4);
        }
      }
    }
    const S* s = p.scale + g * p.out + o0;
    const S* m = p.offset + g * p.out + o0;
    for (int t = 0; t < R; ++t) {
      for (int j = 0; j < W; ++j) {
        acc[t][j] += static_cast<float>(s[j]) * part[t][j] + static_cast<float>(m[j]) * xsum[t];
      }
    }
  }
  for (int t = 0; t < R; ++t) std::memcpy(p.y + t * p.out + o0, acc[t], W * sizeof(float));
}

// W packed columns from c0 of pairs along `out`: outputs c0.. (low nibbles) and out / 2 + c0.. (high).
template <int R, int W, typename S>
void AlongOut(const Problem<S>& p, int64_t c0) {
  const int64_t half = p.out / 2, per_group = p.in / p.groups;
  float acc_lo[R][W] = {}, acc_hi[R][W] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    float part_lo[R][W] = {}, part_hi[R][W] = {};
    float xsum[R] = {};
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      const uint8_t* b = p.packed + k * half + c0;
      for (int t = 0; t < R; ++t) {
        const float xk = p.x[t * p.in + k];
        xsum[t] += xk;
        for (int j = 0; j < W; ++j) {
          part_lo[t][j] += xk * static_cast<float>(b[j] & 15);
          part_hi[t][j] += xk * static_cast<float>(b[j] >> 4);
        }
      }
    }
    const S* s = p.scale + g * p.out;
    const S* m = p.offset + g * p.out;
    for (int t = 0; t < R; ++t) {
      for (int j = 0; j < W; ++j) {
        acc_lo[t][j] += static_cast<float>(s[c0 + j]) * part_lo[t][j] + static_cast<float>(m[c0 + j]) * xsum[t];
        acc_hi[t][j] += static_cast<float>(s[half + c0 + j]) * part_hi[t][j] +
                        static_cast<float>(m[half + c0 + j]) * xsum[t];
      }
    }
  }
  for (int t = 0; t < R; ++t) {
    std::memcpy(p.y + t * p.out + c0, acc_lo[t], W * sizeof(float));
    std::memcpy(p.y + t * p.out + half + c0, acc_hi[t], W * sizeof(float));
  }
}

// Columns [lo, hi) (a multiple of kTail): blocks of kBlock, then of kTail.
template <int R, typename S>
void RunRows(const Problem<S>& p, int64_t lo, int64_t hi) {
  int64_t c = lo;
  for (; c + kBlock <= hi; c += kBlock) p.along_out ? AlongOut<R, kBlock>(p, c) : AlongIn<R, kBlock>(p, c);
  for (; c < hi; c += kTail) p.along_out ? AlongOut<R, kTail>(p, c) : AlongIn<R, kTail>(p, c);
}

#if defined(__AVX512F__)
// With AVX-512 the levels are widened 16 bytes at a time straight into 32-bit lanes (one shuffle per
// 32 levels, where the compiler's own widening of 64 bytes takes three), and the high nibble is
// masked in place (16 q) and multiplied by x / 16: each 16 bytes cost a widening, two masks, two
// conversions and two multiply-adds per row.
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// V vectors of 16 output columns from o0 (pairs along `in`) for R rows.
template <int R, int V, typename S>
void AlongInAvx512(const Problem<S>& p, int64_t o0) {
  const int64_t pairs = p.in / p.groups / 2;
  const __m512i low = _mm512_set1_epi32(15), high = _mm512_set1_epi32(0xF0);
  __m512 acc[R][V];
  for (int t = 0; t < R; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 part[R][V];
    for (int t = 0; t < R; ++t)
      for (int v = 0; v < V; ++v) part[t][v] = _mm512_setzero_ps();
    float xsum[R] = {};
    for (int64_t r = g * pairs; r < (g + 1) * pairs; ++r) {
      __m512 x0[R], x1[R];
      for (int t = 0; t < R; ++t) {
        const float a = p.x[t * p.in + 2 * r], b = p.x[t * p.in + 2 * r + 1];
        xsum[t] += a + b;
        x0[t] = _mm512_set1_ps(a);
        x1[t] = _mm512_set1_ps(b * 0.0625f);
      }
      const uint8_t* row = p.packed + r * p.out + o0;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * p.out), _MM_HINT_T0);
      for (int v = 0; v < V; ++v) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
        const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
        const __m512 qh = _mm512_cvtepi32_ps(_mm512_and_si512(q, high));
        for (int t = 0; t < R; ++t) part[t][v] = _mm512_fmadd_ps(qh, x1[t], _mm512_fmadd_ps(ql, x0[t], part[t][v]));
      }
    }
    for (int v = 0; v < V; ++v) {
      const __m512 sv = Load16(p.scale + g * p.out + o0 + 16 * v), mv = Load16(p.offset + g * p.out + o0 + 16 * v);
      for (int t = 0; t < R; ++t) {
        acc[t][v] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[t]), _mm512_fmadd_ps(sv, part[t][v], acc[t][v]));
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(p.y + t * p.out + o0 + 16 * v, acc[t][v]);
}

// V vectors of 16 packed columns from c0 (pairs along `out`: outputs c0.. and out / 2 + c0..) for R rows.
template <int R, int V, typename S>
void AlongOutAvx512(const Problem<S>& p, int64_t c0) {
  const int64_t half = p.out / 2, per_group = p.in / p.groups;
  const __m512i low = _mm512_set1_epi32(15), high = _mm512_set1_epi32(0xF0);
  __m512 acc_lo[R][V], acc_hi[R][V];
  for (int t = 0; t < R; ++t)
    for (int v = 0; v < V; ++v) acc_lo[t][v] = acc_hi[t][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 part_lo[R][V], part_hi[R][V];
    for (int t = 0; t < R; ++t)
      for (int v = 0; v < V; ++v) part_lo[t][v] = part_hi[t][v] = _mm512_setzero_ps();
    float xsum[R] = {};
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      __m512 xl[R], xh[R];
      for (int t = 0; t < R; ++t) {
        const float a = p.x[t * p.in + k];
        xsum[t] += a;
        xl[t] = _mm512_set1_ps(a);
        xh[t] = _mm512_set1_ps(a * 0.0625f);
      }
      const uint8_t* row = p.packed + k * half + c0;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * half), _MM_HINT_T0);
      for (int v = 0; v < V; ++v) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
        const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
        const __m512 qh = _mm512_cvtepi32_ps(_mm512_and_si512(q, high));
        for (int t = 0; t < R; ++t) {
          part_lo[t][v] = _mm512_fmadd_ps(ql, xl[t], part_lo[t][v]);
          part_hi[t][v] = _mm512_fmadd_ps(qh, xh[t], part_hi[t][v]);
        }
      }
    }
    const S* s = p.scale + g * p.out;
    const S* m = p.offset + g * p.out;
    for (int v = 0; v < V; ++v) {
      const __m512 sl = Load16(s + c0 + 16 * v), ml = Load16(m + c0 + 16 * v);
      const __m512 sh = Load16(s + half + c0 + 16 * v), mh = Load16(m + half + c0 + 16 * v);
      for (int t = 0; t < R; ++t) {
        const __m512 xs = _mm512_set1_ps(xsum[t]);
        acc_lo[t][v] = _mm512_fmadd_ps(ml, xs, _mm512_fmadd_ps(sl, part_lo[t][v], acc_lo[t][v]));
        acc_hi[t][v] = _mm512_fmadd_ps(mh, xs, _mm512_fmadd_ps(sh, part_hi[t][v], acc_hi[t][v]));
      }
    }
  }
  for (int t = 0; t < R; ++t) {
    for (int v = 0; v < V; ++v) {
      _mm512_storeu_ps(p.y + t * p.out + c0 + 16 * v, acc_lo[t][v]);
      _mm512_storeu_ps(p.y + t * p.out + half + c0 + 16 * v, acc_hi[t][v]);
    }
  }
}

// Columns [lo, hi) (a multiple of 16) for R rows: blocks of V vectors, then single vectors.
template <int R, int V, typename S>
void RunRowsAvx512(const Problem<S>& p, int64_t lo, int64_t hi) {
  int64_t c = lo;
  for (; c + 16 * V <= hi; c += 16 * V) p.along_out ? AlongOutAvx512<R, V>(p, c) : AlongInAvx512<R, V>(p, c);
  for (; c < hi; c += 16) p.along_out ? AlongOutAvx512<R, 1>(p, c) : AlongInAvx512<R, 1>(p, c);
}
#endif

template <typename S>
void Run(const Problem<S>& p, int64_t lo, int64_t hi) {
#if defined(__AVX512F__)
  switch (p.rows) {  // (blocks narrower as rows grow: every sum stays in a register)
    case 1: return RunRowsAvx512<1, 4>(p, lo, hi);
    case 2: return RunRowsAvx512<2, 2>(p, lo, hi);
    case 3: return RunRowsAvx512<3, 1>(p, lo, hi);
    case 4: return RunRowsAvx512<4, 1>(p, lo, hi);
    default: break;
  }
#endif
  switch (p.rows) {
    case 1: return RunRows<1>(p, lo, hi);
    case 2: return RunRows<2>(p, lo, hi);
    case 3: return RunRows<3>(p, lo, hi);
    default: return RunRows<4>(p, lo, hi);
  }
}

// Runs job(b) for b in [0, blocks): blocks are taken one at a time from a shared counter by this
// thread and by tasks on XLA's intra-op pool, and the call returns once every block is done. A task
// that starts after that finds no block left and touches nothing (its state is shared, not on this
// stack), so a busy pool only costs parallelism, never a deadlock.
template <typename Job>
void Parallel(ffi::ThreadPool& pool, int64_t blocks, Job job) {
  struct Shared {
    Job job;
    int64_t blocks;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Job j, int64_t n) : job(std::move(j)), blocks(n) {}
  };
  auto shared = std::make_shared<Shared>(std::move(job), blocks);
  auto work = [](Shared& sh) {
    for (int64_t b; (b = sh.next.fetch_add(1, std::memory_order_relaxed)) < sh.blocks;) {
      sh.job(b);
      sh.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < blocks) std::this_thread::yield();
}

// ---- more rows: a panel of the weight dequantized once, then a register-blocked multiply ------------
//
// From kMaxRows + 1 rows the levels' widening no longer hides behind the rows' multiplies, and XLA's
// path writes the whole float32 weight to memory for its matmul to read back. Here a thread
// dequantizes one panel of 32 output columns over every input row (at most 1536 x 32 floats: it stays
// in L2) and multiplies a chunk of rows by it, up to kRowTile rows at a time with their 32 sums each in
// registers, every sum in input order. The default model's projections run at 150-170 GFLOP/s from 32
// rows on two AVX-512 cores, 1.1-2x XLA's path, whose float32 matmuls peak near 195.

// This thread's scratch of at least n floats (a panel of dequantized weights), kept for its next calls.
inline float* ThreadBuffer(int64_t n) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < n) {
    buffer.reset(new float[n]);
    capacity = n;
  }
  return buffer.get();
}

constexpr int64_t kPanel = 32;      // output columns of a panel: two vectors of 16
constexpr int kRowTile = 12;        // rows a pass over the panel keeps in registers (24 sums)
constexpr int64_t kRowChunk = 192;  // rows a thread multiplies by a panel it dequantized (more: more threads)

// Panel c's columns: pairs along `in`, outputs 32c..32c+31; along `out`, packed columns 16c..16c+15, their
// low nibbles' outputs then their high nibbles'. w[k * 32 + j] = q * s + m for input row k.
template <typename S>
void DequantizePanel(const Problem<S>& p, int64_t c, float* w) {
  const int64_t per_group = p.in / p.groups;
  for (int64_t g = 0; g < p.groups; ++g) {
    const S* s = p.scale + g * p.out;
    const S* m = p.offset + g * p.out;
    if (p.along_out) {
      const int64_t half = p.out / 2, lo = 16 * c, hi = half + 16 * c;
#if defined(__AVX512F__)
      const __m512i low = _mm512_set1_epi32(15);
      const __m512 sl = Load16(s + lo), ml = Load16(m + lo), sh = Load16(s + hi), mh = Load16(m + hi);
      for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.packed + k * half + lo)));
        _mm512_storeu_ps(w + k * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), sl, ml));
        _mm512_storeu_ps(w + k * kPanel + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), sh, mh));
      }
#else
      for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
        const uint8_t* b = p.packed + k * half + lo;
        for (int j = 0; j < 16; ++j) {
          w[k * kPanel + j] = static_cast<float>(b[j] & 15) * static_cast<float>(s[lo + j]) + static_cast<float>(m[lo + j]);
          w[k * kPanel + 16 + j] = static_cast<float>(b[j] >> 4) * static_cast<float>(s[hi + j]) + static_cast<float>(m[hi + j]);
        }
      }
#endif
    } else {
      const int64_t o0 = kPanel * c;
#if defined(__AVX512F__)
      const __m512i low = _mm512_set1_epi32(15);
      const __m512 s0 = Load16(s + o0), m0 = Load16(m + o0), s1 = Load16(s + o0 + 16), m1 = Load16(m + o0 + 16);
      for (int64_t r = g * per_group / 2; r < (g + 1) * per_group / 2; ++r) {
        const uint8_t* b = p.packed + r * p.out + o0;
        const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
        const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
        float* even = w + 2 * r * kPanel;
        _mm512_storeu_ps(even, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q0, low)), s0, m0));
        _mm512_storeu_ps(even + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q1, low)), s1, m1));
        _mm512_storeu_ps(even + kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q0, 4)), s0, m0));
        _mm512_storeu_ps(even + kPanel + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q1, 4)), s1, m1));
      }
#else
      for (int64_t r = g * per_group / 2; r < (g + 1) * per_group / 2; ++r) {
        const uint8_t* b = p.packed + r * p.out + o0;
        for (int j = 0; j < kPanel; ++j) {
          const float sj = static_cast<float>(s[o0 + j]), mj = static_cast<float>(m[o0 + j]);
          w[2 * r * kPanel + j] = static_cast<float>(b[j] & 15) * sj + mj;
          w[(2 * r + 1) * kPanel + j] = static_cast<float>(b[j] >> 4) * sj + mj;
        }
      }
#endif
    }
  }
}

// y0[t * out + j] and y1[t * out + j] (j < 16) for R rows of x from x0: the panel's two halves.
template <int R>
void PanelRows(const float* x, int64_t in, const float* w, float* y0, float* y1, int64_t out) {
#if defined(__AVX512F__)
  __m512 a0[R], a1[R];
  for (int t = 0; t < R; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * kPanel), w1 = _mm512_loadu_ps(w + k * kPanel + 16);
    for (int t = 0; t < R; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * in + k]);
      a0[t] = _mm512_fmadd_ps(w0, xb, a0[t]);
      a1[t] = _mm512_fmadd_ps(w1, xb, a1[t]);
    }
  }
  for (int t = 0; t < R; ++t) {
    _mm512_storeu_ps(y0 + t * out, a0[t]);
    _mm512_storeu_ps(y1 + t * out, a1[t]);
  }
#else
  float a[R][kPanel] = {};
  for (int64_t k = 0; k < in; ++k)
    for (int t = 0; t < R; ++t)
      for (int j = 0; j < kPanel; ++j) a[t][j] += x[t * in + k] * w[k * kPanel + j];
  for (int t = 0; t < R; ++t) {
    std::memcpy(y0 + t * out, a[t], 16 * sizeof(float));
    std::memcpy(y1 + t * out, a[t] + 16, 16 * sizeof(float));
  }
#endif
}

template <int R = kRowTile>
void PanelTile(int rows, const float* x, int64_t in, const float* w, float* y0, float* y1, int64_t out) {
  if constexpr (R > 1) {
    if (rows < R) return PanelTile<R - 1>(rows, x, in, w, y0, y1, out);
  }
  PanelRows<R>(x, in, w, y0, y1, out);
}

template <typename S>
void RunPanel(const Problem<S>& p, int64_t c, int64_t r0, int64_t r1) {
  float* w = ThreadBuffer(p.in * kPanel);
  DequantizePanel(p, c, w);
  const int64_t first = p.along_out ? 16 * c : kPanel * c, second = p.along_out ? p.out / 2 + 16 * c : first + 16;
  const int64_t tiles = (r1 - r0 + kRowTile - 1) / kRowTile;
  for (int64_t i = 0, t0 = r0; i < tiles; ++i) {  // the chunk's rows split evenly over its tiles
    const int64_t t1 = r0 + (i + 1) * (r1 - r0) / tiles;
    PanelTile(static_cast<int>(t1 - t0), p.x + t0 * p.in, p.in, w, p.y + t0 * p.out + first, p.y + t0 * p.out + second,
              p.out);
    t0 = t1;
  }
}

template <typename S>
ffi::Error Multiply(ffi::ThreadPool& pool, const Problem<S>& p) {
  if (p.rows > kMaxRows) {
    const int64_t panels = p.out / kPanel, chunks = (p.rows + kRowChunk - 1) / kRowChunk;
    Parallel(pool, panels * chunks, [p, panels, chunks](int64_t b) {
      const int64_t chunk = b / panels;
      RunPanel(p, b % panels, chunk * p.rows / chunks, (chunk + 1) * p.rows / chunks);
    });
  } else {
    const int64_t columns = p.along_out ? p.out / 2 : p.out;  // blocks of output (or packed) columns
    Parallel(pool, (columns + kBlock - 1) / kBlock,
             [p, columns](int64_t b) { Run(p, b * kBlock, std::min(columns, (b + 1) * kBlock)); });
  }
  return ffi::Error::Success();
}

// ---- the LM head: x [T, cols] against every row of an int8 table (GGUF's Q8_0 rows) ------------------
//
// logits[t, v] = sum_g s[v, g] * sum_{k in g} x[t, k] q[v, k], float32 sums, one scale per group of
// G columns of a row. A row's levels are contiguous, so each row is a dot product: its group sums in
// one vector, scaled into the row's vector, summed across lanes at the end.

template <typename S>
struct TableProblem {
  const float* x;    // [T, cols]
  const int8_t* q;   // [rows, cols]
  const S* scale;    // [rows, groups]
  float* y;          // [T, rows]
  int64_t t_rows, rows, cols, groups;
};

constexpr int64_t kTableBlock = 256;  // table rows a thread takes at a time

template <typename S>
void TableRowsPortable(const TableProblem<S>& p, int64_t lo, int64_t hi) {
  const int64_t per_group = p.cols / p.groups;
  for (int64_t v = lo; v < hi; ++v) {
    const int8_t* q = p.q + v * p.cols;
    for (int64_t t = 0; t < p.t_rows; ++t) {
      const float* x = p.x + t * p.cols;
      float total = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float part = 0.0f;
        for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) part += x[k] * static_cast<float>(q[k]);
        total += static_cast<float>(p.scale[v * p.groups + g]) * part;
      }
      p.y[t * p.rows + v] = total;
    }
  }
}

#if defined(__AVX512F__)
// Groups of 32 columns (two vectors of 16 levels each), for R rows of x.
template <int R, typename S>
void TableRowsAvx512(const TableProblem<S>& p, int64_t lo, int64_t hi) {
  for (int64_t v = lo; v < hi; ++v) {
    const int8_t* q = p.q + v * p.cols;
    __m512 row[R];
    for (int t = 0; t < R; ++t) row[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t k = 32 * g;
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
      const __m512 q1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
      const __m512 s = _mm512_set1_ps(static_cast<float>(p.scale[v * p.groups + g]));
      for (int t = 0; t < R; ++t) {
        const float* x = p.x + t * p.cols + k;
        const __m512 part = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(x)));
        row[t] = _mm512_fmadd_ps(s, part, row[t]);
      }
    }
    for (int t = 0; t < R; ++t) p.y[t * p.rows + v] = _mm512_reduce_add_ps(row[t]);
  }
}
#endif

template <typename S>
void TableRows(const TableProblem<S>& p, int64_t lo, int64_t hi) {
#if defined(__AVX512F__)
  if (p.cols / p.groups == 32) {
    switch (p.t_rows) {
      case 1: return TableRowsAvx512<1>(p, lo, hi);
      case 2: return TableRowsAvx512<2>(p, lo, hi);
      case 3: return TableRowsAvx512<3>(p, lo, hi);
      case 4: return TableRowsAvx512<4>(p, lo, hi);
      default: break;
    }
  }
#endif
  TableRowsPortable(p, lo, hi);
}

#if defined(__AVX512F__)
// More rows of x: a thread dequantizes kTablePanel table rows into its own cache (at most 64 x 1536
// floats: L2), then takes R rows of x against J table rows at a time, R x J sums of 16 lanes in
// registers over every column, each summed across its lanes at the end.
constexpr int64_t kTablePanel = 64;
constexpr int kTableR = 6, kTableJ = 4;

template <int R, int J>
void TableTile(const float* x, int64_t cols, const float* w, float* y, int64_t y_stride) {
  __m512 acc[R][J];
  for (int t = 0; t < R; ++t)
    for (int j = 0; j < J; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < cols; k += 16) {
    __m512 wv[J];
    for (int j = 0; j < J; ++j) {
      wv[j] = _mm512_loadu_ps(w + j * cols + k);
      asm("" : "+v"(wv[j]));  // held in a register: folded into each multiply-add, it would be loaded R times
    }
    for (int t = 0; t < R; ++t) {
      __m512 xv = _mm512_loadu_ps(x + t * cols + k);
      asm("" : "+v"(xv));
      for (int j = 0; j < J; ++j) acc[t][j] = _mm512_fmadd_ps(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < R; ++t)
    for (int j = 0; j < J; ++j) y[t * y_stride + j] = _mm512_reduce_add_ps(acc[t][j]);
}

template <int R = kTableR>
void TableRowsTile(int rows, int table_rows, const float* x, int64_t cols, const float* w, float* y, int64_t y_stride) {
  if constexpr (R > 1) {
    if (rows < R) return TableRowsTile<R - 1>(rows, table_rows, x, cols, w, y, y_stride);
  }
  int j = 0;
  for (; j + kTableJ <= table_rows; j += kTableJ) TableTile<R, kTableJ>(x, cols, w + j * cols, y + j, y_stride);
  for (; j < table_rows; ++j) TableTile<R, 1>(x, cols, w + j * cols, y + j, y_stride);
}

template <typename S>
void TablePanel(const TableProblem<S>& p, int64_t v0) {
  float* w = ThreadBuffer(kTablePanel * p.cols);
  const int64_t n = std::min(kTablePanel, p.rows - v0);
  for (int64_t j = 0; j < n; ++j) {  // groups of 32 columns (two vectors of 16 levels each)
    const int8_t* q = p.q + (v0 + j) * p.cols;
    for (int64_t g = 0; g < p.groups; ++g) {
      const __m512 s = _mm512_set1_ps(static_cast<float>(p.scale[(v0 + j) * p.groups + g]));
      for (int h = 0; h < 2; ++h) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * g + 16 * h));
        _mm512_storeu_ps(w + j * p.cols + 32 * g + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
      }
    }
  }
  const int64_t tiles = (p.t_rows + kTableR - 1) / kTableR;
  for (int64_t i = 0, t0 = 0; i < tiles; ++i) {  // x's rows split evenly over the tiles
    const int64_t t1 = (i + 1) * p.t_rows / tiles;
    TableRowsTile(static_cast<int>(t1 - t0), static_cast<int>(n), p.x + t0 * p.cols, p.cols, w, p.y + t0 * p.rows + v0,
                  p.rows);
    t0 = t1;
  }
}
#endif

template <typename S>
ffi::Error TableLogits(ffi::ThreadPool& pool, const TableProblem<S>& p) {
#if defined(__AVX512F__)
  if (p.t_rows > kMaxRows && p.cols / p.groups == 32) {
    Parallel(pool, (p.rows + kTablePanel - 1) / kTablePanel, [p](int64_t b) { TablePanel(p, b * kTablePanel); });
    return ffi::Error::Success();
  }
#endif
  Parallel(pool, (p.rows + kTableBlock - 1) / kTableBlock,
           [p](int64_t b) { TableRows(p, b * kTableBlock, std::min(p.rows, (b + 1) * kTableBlock)); });
  return ffi::Error::Success();
}

// Calls f with a null pointer of the scales' element type, float16 (GGUF's own) or float32, so that
// f builds its problem for that type; any other type is an error naming the kernel.
template <typename F>
ffi::Error ByScaleType(ffi::DataType type, const char* kernel, F&& f) {
  switch (type) {
    case ffi::DataType::F16: return f(static_cast<const _Float16*>(nullptr));
    case ffi::DataType::F32: return f(static_cast<const float*>(nullptr));
    default: return ffi::Error::InvalidArgument(std::string(kernel) + ": scales must be float16 or float32");
  }
}

ffi::Error Int8TableLogits(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || xd[1] != qd[1] || sd[0] != qd[0]) {
    return ffi::Error::InvalidArgument("int8 table logits: x [T, cols], q [rows, cols], scale [rows, groups]");
  }
  const int64_t t_rows = xd[0], rows = qd[0], cols = qd[1], groups = sd[1];
  if (t_rows < 1 || groups < 1 || cols % groups) {
    return ffi::Error::InvalidArgument("int8 table logits: unsupported shape");
  }
  return ByScaleType(scale.element_type(), "int8 table logits", [&](auto type) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    return TableLogits(pool, TableProblem<S>{x.typed_data(), q.typed_data(), static_cast<const S*>(scale.untyped_data()),
                                             y->typed_data(), t_rows, rows, cols, groups});
  });
}

ffi::Error Int4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                      ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  // the weight stacked on a layer axis ([L, ...]; one layer: L = 1), multiplied at `layer` in place
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || sd.size() != 3 || pd[0] != sd[0] || layer.element_count() != 1 ||
      scale.element_type() != offset.element_type()) {
    return ffi::Error::InvalidArgument("int4 matmul: x [T, in], packed and scale [L, ...] alike, scale and offset "
                                       "alike, one layer index");
  }
  const int64_t rows = xd[0], in = xd[1], out = sd[2], groups = sd[1], index = layer.typed_data()[0];
  const bool along_out = pd[2] != sd[2];
  const int64_t columns = along_out ? out / 2 : out;
  if (rows < 1 || in % groups || (in / groups) % 2 || (along_out && out % 2) ||
      columns % kTail || (rows > kMaxRows && out % kPanel) ||
      index < 0 || index >= pd[0]) {
    return ffi::Error::InvalidArgument("int4 matmul: unsupported shape");
  }
  return ByScaleType(scale.element_type(), "int4 matmul", [&](auto type) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    const int64_t scales = groups * out;  // a layer's scales (and offsets)
    return Multiply(pool, Problem<S>{x.typed_data(), packed.typed_data() + index * pd[1] * pd[2],
                                     static_cast<const S*>(scale.untyped_data()) + index * scales,
                                     static_cast<const S*>(offset.untyped_data()) + index * scales, y->typed_data(),
                                     rows, in, out, groups, along_out});
  });
}

// ---- paged attention for tiles of a few queries (a decode step's) ----------------------------------
//
// The online softmax of kiln.models.decoder's XLA path, one (KV head, tile) at a time: a tile's R query
// rows (its G heads times its queries, scaled) against its own row's blocks, read through the block
// table from the pool [L, KH, N, B, D] (float32, bfloat16 or float16) only as far as the tile's last
// query position reaches, and from the first key its window lets its first query see. XLA's path
// reads every tile up to the step's longest context, through gathers of whole chunks of blocks.
// Returns the softmax's state, as that path keeps it: the running max m and normalizer [KH, NT, R] and
// the unnormalized output [KH, NT, R, D]; a row that sees no key keeps m = -1e30, zeros elsewhere.

constexpr int64_t kMaxQueryRows = 16;
constexpr int64_t kMaxBlockKeys = 256;

struct AttentionProblem {
  const float* q;          // [KH, NT, R, D]
  const int32_t* pos;      // [NT, R] query positions (-1: padding)
  const int32_t* tables;   // [NT, W]
  const void* k;           // [L, KH, N, B, D]
  const void* v;
  float* m;                // [KH, NT, R]
  float* norm;             // [KH, NT, R]
  float* acc;              // [KH, NT, R, D]
  int64_t heads, tiles, rows, dim, width, blocks, block, layer, window;
  float softcap;           // 0: none
};

inline float Widen(float x) { return x; }
inline float Widen(_Float16 x) { return static_cast<float>(x); }
struct BF16 { uint16_t bits; };
inline float Widen(BF16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
inline __m512 Load16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for 16 lanes (Cephes' expf: 2^n times a degree-6 polynomial on the remainder, within a few ulps).
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// q . key over D (a multiple of 16 with AVX-512).
template <typename KV>
inline float Dot(const float* q, const KV* key, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), Load16(key + d), sum);
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += q[d] * Widen(key[d]);
  return sum;
}

// acc = acc * correction + sum_i p[i] value_i, over D.
template <typename KV>
inline void Accumulate(float* acc, float correction, const float* p, const KV* values, int64_t keys, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(correction));
      for (int64_t i = 0; i < keys; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), Load16(values + i * dim + d), a);
      _mm512_storeu_ps(acc + d, a);
    }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
  for (int64_t i = 0; i < keys; ++i)
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[i] * Widen(values[i * dim + d]);
}

// p[i] = visible ? e^(s[i] - max) : 0, returning their sum.
inline float Exponentials(float* p, const float* s, const bool* visible, float max, int64_t keys) {
  float total = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= keys; i += 16) {
    __mmask16 mask = 0;
    for (int j = 0; j < 16; ++j) mask |= static_cast<__mmask16>(visible[i + j]) << j;
    const __m512 e = _mm512_maskz_mov_ps(mask, Exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift)));
    _mm512_storeu_ps(p + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < keys; ++i) {
    p[i] = visible[i] ? std::exp(s[i] - max) : 0.0f;
    total += p[i];
  }
  return total;
}

template <typename KV>
void AttendTile(const AttentionProblem& a, int64_t job) {
  const int64_t h = job / a.tiles, t = job % a.tiles, R = a.rows, D = a.dim, B = a.block;
  const int32_t* pos = a.pos + t * R;
  int32_t last = -1, first_pos = INT32_MAX;
  for (int64_t r = 0; r < R; ++r) {
    last = std::max(last, pos[r]);
    if (pos[r] >= 0) first_pos = std::min(first_pos, pos[r]);
  }
  float m[kMaxQueryRows], norm[kMaxQueryRows] = {};
  float* acc = a.acc + job * R * D;
  std::fill(m, m + R, -1e30f);
  std::fill(acc, acc + R * D, 0.0f);
  const int64_t n_blocks = std::min<int64_t>(last < 0 ? 0 : (last + B) / B, a.width);
  const int64_t first = a.window > 0 && last >= 0 ? std::max<int64_t>(first_pos - a.window + 1, 0) / B : 0;
  const KV* k_head = static_cast<const KV*>(a.k) + (a.layer * a.heads + h) * a.blocks * B * D;
  const KV* v_head = static_cast<const KV*>(a.v) + (a.layer * a.heads + h) * a.blocks * B * D;
  float s[kMaxBlockKeys], p[kMaxBlockKeys];
  bool visible[kMaxBlockKeys];
  for (int64_t j = first; j < n_blocks; ++j) {
    const int64_t b = std::min<int64_t>(std::max(a.tables[t * a.width + j], 0), a.blocks - 1);
    const KV* keys = k_head + b * B * D;
    const KV* values = v_head + b * B * D;
    for (int64_t r = 0; r < R; ++r) {
      if (pos[r] < j * B || (a.window > 0 && j * B + B - 1 <= pos[r] - a.window)) continue;  // sees none
      const float* q = a.q + (job * R + r) * D;
      float block_max = -INFINITY;
      for (int64_t i = 0; i < B; ++i) {
        const int64_t key_pos = j * B + i;
        visible[i] = key_pos <= pos[r] && (a.window == 0 || key_pos > pos[r] - a.window);
        float score = visible[i] ? Dot(q, keys + i * D, D) : -INFINITY;
        if (a.softcap > 0.0f && visible[i]) score = a.softcap * std::tanh(score / a.softcap);
        s[i] = score;
        block_max = std::max(block_max, score);
      }
      const float m_new = std::max(m[r], block_max);
      const float correction = std::exp(m[r] - m_new);
      norm[r] = norm[r] * correction + Exponentials(p, s, visible, m_new, B);
      Accumulate(acc + r * D, correction, p, values, B, D);
      m[r] = m_new;
    }
  }
  std::memcpy(a.m + job * R, m, R * sizeof(float));
  std::memcpy(a.norm + job * R, norm, R * sizeof(float));
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos,
                          ffi::Buffer<ffi::S32> tables, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> layer_window, float softcap, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> norm, ffi::ResultBuffer<ffi::F32> acc) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || k.element_type() != v.element_type() ||
      qd[0] != kd[1] || qd[3] != kd[4] || td[0] != qd[1] || pos.element_count() != qd[1] * qd[2] ||
      layer_window.element_count() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q [KH, NT, R, D], pos [NT, R], tables [NT, W], "
                                       "pools [L, KH, N, B, D], layer and window [2]");
  }
  const int32_t* lw = layer_window.typed_data();
  AttentionProblem a{q.typed_data(), pos.typed_data(), tables.typed_data(), k.untyped_data(), v.untyped_data(),
                     m->typed_data(), norm->typed_data(), acc->typed_data(), qd[0], qd[1], qd[2], qd[3], td[1],
                     kd[2], kd[3], lw[0], lw[1], softcap};
  if (a.rows > kMaxQueryRows || a.block > kMaxBlockKeys || a.layer < 0 || a.layer >= kd[0]) {
    return ffi::Error::InvalidArgument("paged attention: unsupported shape");
  }
  auto run = [&](auto type) {
    using KV = decltype(type);
    Parallel(pool, a.heads * a.tiles, [a](int64_t job) { AttendTile<KV>(a, job); });
    return ffi::Error::Success();
  };
  switch (k.element_type()) {
    case ffi::DataType::F32: return run(float{});
    case ffi::DataType::BF16: return run(BF16{});
    case ffi::DataType::F16: return run(_Float16{});
    default: return ffi::Error::InvalidArgument("paged attention: the pool must be float32, bfloat16 or float16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KilnInt4Matmul, Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KilnInt8TableLogits, Int8TableLogits,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KilnPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
