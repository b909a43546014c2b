// Paged attention of single-query rows (decode steps) on the CPU, reading K and V in place.
//
// Two paths, chosen at compile time by the build's -march=native: with AVX-512 (F, BW, VL) the
// tile's K rows are widened in registers and each query head's 16 dot products are summed into
// one vector by a transpose-and-add tree (no horizontal reduction per key), and V is streamed
// once per tile for up to four query heads at a time, their accumulators held in registers.
// Without AVX-512 a portable loop does the same arithmetic, widening each row into a buffer.
//
// Built with -ffast-math (compile step only, so the library never sets the process's flush-to-
// zero mode): the reductions and expf vectorize. Nothing here relies on infinities or NaN.
//
// One work item is one (sequence, KV head): its query heads (GQA) share every K and V row it
// loads. Each block of context is one tile: the tile's scores for every head, then an online
// softmax update (running max, sum and weighted V in float32), as flash attention does. K/V
// rows are widened to float32 as they are read (bfloat16, float16 or float8 e4m3 caches).
//
// The library carries no torch headers: it is built at first use by
// worker/attention_backends/native_build.py and loaded with ctypes after torch, so its OpenMP
// runtime is torch's own libgomp (same soname) and its threads are torch's.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxBlockSize = 64;

enum Dtype { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3 };

float g_fp8_table[256];

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  memcpy(&value, &word, sizeof(value));
  return value;
}

inline float fp16_to_float(uint16_t bits) {
  uint32_t sign = (bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  float value;
  if (exponent == 0) {
    value = ldexpf(static_cast<float>(mantissa), -24);  // zero or subnormal
    uint32_t word;
    memcpy(&word, &value, sizeof(word));
    word |= sign;
    memcpy(&value, &word, sizeof(value));
    return value;
  }
  uint32_t word = exponent == 0x1f ? (sign | 0x7f800000u | (mantissa << 13))
                                   : (sign | ((exponent + 112) << 23) | (mantissa << 13));
  memcpy(&value, &word, sizeof(value));
  return value;
}

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN
float fp8_e4m3_to_float(uint8_t bits) {
  int sign = bits >> 7;
  int exponent = (bits >> 3) & 0xf;
  int mantissa = bits & 0x7;
  float value;
  if (exponent == 0xf && mantissa == 0x7) {
    value = 0.0f;  // NaN in e4m3fn; the KV writer saturates, so a cache never holds it
  } else if (exponent == 0) {
    value = ldexpf(static_cast<float>(mantissa), -9);
  } else {
    value = ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return sign ? -value : value;
}

struct TableInit {
  TableInit() {
    for (int i = 0; i < 256; ++i) g_fp8_table[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  }
} g_table_init;

inline void widen_row(const void* base, int64_t offset, int dtype, int head_dim, float* out) {
  switch (dtype) {
    case kFloat32: {
      const float* row = static_cast<const float*>(base) + offset;
      memcpy(out, row, sizeof(float) * head_dim);
      break;
    }
    case kBFloat16: {
      const uint16_t* row = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) out[d] = bf16_to_float(row[d]);
      break;
    }
    case kFloat16: {
      const uint16_t* row = static_cast<const uint16_t*>(base) + offset;
      for (int d = 0; d < head_dim; ++d) out[d] = fp16_to_float(row[d]);
      break;
    }
    default: {
      const uint8_t* row = static_cast<const uint8_t*>(base) + offset;
      for (int d = 0; d < head_dim; ++d) out[d] = g_fp8_table[row[d]];
      break;
    }
  }
}

// float32 to float16, rounded to nearest even (the bit recipe of numpy and FP16): subnormal
// results through an add that lets the FPU round, normal ones by adding half an ulp.
inline uint16_t float_to_fp16(float value) {
  uint32_t word;
  memcpy(&word, &value, sizeof(word));
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  word &= 0x7fffffffu;
  if (word >= 0x47800000u) return sign | 0x7c00u;  // past float16's range: infinity
  if (word < 0x38800000u) {                         // below its smallest normal
    float magnitude;
    memcpy(&magnitude, &word, sizeof(magnitude));
    const float shifted = magnitude + 0.5f;  // 0.5's ulp is float16's smallest subnormal
    uint32_t bits;
    memcpy(&bits, &shifted, sizeof(bits));
    return sign | static_cast<uint16_t>(bits - 0x3f000000u);
  }
  const uint32_t odd = (word >> 13) & 1u;
  return sign | static_cast<uint16_t>((word + 0xc8000fffu + odd) >> 13);
}

// Writes `row` (float32) as `dtype`, rounded to nearest even as torch does.
inline void narrow_row(const float* row, int dtype, int count, void* base, int64_t offset) {
  if (dtype == kFloat32) {
    memcpy(static_cast<float*>(base) + offset, row, sizeof(float) * count);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + offset;
  if (dtype == kFloat16) {
    for (int d = 0; d < count; ++d) out[d] = float_to_fp16(row[d]);
    return;
  }
#pragma omp simd
  for (int d = 0; d < count; ++d) {
    uint32_t word;
    memcpy(&word, &row[d], sizeof(word));
    out[d] = static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
  }
}

// One work item's context: (sequence, KV head), its `group` query heads and what it reads.
struct Item {
  const float* queries;  // [group, head_dim], widened
  void* out;             // the output, of `out_dtype`: the group's rows start at `out_offset`
  int64_t out_offset;
  int out_dtype;
  const void* cache;
  const int64_t* block_ids;  // the sequence's blocks
  int64_t kv_stride;
  int64_t block_stride;
  int64_t row_stride;  // one token's row: num_kv_heads * head_dim
  int64_t head_offset;  // kv_head * head_dim
  int start, end;
  int group, head_dim, block_size;
  float scale, softcap;
};

inline float capped(float score, float softcap) {
  return softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
}

// Each head's accumulated V over its softmax sum, written to the output in its dtype.
void store_result(const Item& item, const float (*acc)[kMaxHeadDim], const float* running_sum) {
  float row[kMaxHeadDim];
  for (int h = 0; h < item.group; ++h) {
    const float inverse = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
#pragma omp simd
    for (int d = 0; d < item.head_dim; ++d) row[d] = acc[h][d] * inverse;
    narrow_row(row, item.out_dtype, item.head_dim, item.out, item.out_offset + h * item.head_dim);
  }
}

// The portable path: each K and V row is widened into a buffer, dot products reduced per key.
[[maybe_unused]] void attend_item_generic(const Item& item, int dtype) {
  const int group = item.group, head_dim = item.head_dim, block_size = item.block_size;
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
  float acc[kMaxGroup][kMaxHeadDim];
  float keys[kMaxBlockSize][kMaxHeadDim];
  float scores[kMaxGroup][kMaxBlockSize];
  float values[kMaxHeadDim];
  for (int h = 0; h < group; ++h) {
    running_max[h] = -FLT_MAX;  // finite: the library is built with -ffast-math
    running_sum[h] = 0.0f;
    for (int d = 0; d < head_dim; ++d) acc[h][d] = 0.0f;
  }
  for (int tile_start = item.start - item.start % block_size; tile_start < item.end;
       tile_start += block_size) {
    const int lo = tile_start > item.start ? tile_start : item.start;
    const int hi = tile_start + block_size < item.end ? tile_start + block_size : item.end;
    const int64_t block_base =
        item.block_ids[tile_start / block_size] * item.block_stride + item.head_offset;
    const int count = hi - lo;
    for (int t = 0; t < count; ++t) {
      const int64_t offset = block_base + static_cast<int64_t>(lo + t - tile_start) * item.row_stride;
      widen_row(item.cache, offset, dtype, head_dim, keys[t]);
    }
    for (int h = 0; h < group; ++h) {
      const float* query = item.queries + h * head_dim;
      float tile_max = -FLT_MAX;
      for (int t = 0; t < count; ++t) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; ++d) dot += query[d] * keys[t][d];
        const float score = capped(dot * item.scale, item.softcap);
        scores[h][t] = score;
        tile_max = score > tile_max ? score : tile_max;
      }
      const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
      const float correction = expf(running_max[h] - new_max);  // ~0 on the first tile
      running_sum[h] *= correction;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) acc[h][d] *= correction;
      running_max[h] = new_max;
      float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
      for (int t = 0; t < count; ++t) {
        const float weight = expf(scores[h][t] - new_max);  // glibc's vector expf
        scores[h][t] = weight;
        tile_sum += weight;
      }
      running_sum[h] += tile_sum;
    }
    for (int t = 0; t < count; ++t) {
      const int64_t offset =
          block_base + item.kv_stride + static_cast<int64_t>(lo + t - tile_start) * item.row_stride;
      widen_row(item.cache, offset, dtype, head_dim, values);
      for (int h = 0; h < group; ++h) {
        const float weight = scores[h][t];
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) acc[h][d] += weight * values[d];
      }
    }
  }
  store_result(item, acc, running_sum);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_AVX512 1

constexpr int kTile = 16;      // keys per tile: one score per lane
constexpr int kHeadTile = 4;   // query heads whose accumulators share one pass over V
constexpr int kMaxChunks = kMaxHeadDim / 16;

// A row's 16-lane chunks: kChunks where the head size is compiled in (64, 128: the loops unroll
// and the queries stay in registers), else counted at run time, the last one masked.
template <int kChunks>
inline int chunks_of(int head_dim) {
  return kChunks > 0 ? kChunks : (head_dim + 15) / 16;
}

template <int kChunks>
inline __mmask16 chunk_mask(int chunk, int num_chunks, int head_dim) {
  if (kChunks > 0 || chunk + 1 < num_chunks) return static_cast<__mmask16>(0xffff);
  return static_cast<__mmask16>((1u << (head_dim - 16 * (num_chunks - 1))) - 1);
}

// 16 elements of a row (lanes past `mask` zero), widened to float32 in registers.
template <int kDtype>
inline __m512 load_chunk(const void* base, int64_t offset, __mmask16 mask) {
  if constexpr (kDtype == kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + offset);
  } else if constexpr (kDtype == kBFloat16) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + offset);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else if constexpr (kDtype == kFloat16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + offset));
  } else {  // e4m3 through the table; a masked lane reads entry 0, which is +0
    const __m128i bytes = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(base) + offset);
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(bytes), g_fp8_table, 4);
  }
}

// exp of each lane (x <= 0 here: a score less the running max), to about 1 ulp: Cephes' expf
// polynomial on x - n ln2, scaled by 2^n. Lanes far below -87 give ~1e-38, not 0, which no
// softmax sum of at least 1 (the max's own weight) can tell apart.
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Lane t of the result is the sum of p[t]'s 16 lanes: 16 dot products from their partial sums
// in 46 shuffles and adds, instead of 16 horizontal reductions.
inline __m512 sum_each(const __m512* p) {
  __m512 halves[8];  // lanes 0-7 sum to p[k], 8-15 to p[k + 8]
  for (int k = 0; k < 8; ++k) {
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[k], p[k + 8], 0x44),
                              _mm512_shuffle_f32x4(p[k], p[k + 8], 0xee));
  }
  __m512 quarters[4];  // 128-bit blocks sum to p[k], p[k + 8], p[k + 4], p[k + 12]
  for (int k = 0; k < 4; ++k) {
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[k], halves[k + 4], 0x88),
                                _mm512_shuffle_f32x4(halves[k], halves[k + 4], 0xdd));
  }
  const __m512 low = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                                   _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 high = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                                    _mm512_unpackhi_ps(quarters[2], quarters[3]));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(low, high, 0x44),
                                    _mm512_shuffle_ps(low, high, 0xee));
  return _mm512_shuffle_f32x4(sums, sums, 0xd8);  // blocks 0, 2, 1, 3: key order
}

// Partial dot products of `kHeads` query heads with each of the tile's `count` K rows: for key
// t and head j, partial[j][t]'s lanes sum to the dot product. Rows past `count` are zero.
template <int kDtype, int kHeads, int kChunks>
inline void score_partials(const Item& item, const float* queries, int64_t k_base, int count,
                           __m512 (*partial)[kTile]) {
  const int num_chunks = chunks_of<kChunks>(item.head_dim);
  __m512 query[kHeads][kChunks > 0 ? kChunks : kMaxChunks];
  for (int c = 0; c < num_chunks; ++c) {
    const __mmask16 mask = chunk_mask<kChunks>(c, num_chunks, item.head_dim);
    for (int j = 0; j < kHeads; ++j) {
      query[j][c] = _mm512_maskz_loadu_ps(mask, queries + j * item.head_dim + 16 * c);
    }
  }
  for (int t = 0; t < kTile; ++t) {
    __m512 sums[kHeads];
    for (int j = 0; j < kHeads; ++j) sums[j] = _mm512_setzero_ps();
    if (t < count) {
      for (int c = 0; c < num_chunks; ++c) {
        const __mmask16 mask = chunk_mask<kChunks>(c, num_chunks, item.head_dim);
        const __m512 key = load_chunk<kDtype>(item.cache, k_base + t * item.row_stride + 16 * c, mask);
        for (int j = 0; j < kHeads; ++j) sums[j] = _mm512_fmadd_ps(query[j][c], key, sums[j]);
      }
    }
    for (int j = 0; j < kHeads; ++j) partial[j][t] = sums[j];
  }
}

// acc[j] = acc[j] * correction[j] + sum over the tile's keys of weights[j][t] * V row t.
template <int kDtype, int kHeads, int kChunks>
inline void accumulate_values(const Item& item, int64_t v_base, int count, const float* correction,
                              const float (*weights)[kTile], float* acc) {
  const int num_chunks = chunks_of<kChunks>(item.head_dim);
  for (int c = 0; c < num_chunks; ++c) {
    const __mmask16 mask = chunk_mask<kChunks>(c, num_chunks, item.head_dim);
    __m512 sums[kHeads];
    for (int j = 0; j < kHeads; ++j) {
      sums[j] = _mm512_mul_ps(_mm512_load_ps(acc + j * kMaxHeadDim + 16 * c),
                              _mm512_set1_ps(correction[j]));
    }
    for (int t = 0; t < count; ++t) {
      const __m512 value = load_chunk<kDtype>(item.cache, v_base + t * item.row_stride + 16 * c, mask);
      for (int j = 0; j < kHeads; ++j) {
        sums[j] = _mm512_fmadd_ps(_mm512_set1_ps(weights[j][t]), value, sums[j]);
      }
    }
    for (int j = 0; j < kHeads; ++j) _mm512_store_ps(acc + j * kMaxHeadDim + 16 * c, sums[j]);
  }
}

// One tile (up to 16 consecutive keys of one block) for the heads [h0, h0 + kHeads).
template <int kDtype, int kHeads, int kChunks>
void attend_tile(const Item& item, int h0, int64_t k_base, int count, float* running_max,
                 float* running_sum, float (*acc)[kMaxHeadDim]) {
  __m512 partial[kHeads][kTile];
  score_partials<kDtype, kHeads, kChunks>(item, item.queries + h0 * item.head_dim, k_base, count, partial);
  alignas(64) float weights[kHeads][kTile];
  float correction[kHeads];
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  for (int j = 0; j < kHeads; ++j) {
    __m512 scores = _mm512_mul_ps(sum_each(partial[j]), _mm512_set1_ps(item.scale));
    if (item.softcap > 0.0f) {
      _mm512_store_ps(weights[j], scores);
      for (int t = 0; t < count; ++t) weights[j][t] = capped(weights[j][t], item.softcap);
      scores = _mm512_load_ps(weights[j]);
    }
    scores = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), valid, scores);
    const float tile_max = _mm512_reduce_max_ps(scores);
    const int h = h0 + j;
    const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
    // 0 on the first tile, without expf's slow underflow path
    correction[j] = running_max[h] == -FLT_MAX ? 0.0f : expf(running_max[h] - new_max);
    running_max[h] = new_max;
    const __m512 kept =
        _mm512_maskz_mov_ps(valid, exp_lanes(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    _mm512_store_ps(weights[j], kept);
    running_sum[h] = running_sum[h] * correction[j] + _mm512_reduce_add_ps(kept);
  }
  accumulate_values<kDtype, kHeads, kChunks>(item, k_base + item.kv_stride, count, correction, weights,
                                    acc[h0]);
}

template <int kDtype, int kChunks>
void attend_item_avx512(const Item& item) {
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
  const int padded_dim = (item.head_dim + 15) / 16 * 16;
  for (int h = 0; h < item.group; ++h) {
    running_max[h] = -FLT_MAX;  // finite: the library is built with -ffast-math
    running_sum[h] = 0.0f;
    for (int d = 0; d < padded_dim; ++d) acc[h][d] = 0.0f;
  }
  const int block_size = item.block_size;
  for (int block_start = item.start - item.start % block_size; block_start < item.end;
       block_start += block_size) {
    const int lo = block_start > item.start ? block_start : item.start;
    const int hi = block_start + block_size < item.end ? block_start + block_size : item.end;
    const int64_t block_base =
        item.block_ids[block_start / block_size] * item.block_stride + item.head_offset;
    for (int tile = lo; tile < hi; tile += kTile) {
      const int count = hi - tile < kTile ? hi - tile : kTile;
      const int64_t k_base = block_base + static_cast<int64_t>(tile - block_start) * item.row_stride;
      for (int h0 = 0; h0 < item.group; h0 += kHeadTile) {
        switch (item.group - h0 < kHeadTile ? item.group - h0 : kHeadTile) {
          case 1: attend_tile<kDtype, 1, kChunks>(item, h0, k_base, count, running_max, running_sum, acc); break;
          case 2: attend_tile<kDtype, 2, kChunks>(item, h0, k_base, count, running_max, running_sum, acc); break;
          case 3: attend_tile<kDtype, 3, kChunks>(item, h0, k_base, count, running_max, running_sum, acc); break;
          default: attend_tile<kDtype, 4, kChunks>(item, h0, k_base, count, running_max, running_sum, acc);
        }
      }
    }
  }
  store_result(item, acc, running_sum);
}

template <int kDtype>
void attend_item_avx512(const Item& item) {
  switch (item.head_dim) {
    case 64: return attend_item_avx512<kDtype, 4>(item);
    case 128: return attend_item_avx512<kDtype, 8>(item);
    default: return attend_item_avx512<kDtype, 0>(item);
  }
}
#endif

void attend_item(const Item& item, int dtype) {
#ifdef KVSERVE_AVX512
  switch (dtype) {
    case kFloat32: return attend_item_avx512<kFloat32>(item);
    case kBFloat16: return attend_item_avx512<kBFloat16>(item);
    case kFloat16: return attend_item_avx512<kFloat16>(item);
    default: return attend_item_avx512<kFloat8E4M3>(item);
  }
#else
  attend_item_generic(item, dtype);
#endif
}

}  // namespace

extern "C" {

// Returns 0, or a code naming the first argument out of the kernel's limits.
//
// q:          [num_tokens, num_heads, head_dim] of `q_dtype` (float32, bfloat16, float16),
//             `q_token_stride` elements from one token to the next
// query_tokens: int64 [num_seqs]: the token (row of q and out) each sequence attends for
// cache:      the layer's cache, [num_blocks, 2, block_size, num_kv_heads, head_dim] in elements
//             of `dtype`, with `block_stride` elements from one block to the next and
//             `kv_stride` from a block's K to its V (a token's row is num_kv_heads * head_dim)
// block_ids:  int64 [num_seqs, blocks_per_seq]: each sequence's context blocks, in order
// starts/ends: int32 [num_seqs]: it reads context entries [start, end) of those blocks'
//             concatenation (its window's first entry, and its own position plus one)
// out:        [num_tokens, num_heads * head_dim] of `out_dtype` (float32, bf16, float16),
//             `out_token_stride` elements from one token to the next; only the sequences'
//             tokens are written
int kvserve_paged_decode(const void* q, int q_dtype, int64_t q_token_stride,
                         const int64_t* query_tokens, const void* cache, int dtype,
                         int64_t block_stride, int64_t kv_stride, const int64_t* block_ids,
                         int blocks_per_seq, const int32_t* starts, const int32_t* ends,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, float softcap, void* out, int out_dtype,
                         int64_t out_token_stride, int num_threads) {
  if (head_dim < 1 || head_dim > kMaxHeadDim) return 1;
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 2;
  const int group = num_heads / num_kv_heads;
  if (group > kMaxGroup) return 3;
  if (block_size < 1 || block_size > kMaxBlockSize) return 4;
  if (dtype < kFloat32 || dtype > kFloat8E4M3) return 5;
  if (q_dtype < kFloat32 || q_dtype > kFloat16) return 6;
  if (out_dtype < kFloat32 || out_dtype > kFloat16) return 7;
  const int num_items = num_seqs * num_kv_heads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int index = 0; index < num_items; ++index) {
    const int seq = index / num_kv_heads;
    const int kv_head = index % num_kv_heads;
    const int64_t token = query_tokens[seq];
    const int64_t first_head = static_cast<int64_t>(kv_head) * group * head_dim;
    alignas(64) float queries[kMaxGroup * kMaxHeadDim];
    widen_row(q, token * q_token_stride + first_head, q_dtype, group * head_dim, queries);
    Item item;
    item.queries = queries;
    item.out = out;
    item.out_offset = token * out_token_stride + first_head;
    item.out_dtype = out_dtype;
    item.cache = cache;
    item.block_ids = block_ids + static_cast<int64_t>(seq) * blocks_per_seq;
    item.kv_stride = kv_stride;
    item.block_stride = block_stride;
    item.row_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
    item.head_offset = static_cast<int64_t>(kv_head) * head_dim;
    item.start = starts[seq];
    item.end = ends[seq];
    item.group = group;
    item.head_dim = head_dim;
    item.block_size = block_size;
    item.scale = scale;
    item.softcap = softcap;
    attend_item(item, dtype);
  }
  return 0;
}

}  // extern "C"
