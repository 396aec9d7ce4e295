// GGUF block matmul and dequantization for the CPU, on the file's own bytes (no transcoding).
//
// Built at first use by fw_gguf/cpu_build.py (g++ -O3 -march=native -fopenmp -ffp-contract=off)
// and called through ctypes. Every decode_* writes one block's fp32 values exactly as gguf-py's
// numpy reference (and fw_gguf/dequant.py) computes them: fp16 scales widened to fp32, one
// rounding per numpy operation (-ffp-contract=off keeps the compiler from fusing them). The dot
// products accumulate in fp32 with explicit fma, in a different order than a BLAS call would.
//
//   fw_gguf_matmul(type, x [M, K] fp32, w [N rows of K/block blocks], N, K, M, y, ldy, threads):
//       y[m, n] = sum_k x[m, k] * W[n, k]      (y rows ldy apart: a column slice of a wider output)
//   fw_gguf_dequantize(type, w, N, K, out [N, K] fp32, threads)
//
// Returns 0, or -1 for a type this file does not decode.
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_at(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }

#if defined(__AVX512F__)
// 16 lanes: bytes widened to int32, int32 to fp32 times a scale (and plus an offset), stored
inline __m512i u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i i8x16(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i nib_lo(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0F)); }
inline __m512i nib_hi(__m512i v) { return _mm512_srli_epi32(v, 4); }
inline void scaled(float* out, __m512i q, float d) { _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(q))); }
inline void affine(float* out, __m512i q, float d, float m) {
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(q)), _mm512_set1_ps(m)));
}
inline void affine_sub(float* out, __m512i q, float d, float m) {
  _mm512_storeu_ps(out, _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(q)), _mm512_set1_ps(m)));
}
inline __m512i add16_where(__m512i v, uint32_t bits) { return _mm512_mask_add_epi32(v, __mmask16(bits & 0xFFFF), v, _mm512_set1_epi32(16)); }
#define FW_AVX512 1
#else
#define FW_AVX512 0
#endif

struct Q4_0 { static constexpr int BLOCK = 32, BYTES = 18;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b); const __m512i q = u8x16(b + 2), eight = _mm512_set1_epi32(8);
    scaled(out, _mm512_sub_epi32(nib_lo(q), eight), d); scaled(out + 16, _mm512_sub_epi32(nib_hi(q), eight), d);
    return;
    }
#endif
    const float d = f16_at(b);
    for (int j = 0; j < 16; ++j) out[j] = d * float(int(b[2 + j] & 0x0F) - 8);
    for (int j = 0; j < 16; ++j) out[j + 16] = d * float(int(b[2 + j] >> 4) - 8);
  } };

struct Q4_1 { static constexpr int BLOCK = 32, BYTES = 20;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b), m = f16_at(b + 2); const __m512i q = u8x16(b + 4);
    affine(out, nib_lo(q), d, m); affine(out + 16, nib_hi(q), d, m);
    return;
    }
#endif
    const float d = f16_at(b), m = f16_at(b + 2);
    for (int j = 0; j < 16; ++j) out[j] = d * float(b[4 + j] & 0x0F) + m;
    for (int j = 0; j < 16; ++j) out[j + 16] = d * float(b[4 + j] >> 4) + m;
  } };

struct Q5_0 { static constexpr int BLOCK = 32, BYTES = 22;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b); uint32_t qh; std::memcpy(&qh, b + 2, 4);
    const __m512i q = u8x16(b + 6), sixteen = _mm512_set1_epi32(16);
    scaled(out, _mm512_sub_epi32(add16_where(nib_lo(q), qh), sixteen), d);
    scaled(out + 16, _mm512_sub_epi32(add16_where(nib_hi(q), qh >> 16), sixteen), d);
    return;
    }
#endif
    const float d = f16_at(b);
    const uint32_t qh = uint32_t(b[2]) | (uint32_t(b[3]) << 8) | (uint32_t(b[4]) << 16) | (uint32_t(b[5]) << 24);
    for (int j = 0; j < 16; ++j) out[j] = d * float(int((b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
    for (int j = 0; j < 16; ++j) out[j + 16] = d * float(int((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  } };

struct Q5_1 { static constexpr int BLOCK = 32, BYTES = 24;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b), m = f16_at(b + 2); uint32_t qh; std::memcpy(&qh, b + 4, 4);
    const __m512i q = u8x16(b + 8);
    affine(out, add16_where(nib_lo(q), qh), d, m); affine(out + 16, add16_where(nib_hi(q), qh >> 16), d, m);
    return;
    }
#endif
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = uint32_t(b[4]) | (uint32_t(b[5]) << 8) | (uint32_t(b[6]) << 16) | (uint32_t(b[7]) << 24);
    for (int j = 0; j < 16; ++j) out[j] = d * float((b[8 + j] & 0x0F) | (((qh >> j) & 1) << 4)) + m;
    for (int j = 0; j < 16; ++j) out[j + 16] = d * float((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
  } };

struct Q8_0 { static constexpr int BLOCK = 32, BYTES = 34;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b);  // float(q) * d, the reference's operand order
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(i8x16(b + 2)), _mm512_set1_ps(d)));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(i8x16(b + 18)), _mm512_set1_ps(d)));
    return;
    }
#endif
    const float d = f16_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = float(q[j]) * d;
  } };

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes
void k_scale_min(const uint8_t* s, float* sc, float* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = float(s[j] & 0x3F);
    mn[j] = float(s[4 + j] & 0x3F);
    sc[4 + j] = float((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
    mn[4 + j] = float((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
  }
}

struct Q4_K { static constexpr int BLOCK = 256, BYTES = 144;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    float sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int c = 0; c < 4; ++c) {
      const __m512i q0 = u8x16(b + 16 + c * 32), q1 = u8x16(b + 32 + c * 32);
      const int g = 2 * c;
      affine_sub(out + g * 32, nib_lo(q0), d * sc[g], dmin * mn[g]);
      affine_sub(out + g * 32 + 16, nib_lo(q1), d * sc[g], dmin * mn[g]);
      affine_sub(out + g * 32 + 32, nib_hi(q0), d * sc[g + 1], dmin * mn[g + 1]);
      affine_sub(out + g * 32 + 48, nib_hi(q1), d * sc[g + 1], dmin * mn[g + 1]);
    }
    return;
    }
#endif
    const float d = f16_at(b), dmin = f16_at(b + 2);
    float sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t* qs = b + 16;
    for (int g = 0; g < 8; ++g) {
      const float dl = d * sc[g], ml = dmin * mn[g];
      const uint8_t* chunk = qs + (g / 2) * 32;
      const int shift = (g & 1) * 4;
      for (int j = 0; j < 32; ++j) out[g * 32 + j] = dl * float((chunk[j] >> shift) & 0x0F) - ml;
    }
  } };

struct Q5_K { static constexpr int BLOCK = 256, BYTES = 176;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    float sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const __m512i h0 = u8x16(b + 16), h1 = u8x16(b + 32), one = _mm512_set1_epi32(1);
    for (int g = 0; g < 8; ++g) {
      const uint8_t* chunk = b + 48 + (g / 2) * 32;
      __m512i q0 = u8x16(chunk), q1 = u8x16(chunk + 16);
      q0 = (g & 1) ? nib_hi(q0) : nib_lo(q0);
      q1 = (g & 1) ? nib_hi(q1) : nib_lo(q1);
      const __m128i shift = _mm_cvtsi32_si128(g);
      q0 = _mm512_or_si512(q0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h0, shift), one), 4));
      q1 = _mm512_or_si512(q1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h1, shift), one), 4));
      affine_sub(out + g * 32, q0, d * sc[g], dmin * mn[g]);
      affine_sub(out + g * 32 + 16, q1, d * sc[g], dmin * mn[g]);
    }
    return;
    }
#endif
    const float d = f16_at(b), dmin = f16_at(b + 2);
    float sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; ++g) {
      const float dl = d * sc[g], ml = dmin * mn[g];
      const uint8_t* chunk = qs + (g / 2) * 32;
      const int shift = (g & 1) * 4;
      for (int j = 0; j < 32; ++j)
        out[g * 32 + j] = dl * float(((chunk[j] >> shift) & 0x0F) | (((qh[j] >> g) & 1) << 4)) - ml;
    }
  } };

struct Q6_K { static constexpr int BLOCK = 256, BYTES = 210;
  static void decode(const uint8_t* __restrict b, float* __restrict out) {
#if FW_AVX512
    {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    const __m512i three = _mm512_set1_epi32(3), thirty_two = _mm512_set1_epi32(32);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int half = 0; half < 2; ++half) {
          const int v = h * 128 + s * 32 + half * 16;
          __m512i low = u8x16(b + h * 64 + (s & 1) * 32 + half * 16);
          low = (s >> 1) ? nib_hi(low) : nib_lo(low);
          const __m512i high = _mm512_and_si512(_mm512_srl_epi32(u8x16(b + 128 + h * 32 + half * 16), _mm_cvtsi32_si128(2 * s)), three);
          scaled(out + v, _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), thirty_two), d * float(sc[v / 16]));
        }
    return;
    }
#endif
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s) {
        const uint8_t* low = ql + h * 64 + (s & 1) * 32;
        const uint8_t* high = qh + h * 32;
        const int low_shift = (s >> 1) * 4, high_shift = 2 * s;
        for (int half = 0; half < 2; ++half) {  // 16 values sharing one scale
          const int first = h * 128 + s * 32 + half * 16;
          const float dl = d * float(scales[first / 16]);
          for (int j = half * 16; j < half * 16 + 16; ++j)
            out[h * 128 + s * 32 + j] =
                dl * float(int(((low[j] >> low_shift) & 0x0F) | (((high[j] >> high_shift) & 3) << 4)) - 32);
        }
      }
  } };

constexpr int MAX_ROWS = 8;  // rows of x per pass over the weights

// sums[r] = x[r, :] . W[row, :] for R rows of x (k apart) and one weight row of `blocks` blocks.
// Each block is decoded once into `values` (L1) and multiplied into per-lane fp32 accumulators
// (lane j of every 32 values), which are added up at the end.
#if FW_AVX512
template <class F, int R>
void dot_rows(const float* __restrict x, int64_t k, const uint8_t* __restrict row, int64_t blocks, float* sums) {
  alignas(64) float values[F::BLOCK];
  __m512 lo[R], hi[R];  // R is a constant: the accumulators stay in registers
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    F::decode(row + blk * F::BYTES, values);
    const float* xs = x + blk * F::BLOCK;
    for (int c = 0; c < F::BLOCK; c += 32) {
      const __m512 v0 = _mm512_load_ps(values + c), v1 = _mm512_load_ps(values + c + 16);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + r * k + c), v0, lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + r * k + c + 16), v1, hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
}
#else
template <class F, int R>
void dot_rows(const float* __restrict x, int64_t k, const uint8_t* __restrict row, int64_t blocks, float* sums) {
  alignas(64) float values[F::BLOCK];
  float acc[R][32] = {};
  for (int64_t blk = 0; blk < blocks; ++blk) {
    F::decode(row + blk * F::BYTES, values);
    for (int r = 0; r < R; ++r) {
      const float* xs = x + r * k + blk * F::BLOCK;
      for (int c = 0; c < F::BLOCK; c += 32)
        for (int j = 0; j < 32; ++j) acc[r][j] = std::fma(xs[c + j], values[c + j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int j = 0; j < 32; ++j) sum += acc[r][j];
    sums[r] = sum;
  }
}
#endif

template <class F>
void dot_any_rows(int rows, const float* x, int64_t k, const uint8_t* row, int64_t blocks, float* sums) {
  switch (rows) {
    case 1: dot_rows<F, 1>(x, k, row, blocks, sums); break;
    case 2: dot_rows<F, 2>(x, k, row, blocks, sums); break;
    case 3: dot_rows<F, 3>(x, k, row, blocks, sums); break;
    case 4: dot_rows<F, 4>(x, k, row, blocks, sums); break;
    case 5: dot_rows<F, 5>(x, k, row, blocks, sums); break;
    case 6: dot_rows<F, 6>(x, k, row, blocks, sums); break;
    case 7: dot_rows<F, 7>(x, k, row, blocks, sums); break;
    default: dot_rows<F, 8>(x, k, row, blocks, sums); break;
  }
}

template <class F>
void matmul(const float* __restrict x, const uint8_t* __restrict w, int64_t n_out, int64_t k, int64_t m, float* __restrict y, int64_t ldy, int threads) {
  const int64_t blocks = k / F::BLOCK, row_bytes = blocks * F::BYTES;
  // dynamic chunks of rows: on a shared machine a thread that is descheduled holds up less work
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16) if (threads > 1 && n_out * k >= (1 << 16))
  for (int64_t n = 0; n < n_out; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < m; m0 += MAX_ROWS) {
      const int rows = int(m - m0 < MAX_ROWS ? m - m0 : MAX_ROWS);
      float sums[MAX_ROWS];
      dot_any_rows<F>(rows, x + m0 * k, k, row, blocks, sums);
      for (int r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = sums[r];
    }
  }
}

template <class F>
void dequantize(const uint8_t* w, int64_t n_out, int64_t k, float* out, int threads) {
  const int64_t blocks = k / F::BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < n_out; ++n)
    for (int64_t blk = 0; blk < blocks; ++blk)
      F::decode(w + (n * blocks + blk) * F::BYTES, out + n * k + blk * F::BLOCK);
}

// ggml type ids (gguf.GGMLQuantizationType)
template <template <class> class Op, class... Args>
int dispatch(int type, Args... args) {
  switch (type) {
    case 2: Op<Q4_0>::run(args...); return 0;
    case 3: Op<Q4_1>::run(args...); return 0;
    case 6: Op<Q5_0>::run(args...); return 0;
    case 7: Op<Q5_1>::run(args...); return 0;
    case 8: Op<Q8_0>::run(args...); return 0;
    case 12: Op<Q4_K>::run(args...); return 0;
    case 13: Op<Q5_K>::run(args...); return 0;
    case 14: Op<Q6_K>::run(args...); return 0;
    default: return -1;
  }
}

template <class F> struct MatmulOp { template <class... A> static void run(A... a) { matmul<F>(a...); } };
template <class F> struct DequantOp { template <class... A> static void run(A... a) { dequantize<F>(a...); } };

}  // namespace

extern "C" {

int fw_gguf_matmul(int type, const float* x, const uint8_t* w, int64_t n_out, int64_t k, int64_t m, float* y,
                   int64_t ldy, int threads) {
  return dispatch<MatmulOp>(type, x, w, n_out, k, m, y, ldy, threads);
}

int fw_gguf_dequantize(int type, const uint8_t* w, int64_t n_out, int64_t k, float* out, int threads) {
  return dispatch<DequantOp>(type, w, n_out, k, out, threads);
}

}  // extern "C"
