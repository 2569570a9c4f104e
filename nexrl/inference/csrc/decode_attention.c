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
 *   scores scratch of max_len floats
 *
 * `elem` is float, or with -DBF16 a bfloat16 held in a uint16_t. Arithmetic is fp32
 * either way: a bf16 element is widened on load, and a result is rounded to the
 * nearest even bf16 once, on store (the rotated key appended to the cache, the output).
 *
 * Query head h reads kv head h / (heads / kv_heads) (grouped-query attention).
 * Each row reads only its own pos + 1 keys, so rows of different lengths cost
 * what they use. HEAD_DIM is a compile-time constant so that the per-key loops
 * unroll into a few vector instructions; the loader builds one library per
 * head size and element type.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head size>"
#endif

#ifdef BF16
typedef uint16_t elem;
static inline float load(elem x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
static inline elem store(float f) { /* round to nearest even; inputs are finite */
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return (elem)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float elem;
static inline float load(elem x) { return x; }
static inline elem store(float f) { return f; }
#endif

static inline float dot(const float *restrict a, const elem *restrict b) {
  float acc = 0.f;
  for (int d = 0; d < HEAD_DIM; ++d) acc += a[d] * load(b[d]);
  return acc;
}

/* softmax(scale * q.K^T) V for one query head against n cached keys. */
static void attend_one(const float *restrict qh, const elem *restrict keys,
                       const elem *restrict values, int64_t n, float scale,
                       float *restrict scores, elem *restrict o) {
  float top = -3.0e38f; /* finite: the library is built with -ffast-math */
  for (int64_t l = 0; l < n; ++l) {
    scores[l] = dot(qh, keys + l * HEAD_DIM) * scale;
    top = scores[l] > top ? scores[l] : top;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t l = 0; l < n; ++l) {
    scores[l] = expf(scores[l] - top);
    total += scores[l];
  }
  float acc[HEAD_DIM] = {0};
  for (int64_t l = 0; l < n; ++l) {
    const float p = scores[l];
    const elem *restrict vl = values + l * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] += p * load(vl[d]);
  }
  const float inv = 1.f / total;
  for (int d = 0; d < HEAD_DIM; ++d) o[d] = store(acc[d] * inv);
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

void decode_attention(const elem *restrict q, int64_t q_row_stride,
                      const elem *restrict k_new, int64_t k_row_stride,
                      const elem *restrict v_new, int64_t v_row_stride, elem *restrict k,
                      elem *restrict v, const int64_t *restrict pos, const elem *restrict cos,
                      const elem *restrict sin, elem *restrict out, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t max_len, float scale,
                      float *restrict scores) {
  const int64_t group = heads / kv_heads;
  float qh[HEAD_DIM], kr[HEAD_DIM];
  for (int64_t b = 0; b < rows; ++b) {
    const elem *cos_b = cos ? cos + pos[b] * HEAD_DIM : NULL;
    const elem *sin_b = sin ? sin + pos[b] * HEAD_DIM : NULL;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      const int64_t at = ((b * kv_heads + kh) * max_len + pos[b]) * HEAD_DIM;
      const elem *kx = k_new + b * k_row_stride + kh * HEAD_DIM;
      if (cos_b) {
        rotate(kx, cos_b, sin_b, kr);
        for (int d = 0; d < HEAD_DIM; ++d) k[at + d] = store(kr[d]);
      } else {
        copy(kx, k + at);
      }
      copy(v_new + b * v_row_stride + kh * HEAD_DIM, v + at);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const elem *qx = q + b * q_row_stride + h * HEAD_DIM;
      if (cos_b) {
        rotate(qx, cos_b, sin_b, qh);
      } else {
        widen(qx, qh);
      }
      const int64_t cache_row = (b * kv_heads + h / group) * max_len * HEAD_DIM;
      attend_one(qh, k + cache_row, v + cache_row, pos[b] + 1, scale, scores,
                 out + (b * heads + h) * HEAD_DIM);
    }
  }
}
