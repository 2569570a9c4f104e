/* Row-wise fused operations of the decode step, on rows of n elements (`elem.h`):
 *
 *   add_rms_norm  x += delta (skipped when delta is NULL), then out = w * rmsnorm(x):
 *                 a residual connection and the next RMSNorm in one pass
 *   silu_mul      out = silu(gate) * up, each row of gate_up being [gate | up]
 *
 * In bf16, every value that the HF modules round to bf16 is rounded here too (the
 * residual sum, the normalised x before the weight, silu(gate) before the product), so
 * the results are the torch path's; the sums and the arithmetic are fp32. With
 * `threads` > 1 in a build with OpenMP, rows are split over that many threads (on
 * torch's own runtime, see native.py).
 */
#include <math.h>
#include <stdint.h>

#include "elem.h"

void add_rms_norm(elem *restrict x, const elem *restrict delta, const elem *restrict w,
                  elem *restrict out, int64_t rows, int64_t n, float eps, int64_t threads) {
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < rows; ++b) {
    elem *restrict xb = x + b * n;
    float sum = 0.f;
    if (delta) {
      const elem *restrict db = delta + b * n;
      for (int64_t i = 0; i < n; ++i) {
        const elem r = store(load(xb[i]) + load(db[i]));
        xb[i] = r;
        sum += load(r) * load(r);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) sum += load(xb[i]) * load(xb[i]);
    }
    const float inv = 1.f / sqrtf(sum / (float)n + eps);
    elem *restrict ob = out + b * n;
    for (int64_t i = 0; i < n; ++i) ob[i] = store(load(w[i]) * load(store(load(xb[i]) * inv)));
  }
}

void silu_mul(const elem *restrict gate_up, elem *restrict out, int64_t rows, int64_t n,
              int64_t threads) {
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < rows; ++b) {
    const elem *restrict g = gate_up + b * 2 * n;
    const elem *restrict u = g + n;
    elem *restrict o = out + b * n;
    for (int64_t i = 0; i < n; ++i) {
      const float gv = load(g[i]);
      o[i] = store(load(store(gv / (1.f + expf(-gv)))) * load(u[i]));
    }
  }
}
