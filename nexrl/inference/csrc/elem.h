/* The element type of the native kernels: float, or with -DBF16 a bfloat16 held in a
 * uint16_t. Arithmetic is fp32 either way: `load` widens, `store` rounds to the nearest
 * even bf16 (inputs are finite: the kernels are built with -ffast-math). */
#ifndef NEXRL_ELEM_H
#define NEXRL_ELEM_H
#include <stdint.h>
#include <string.h>

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

#endif
