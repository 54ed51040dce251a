/* What the native matmul (_q8matmul.c) and its fused greedy argmax (_q8argmax.c) share: the packed
   weights and quantized activations the tiles read, the tile functions, and the matmul file's
   quantization and tile lookup. Not a public header; _q8matmul.c's comment says what the layouts are. */

#ifndef CONFKV_Q8TILE_H
#define CONFKV_Q8TILE_H

#include <stdint.h>
#include <string.h>

#include "_qcommon.h"

#define RT 8 /* activation rows per tile */

typedef struct {          /* quantized activations, rows x k */
    const int8_t *q;      /* [rows, k] */
    const float *s;       /* [rows, k / 32] each group's scale */
    const float *off;     /* [rows] 128 * sum_g s[g] * sum_j a[g, j]: what the unsigned flip adds */
    const float *flip16;  /* [rows, k / 16] 128 * s[g] * sum of each 16 codes (the flip's share of a dot) */
    const float *flip32;  /* [rows, k / 32] the same per group of 32 (int4: / 16 is 8 * s * sum a) */
    const float *xsum;    /* [rows, k / 32] exact fp32 sum of each group's x (4-bit weights' zero term) */
    const int32_t *isum;  /* [rows, k / 16] sum of each 16 codes (the narrow int8 blocks' offset) */
    int64_t k;
} Acts8;

typedef struct { /* packed weights: [n / 16][k / 4][16][4] int8 (see the header comment) */
    const int8_t *q;
    const float *scale;      /* wg 0: fp32 [n rounded up to 16] */
    const uint16_t *half;    /* wg > 0: fp16 [n / 16][k / wg][16], a block's 16 rows together (int4: d) */
    const uint16_t *minimum; /* 4-bit weights only (wg 32): fp16 like half, w = d * q + minimum */
    const uint8_t *narrow;   /* optional: [n / 16] 1 where block b's codes lie in -16..15 (wg 32) / -32..31 (16) */
    int64_t k;
    int wg; /* inputs per weight scale: 0 (the whole row), 16 or 32 */
} W8;

/* The 16 fp16 values of weight block b's group h in `base` (half or minimum, wg > 0). */
static inline const uint16_t *group_of(const uint16_t *base, const W8 *w, int64_t b, int64_t h) {
    return base + (b * (w->k / w->wg) + h) * 16;
}

/* The 64 bytes of weight block b's chunk c (output row 16 b + l at bytes 4 l .. 4 l + 3). */
static inline const int8_t *chunk(const W8 *w, int64_t b, int64_t c) {
    return w->q + (b * (w->k / 4) + c) * 64;
}

/* The 64 bytes of 4-bit weight block b's chunk c: inputs 8c .. 8c + 7 of its 16 rows, byte 4 l + i
   holding input 8c + i of row 16 b + l in its low nibble and input 8c + 4 + i in its high one. */
static inline const uint8_t *chunk4(const W8 *w, int64_t b, int64_t c) {
    return (const uint8_t *)w->q + (b * (w->k / 8) + c) * 64;
}

/* 4 bytes at p as one int32 (broadcast to the lanes by the SIMD tiles). */
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef void (*TileFn)(const W8 *, int64_t, const Acts8 *, int64_t, int, void *, int, int64_t);

typedef struct { /* x's rows quantized for the tiles: confkv_q8_quantize fills, confkv_q8_release frees */
    Acts8 a;
    int8_t *q;
    float *f;
} Quantized;

int confkv_q8_quantize(const void *x, int x_dtype, int64_t rows, int64_t k, int threads, Quantized *out);
void confkv_q8_release(Quantized *qa);
/* The tile function of path `isa` for w's format after the entry points' checks; NULL with *rc set
   to their error code (-1 no such path here, -2 k not a multiple of 32, -4 another weight group). */
TileFn confkv_q8_tile(const W8 *w, int isa, int *rc);
/* The AVX2 + FMA tiles (_q8avx2.c): int8 weights (narrow blocks without the sign trick), 4-bit weights. */
void confkv_q8_tile_avx2(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y, int y_dtype,
                         int64_t n);
void confkv_q8_tile4_avx2(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y, int y_dtype,
                          int64_t n);

#endif
