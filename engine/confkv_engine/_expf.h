/* Single-precision exp for the native libraries (model/_rowops.c, retention/_mass.c,
   attention/kernels/_decode.c, cache/codec/_codes.c): one set of constants, a scalar form and an
   8-lane one.

   Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two so that n ln2 is exact),
   Cephes' degree-6 polynomial for exp(r), 2^n built in the exponent bits: within about 1 ulp of
   expf on [-87.3, 88.3]. Inputs are clamped there, so below it the result is exp(-87.3), about
   1.2e-38, where expf gives a subnormal or 0 (far below any softmax mass next to its maximum's 1).
   Branch-free, so loops over the scalar form vectorise: libm's scalar expf per element made the
   gated activations slower than PyTorch's vectorised ops, and was about 40 % of a one-row decode
   attention call. Not a public header. */

#ifndef CONFKV_EXPF_H
#define CONFKV_EXPF_H

#include <stdint.h>
#include <string.h>

#define CONFKV_EXP_LO (-87.3f)
#define CONFKV_EXP_HI 88.3f
#define CONFKV_EXP_SHIFT 12582912.0f /* 1.5 x 2^23: adding it rounds to an integer */
#define CONFKV_LOG2E 1.44269504088896341f
#define CONFKV_LN2_HI 0.693359375f
#define CONFKV_LN2_LO (-2.12194440e-4f)
#define CONFKV_EXP_P0 1.9875691500e-4f
#define CONFKV_EXP_P1 1.3981999507e-3f
#define CONFKV_EXP_P2 8.3334519073e-3f
#define CONFKV_EXP_P3 4.1665795894e-2f
#define CONFKV_EXP_P4 1.6666665459e-1f
#define CONFKV_EXP_P5 5.0000001201e-1f

/* n = round(x / ln2) and exp(x - n ln2) by Cephes' polynomial, into n and p, for x already clamped:
   x a float or a confkv_v8f (GCC's vector operators take both; one sequence of operations for the
   scalar and the vector forms). */
#define CONFKV_EXP_PARTS(x, n, p)                                                                  \
    do {                                                                                           \
        n = ((x) * CONFKV_LOG2E + CONFKV_EXP_SHIFT) - CONFKV_EXP_SHIFT;                            \
        const __typeof__(n) r_ = ((x) - n * CONFKV_LN2_HI) - n * CONFKV_LN2_LO;                    \
        p = CONFKV_EXP_P0 * r_ + CONFKV_EXP_P1;                                                    \
        p = p * r_ + CONFKV_EXP_P2;                                                                \
        p = p * r_ + CONFKV_EXP_P3;                                                                \
        p = p * r_ + CONFKV_EXP_P4;                                                                \
        p = p * r_ + CONFKV_EXP_P5;                                                                \
        p = (p * (r_ * r_) + r_) + 1.0f;                                                           \
    } while (0)

static inline float confkv_expf(float x) {
    x = x < CONFKV_EXP_LO ? CONFKV_EXP_LO : (x > CONFKV_EXP_HI ? CONFKV_EXP_HI : x);
    float n, p;
    CONFKV_EXP_PARTS(x, n, p);
    const int32_t e = ((int32_t)n + 127) << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return p * two_n;
}

#if defined(__GNUC__)
/* 8 fp32 / int32 lanes in GCC's vector extension (one AVX2 register; the same type as an __m256). */
typedef float confkv_v8f __attribute__((vector_size(32)));
typedef int32_t confkv_v8i __attribute__((vector_size(32)));

/* Always inlined, so no vector crosses a call: GCC still notes the ABI of vector returns at the end of
   the including file (outside any push / pop), hence for the whole file. */
#pragma GCC diagnostic ignored "-Wpsabi"
/* confkv_expf 8 lanes at a time, for x <= 88.3 (a score less its row's maximum): clamped below only
   (a NaN lane gives exp(-87.3)). With multiply-adds contracted where the caller's target has FMA. */
static inline __attribute__((always_inline)) confkv_v8f confkv_exp8(confkv_v8f x) {
    const confkv_v8f lo = (confkv_v8f){0} + CONFKV_EXP_LO;
    const confkv_v8i keep = x >= lo;
    x = (confkv_v8f)(((confkv_v8i)x & keep) | ((confkv_v8i)lo & ~keep));
    confkv_v8f n, p;
    CONFKV_EXP_PARTS(x, n, p);
    const confkv_v8i e = (__builtin_convertvector(n, confkv_v8i) + 127) << 23; /* 2^n */
    return p * (confkv_v8f)e;
}
#endif

#endif
