/* Decode-step attention over a slot KV cache, one query token per running row.
 *
 * Layouts (elements of type `elem`, contiguous unless a stride is given):
 *   q      (rows, heads, HEAD_DIM), rows `q_row_stride` elements apart
 *   k_new, v_new (rows, kv_heads, HEAD_DIM), rows `k_row_stride` / `v_row_stride` apart: the
 *          step's keys and values, appended to the cache at pos before attending
 *   k, v   (slots, kv_heads, max_len, HEAD_DIM); row b uses slot b
 *   pos    (rows,) the last position row b attends to (inclusive)
 *   cos, sin  NULL, or RoPE tables (max_len, HEAD_DIM) with rotate-half's sign folded
 *          into sin: q and k_new are then rotated at pos here (the caller skips it)
 *   out    (rows, heads, HEAD_DIM)
 *   scores scratch of (heads / kv_heads) * max_len floats
 *
 * `elem` is float, or with -DBF16 a bfloat16 held in a uint16_t. Arithmetic is fp32
 * either way: a bf16 element is widened on load, and a result is rounded to the
 * nearest even bf16 once, on store (the rotated key appended to the cache, the output).
 *
 * Query head h reads kv head h / (heads / kv_heads) (grouped-query attention); the
 * query heads of one kv head are attended together, so that each cached key and value
 * is read once per kv head, not once per query head. Each row reads only its own pos + 1
 * keys, so rows of different lengths cost
 * what they use. HEAD_DIM is a compile-time constant so that the per-key loops
 * unroll into a few vector instructions; the loader builds one library per
 * head size and element type.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head size>"
#endif

#include "elem.h"

static inline float dot(const float *restrict a, const float *restrict b) {
  float acc = 0.f;
  for (int d = 0; d < HEAD_DIM; ++d) acc += a[d] * b[d];
  return acc;
}

/* Ask for one cached key or value row (HEAD_DIM elements) ahead of its use. The rows of
 * one (slot, kv head) are contiguous but each block is short and the next one starts
 * elsewhere, so the hardware prefetcher finds every block cold: attention over a cache
 * that the step's weights have pushed out of L3 ran at about half its in-cache speed. */
static inline void prefetch(const elem *row) {
  for (size_t at = 0; at < HEAD_DIM * sizeof(elem); at += 64)
    __builtin_prefetch((const char *)row + at, 0, 3);
}

/* softmax(scale * q.K^T) V for the `group` query heads that share one kv head, against
 * its n cached keys: each key and value is read (and widened) once for the whole group.
 * qg (group, HEAD_DIM) fp32; scores scratch of group * n floats; o (group, HEAD_DIM). */
static void attend_group(const float *restrict qg, int64_t group, const elem *restrict keys,
                         const elem *restrict values, int64_t n, float scale,
                         float *restrict scores, elem *restrict o, const elem *next_keys,
                         const elem *next_values, int64_t next_n) {
  float top[group], total[group];
  for (int64_t g = 0; g < group; ++g) top[g] = -3.0e38f; /* finite: built with -ffast-math */
  float row[HEAD_DIM];
  for (int64_t l = 0; l < n; ++l) {
    const elem *restrict kl = keys + l * HEAD_DIM;
    if (l < next_n) prefetch(next_keys + l * HEAD_DIM);
    for (int d = 0; d < HEAD_DIM; ++d) row[d] = load(kl[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float s = dot(qg + g * HEAD_DIM, row) * scale;
      scores[g * n + l] = s;
      top[g] = s > top[g] ? s : top[g];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float *restrict sg = scores + g * n, sum = 0.f;
    const float t = top[g];
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < n; ++l) {
      sg[l] = expf(sg[l] - t);
      sum += sg[l];
    }
    total[g] = sum;
  }
  for (int64_t l = n; l < next_n; ++l) { /* the next block is longer than this one */
    prefetch(next_keys + l * HEAD_DIM);
    prefetch(next_values + l * HEAD_DIM);
  }
  /* head by head, the accumulator in registers: after the first head the block's values
   * are read from L1 or L2 (10 KB at 40 positions in fp32, 256 KB at 1,000) */
  for (int64_t g = 0; g < group; ++g) {
    float acc[HEAD_DIM] = {0};
    const float *restrict sg = scores + g * n;
    for (int64_t l = 0; l < n; ++l) {
      const elem *restrict vl = values + l * HEAD_DIM;
      if (g == 0 && l < next_n) prefetch(next_values + l * HEAD_DIM);
      for (int d = 0; d < HEAD_DIM; ++d) acc[d] += sg[l] * load(vl[d]);
    }
    const float inv = 1.f / total[g];
    for (int d = 0; d < HEAD_DIM; ++d) o[g * HEAD_DIM + d] = store(acc[d] * inv);
  }
}

/* Widen src into fp32 (the query), or copy it as it is into the cache (k_new, v_new). */
static void widen(const elem *restrict src, float *restrict dst) {
  for (int d = 0; d < HEAD_DIM; ++d) dst[d] = load(src[d]);
}

static void copy(const elem *restrict src, elem *restrict dst) {
  for (int d = 0; d < HEAD_DIM; ++d) dst[d] = src[d];
}

/* RoPE: x * cos + rotate_half(x) * sin, rotate_half's sign already in sin. */
static void rotate(const elem *restrict x, const elem *restrict cos, const elem *restrict sin,
                   float *restrict out) {
  const int half = HEAD_DIM / 2;
  for (int d = 0; d < half; ++d)
    out[d] = load(x[d]) * load(cos[d]) + load(x[d + half]) * load(sin[d]);
  for (int d = half; d < HEAD_DIM; ++d)
    out[d] = load(x[d]) * load(cos[d]) + load(x[d - half]) * load(sin[d]);
}

/* One (row, kv head) block: append the step's key (rotated) and value at pos, rotate the
 * group's queries, attend. `scores`: this thread's scratch of group * max_len floats. */
static void block(const elem *restrict q, int64_t q_row_stride, const elem *restrict k_new,
                  int64_t k_row_stride, const elem *restrict v_new, int64_t v_row_stride,
                  elem *restrict k, elem *restrict v, const int64_t *restrict pos,
                  const elem *restrict cos, const elem *restrict sin, elem *restrict out,
                  int64_t rows, int64_t heads, int64_t kv_heads, int64_t max_len, float scale,
                  float *restrict scores, int64_t b, int64_t kh) {
  const int64_t group = heads / kv_heads;
  float qg[group * HEAD_DIM], kr[HEAD_DIM];
  const elem *cos_b = cos ? cos + pos[b] * HEAD_DIM : NULL;
  const elem *sin_b = sin ? sin + pos[b] * HEAD_DIM : NULL;
  const int64_t at = ((b * kv_heads + kh) * max_len + pos[b]) * HEAD_DIM;
  const elem *kx = k_new + b * k_row_stride + kh * HEAD_DIM;
  if (cos_b) {
    rotate(kx, cos_b, sin_b, kr);
    for (int d = 0; d < HEAD_DIM; ++d) k[at + d] = store(kr[d]);
  } else {
    copy(kx, k + at);
  }
  copy(v_new + b * v_row_stride + kh * HEAD_DIM, v + at);
  for (int64_t g = 0; g < group; ++g) {
    const elem *qx = q + b * q_row_stride + (kh * group + g) * HEAD_DIM;
    if (cos_b) {
      rotate(qx, cos_b, sin_b, qg + g * HEAD_DIM);
    } else {
      widen(qx, qg + g * HEAD_DIM);
    }
  }
  const int64_t cache_row = (b * kv_heads + kh) * max_len * HEAD_DIM;
  /* the next block: this row's next kv head, or the next row's first (same stride) */
  const int64_t next_b = kh + 1 < kv_heads ? b : b + 1;
  const int64_t next_n = next_b < rows ? pos[next_b] + 1 : 0;
  const int64_t next_row = cache_row + max_len * HEAD_DIM;
  attend_group(qg, group, k + cache_row, v + cache_row, pos[b] + 1, scale, scores,
               out + (b * heads + kh * group) * HEAD_DIM, k + next_row, v + next_row, next_n);
}

/* The blocks are independent (each writes its own cache rows and output heads): with
 * `threads` > 1 in a build with OpenMP they are split among that many threads, each with
 * its own part of `scores` (threads * (heads / kv_heads) * max_len floats). */
void decode_attention(const elem *restrict q, int64_t q_row_stride,
                      const elem *restrict k_new, int64_t k_row_stride,
                      const elem *restrict v_new, int64_t v_row_stride, elem *restrict k,
                      elem *restrict v, const int64_t *restrict pos, const elem *restrict cos,
                      const elem *restrict sin, elem *restrict out, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t max_len, float scale,
                      float *restrict scores, int64_t threads) {
  const int64_t per_thread = heads / kv_heads * max_len;
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t blk = 0; blk < rows * kv_heads; ++blk) {
#ifdef _OPENMP
    float *mine = scores + omp_get_thread_num() * per_thread;
#else
    float *mine = scores;
#endif
    block(q, q_row_stride, k_new, k_row_stride, v_new, v_row_stride, k, v, pos, cos, sin, out,
          rows, heads, kv_heads, max_len, scale, mine, blk / kv_heads, blk % kv_heads);
  }
  (void)per_thread;
}
