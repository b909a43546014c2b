// Paged attention of single-query rows (decode steps) on the CPU, reading K and V in place.
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

}  // namespace

extern "C" {

// Returns 0, or a code naming the first argument out of the kernel's limits.
//
// q:          float32 [num_seqs, num_heads, head_dim], contiguous
// cache:      the layer's cache, [num_blocks, 2, block_size, num_kv_heads, head_dim] in elements
//             of `dtype`, with `block_stride` elements from one block to the next and
//             `kv_stride` from a block's K to its V (a token's row is num_kv_heads * head_dim)
// block_ids:  int64 [num_seqs, blocks_per_seq]: each sequence's context blocks, in order
// starts/ends: int32 [num_seqs]: it reads context entries [start, end) of those blocks'
//             concatenation (its window's first entry, and its own position plus one)
// out:        float32 [num_seqs, num_heads, head_dim]
int kvserve_paged_decode(const float* q, const void* cache, int dtype, int64_t block_stride,
                         int64_t kv_stride, const int64_t* block_ids, int blocks_per_seq,
                         const int32_t* starts, const int32_t* ends, int num_seqs,
                         int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, float softcap, float* out, int num_threads) {
  if (head_dim < 1 || head_dim > kMaxHeadDim) return 1;
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 2;
  const int group = num_heads / num_kv_heads;
  if (group > kMaxGroup) return 3;
  if (block_size < 1 || block_size > kMaxBlockSize) return 4;
  if (dtype < kFloat32 || dtype > kFloat8E4M3) return 5;
  const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int num_items = num_seqs * num_kv_heads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int item = 0; item < num_items; ++item) {
    const int seq = item / num_kv_heads;
    const int kv_head = item % num_kv_heads;
    const float* queries = q + (static_cast<int64_t>(seq) * num_heads + kv_head * group) * head_dim;
    float* result = out + (static_cast<int64_t>(seq) * num_heads + kv_head * group) * head_dim;
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
    const int start = starts[seq];
    const int end = ends[seq];
    for (int tile_start = start - start % block_size; tile_start < end; tile_start += block_size) {
      const int lo = tile_start > start ? tile_start : start;
      const int hi = tile_start + block_size < end ? tile_start + block_size : end;
      const int64_t block = block_ids[static_cast<int64_t>(seq) * blocks_per_seq +
                                      tile_start / block_size];
      const int64_t block_base = block * block_stride + kv_head * head_dim;
      const int count = hi - lo;
      for (int t = 0; t < count; ++t) {
        const int64_t offset = block_base + static_cast<int64_t>(lo + t - tile_start) * row_stride;
        widen_row(cache, offset, dtype, head_dim, keys[t]);
      }
      for (int h = 0; h < group; ++h) {
        const float* query = queries + h * head_dim;
        float tile_max = -FLT_MAX;
        for (int t = 0; t < count; ++t) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < head_dim; ++d) dot += query[d] * keys[t][d];
          float score = dot * scale;
          if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
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
            block_base + kv_stride + static_cast<int64_t>(lo + t - tile_start) * row_stride;
        widen_row(cache, offset, dtype, head_dim, values);
        for (int h = 0; h < group; ++h) {
          const float weight = scores[h][t];
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) acc[h][d] += weight * values[d];
        }
      }
    }
    for (int h = 0; h < group; ++h) {
      const float inverse = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) result[h * head_dim + d] = acc[h][d] * inverse;
    }
  }
  return 0;
}

}  // extern "C"
