// The AVX-512 path of paged_decode.cpp (included there, inside its anonymous namespace, when the
// build's -march=native has AVX-512 F, BW and VL): attend_item_avx512<dtype>(item).
//
// A tile is up to 16 consecutive keys of one block. Each query head's 16 dot products are summed
// into one vector of scores by a transpose-and-add tree (no horizontal reduction per key); K and
// V rows are widened to float32 in registers; V is streamed once per tile for up to four query
// heads, whose accumulators stay in registers. Head sizes 64 and 128 are compiled in.
// paged_decode.cpp includes <immintrin.h> first, outside the namespace.

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
