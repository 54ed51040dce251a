/* The shared parts of the codes kernels (_codes.c: the array folds and the entry point; _codes_vec.c:
   the folds in 8-lane vectors): a block layout's fields, the fp16 and dq6 parameter reads, code
   unpacking, the per-thread scratch and the fold signature. Included by those two files only. */

#ifndef CONFKV_CODES_H
#define CONFKV_CODES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Attention needs 1e-5 agreement, not bit-identity: let the compiler fuse multiply-adds in these
   kernels (the build's -ffp-contract=off is for the decoder, _dequant.c). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#pragma GCC diagnostic ignored "-Wpsabi" /* vector-returning helpers are always inlined */
#endif

#include "../../_expf.h" /* after the pragma: its exp contracts as these kernels do */

#define CONFKV_HIDDEN __attribute__((visibility("hidden")))

/* The 8-lane vector folds exist where GCC targets x86-64 (they run only where the CPU has x86-64-v3). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CONFKV_VECTOR_FOLDS 1
#else
#define CONFKV_VECTOR_FOLDS 0
#endif


#define INLINE static inline __attribute__((always_inline))

/* 8 fp32 / int32 lanes in GCC's vector extension: one AVX2 register, half an AVX-512 one (16-lane
   vectors measured 2.5x slower than the arrays in the AVX2 clone, where GCC spilled them to the
   stack; 8 lanes are the width every clone but the baseline holds in one register). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

INLINE v8f splat(float x) { return (v8f){0} + x; }

INLINE v8f pick(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

enum { L_BITS, L_GROUP, L_DQ6, L_OFFSET, L_GROUPS, L_ROW_GROUPS, L_ROWS, L_ROW_BYTES, L_NBYTES, L_LEN };

static inline __attribute__((unused)) float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0x1Fu) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp16 -> fp32 is exact either way; _Float16 compiles to one vcvtph2ps in the F16C (x86-64-v3/v4)
   clones, where the bit-level form costs branches per parameter (measured: most of the kernel's time). */
static inline float half_at(const uint8_t *p, int64_t i) {
#if defined(__FLT16_MAX__)
    _Float16 h;
    memcpy(&h, p + 2 * i, sizeof h);
    return (float)h;
#else
    uint16_t h;
    memcpy(&h, p + 2 * i, sizeof h);
    return from_half(h);
#endif
}

/* exp2f(k * -1/8) for the 64 dq6 scale codes: the same bits as calling exp2f per group (filled once, at
   load, in _codes.c), which cost most of a dq6 block's parameter reads. */
extern float confkv_dq6_octaves[64] CONFKV_HIDDEN;

/* Groups [first, first + count) of one block's fp32 (scale, min). fp16: straight conversions (8 at a
   time where _Float16 vectors exist). dq6: per row of groups its fp16 header (top, floor, step) once,
   then per group scale = top * 2^(-code / 8), min = floor + code * step. */
static inline __attribute__((always_inline)) void group_params(const uint8_t *blk, const int64_t *lay,
                                                                int64_t first, int count,
                                                                float *restrict scale, float *restrict min) {
    const uint8_t *p = blk + lay[L_OFFSET];
    if (lay[L_DQ6]) {
        const int64_t per_row = lay[L_ROW_GROUPS];
        for (int i = 0; i < count;) {
            const int64_t g = first + i, row = g / per_row, j = g % per_row;
            const int n = (int)(count - i < per_row - j ? count - i : per_row - j);
            const float top = half_at(p, 3 * row), floor_ = half_at(p, 3 * row + 1), step = half_at(p, 3 * row + 2);
            const uint8_t *codes = p + 6 * lay[L_ROWS] + row * lay[L_ROW_BYTES];
            for (int k = 0; k < n; k++) { /* group j + k: codes 2 (j + k), +1 = half of a 3-byte word */
                const uint64_t at = (uint64_t)(j + k);
                const uint8_t *w = codes + 3 * (at >> 1);
                const uint32_t word = (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16;
                const unsigned shift = (unsigned)(at & 1) * 12;
                scale[i + k] = top * confkv_dq6_octaves[(word >> shift) & 63u];
                min[i + k] = floor_ + (float)((word >> (shift + 6)) & 63u) * step;
            }
            i += n;
        }
        return;
    }
    p += 2 * first;
    const uint8_t *q = p + 2 * lay[L_GROUPS];
    int i = 0;
#if defined(__FLT16_MAX__)
    typedef _Float16 v8h __attribute__((vector_size(16)));
    for (; i + 8 <= count; i += 8) {
        v8h s16, m16;
        memcpy(&s16, p + 2 * i, sizeof s16);
        memcpy(&m16, q + 2 * i, sizeof m16);
        store8(scale + i, __builtin_convertvector(s16, v8f));
        store8(min + i, __builtin_convertvector(m16, v8f));
    }
#endif
    for (; i < count; i++) {
        scale[i] = half_at(p, i);
        min[i] = half_at(q, i);
    }
}

/* Codes [count] unpacked to fp32 in code order (bits constant in the specialised kernels: the loop
   unrolls and vectorises). */
static inline __attribute__((always_inline)) void unpack_float(const uint8_t *src, float *restrict dst,
                                                                int count, int bits) {
    if (bits == 8) {
        for (int i = 0; i < count; i++) dst[i] = (float)src[i];
        return;
    }
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1u;
    for (int i = 0; i < count / per; i++) {
        const unsigned b = src[i];
        for (int k = 0; k < per; k++) dst[i * per + k] = (float)((b >> (bits * k)) & mask);
    }
}

/* The per-thread scratch: scores [G, bs], K codes [D, bs] and V codes [bs, D] as fp32, key parameters
   [D, bs / kg], value parameters [bs, D / vg], the values' running p . vm [D / vg]. */
typedef struct {
    float *sc, *kc, *vc, *ks, *km, *vs, *vm, *pm;
} scratch_t;

/* One block pair folded into head h's G running states. */
typedef void (*fold_fn)(const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay,
                        const float *q, int G, int bs, int H, int D, int h, int valid, float *m, float *l,
                        float *acc, scratch_t *s);

/* The shapes the specialised folds are compiled for: (key bits, value bits, head_dim). */
#define FOLD_SHAPES(FOLD)                                                                                \
    FOLD(8, 8, 64) FOLD(4, 4, 64) FOLD(4, 2, 64) FOLD(2, 2, 64)                                          \
    FOLD(8, 8, 128) FOLD(4, 4, 128) FOLD(4, 2, 128) FOLD(2, 2, 128)                                      \
    FOLD(8, 8, 256) FOLD(4, 4, 256) FOLD(4, 2, 256) FOLD(2, 2, 256)

/* The fold PREFIX##KB##_##VB##_##D of a shape with head_dim D in 64 / 128 / 256 (checked by the caller). */
#define FOLD_BY_DIM(PREFIX, KB, VB, D)                                                                  \
    ((D) == 64 ? PREFIX##KB##_##VB##_64 : (D) == 128 ? PREFIX##KB##_##VB##_128 : PREFIX##KB##_##VB##_256)

/* The vector fold of one shape (_codes_vec.c; head_dim 64 / 128 / 256), NULL for other bits. */
CONFKV_HIDDEN fold_fn confkv_codes_vector_fold(int64_t kb, int64_t vb, int D);

#endif
