/* The shared parts of the CPU decode attention (_decode.c: the plain-C path and the entry point;
   _decode_simd.c: the AVX-512 and AVX2 + FMA paths): dtypes, limits, a row's view of the pool and
   the bf16 conversion. Included by those two files only. */

#ifndef CONFKV_DECODE_H
#define CONFKV_DECODE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../_expf.h"

enum { DT_F32 = 0, DT_BF16 = 1 };
#define MAX_D 256
#define MAX_GROUP 16

/* The SIMD paths (_decode_simd.c) exist where GCC targets x86-64; the CPU decides at run time. */
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_SIMD_PATHS 1
#endif


static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef struct {
    const void *pool;
    const int64_t *k_table, *v_table;
    int64_t bs, hkv, d;
    int dtype;
} Pool;

#ifdef HAVE_SIMD_PATHS
/* One KV head's `group` query heads over slots [lo, hi), as _decode.c's attend_group: AVX-512 for d
   a multiple of 16 up to 256, AVX2 + FMA for d a multiple of 16. */
__attribute__((visibility("hidden"))) void confkv_attend_group_avx512(const Pool *p, const float *q, int64_t group,
                                                                      int64_t lo, int64_t hi, int64_t head,
                                                                      float scale, float *scores, float *out,
                                                                      float *stats);
__attribute__((visibility("hidden"))) void confkv_attend_group_avx2(const Pool *p, const float *q, int64_t group,
                                                                    int64_t lo, int64_t hi, int64_t head,
                                                                    float scale, float *scores, float *out,
                                                                    float *stats);
#endif

#endif
