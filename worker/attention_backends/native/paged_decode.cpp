// Paged attention of single-query rows (decode steps) on the CPU, reading K and V in place.
//
// Two paths, chosen at compile time by the build's -march=native: with AVX-512 (F, BW, VL) the
// tile's K rows are widened in registers and each query head's 16 dot products are summed into
// one vector by a transpose-and-add tree (no horizontal reduction per key), and V is streamed
// once per tile for up to four query heads at a time, their accumulators held in registers.
// Without AVX-512 a portable loop does the same arithmetic, widening each row into a buffer.
// The AVX-512 path is paged_decode_avx512.h; native_build.py hashes both files into its cache
// key.
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
#include "paged_decode_avx512.h"
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
