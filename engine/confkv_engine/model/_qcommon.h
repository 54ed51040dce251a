/* What the native matmuls (_q8matmul.c), their activations' quantization (_qacts.c) and their callers
   share: the activation group, the codes of the ISA paths and dtypes their Python callers pass,
   reading / writing fp32 or bf16 elements, and the quantization's entry point. Not a public header. */

#ifndef CONFKV_QCOMMON_H
#define CONFKV_QCOMMON_H

#include <stdint.h>
#include <string.h>

#define GROUP 32 /* activations are quantized per row and group of 32 */

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };
enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float load_x(const void *x, int dtype, int64_t i) {
    if (dtype == DT_F32) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store_y(void *y, int dtype, int64_t i, float v) {
    if (dtype == DT_F32) { ((float *)y)[i] = v; return; }
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (finite values) */
    ((uint16_t *)y)[i] = (uint16_t)(u >> 16);
}

/* Quantizes x [rows, k] (k a multiple of GROUP) into q [rows, k] with, per row, s / flip32 / xsum
   [k / GROUP], flip16 / isum [2 k / GROUP] and off [1] (_qacts.c says what each holds). */
void confkv_quantize_rows(const void *x, int dtype, int64_t rows, int64_t k, int8_t *q, float *s,
                          float *off, float *flip16, float *flip32, float *xsum, int32_t *isum, int threads);

#endif
