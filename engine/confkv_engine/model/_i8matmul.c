/* int8 weight-only matmul for a few activation rows (built into the _q4matmul library; loaded by
   q8native.py): y[r, n] = s[n] * sum_k x[r, k] q[n, k], x fp32 or bf16, fp32 sums, y in x's dtype.

   Why: at one row PyTorch's int8 weight-only kernel read Gemma 3's 262,144 x 640 LM head (168 MB)
   at about 12 GB/s on the development machine, a third of the memory bandwidth a plain sum reaches
   there; at one row the matmul is one pass over the weights, so the kernel should run at the
   bandwidth. The maths is PyTorch's (bf16 widened to fp32, fp32 accumulation, times the row's
   scale, rounded once to bf16), the sums in another order.

   Four weight rows per call share the activations' loads. AVX-512 intrinsics where the CPU has
   them (checked at run time); elsewhere plain C the compiler vectorises, cloned for AVX2 / x86-64
   and chosen at load by the CPU (target_clones), as the decode attention kernel does. OpenMP over
   output rows (each weight row is read once, by one thread). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { I8_F32 = 0, I8_BF16 = 1 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float i8_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t i8_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Four weight rows against one activation row: the activations are loaded once for the four. */
CLONES
static void dot4(const float *restrict x, const int8_t *restrict w, int64_t k, float *restrict out) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    const int8_t *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < k; i++) {
        a0 += x[i] * (float)w[i];
        a1 += x[i] * (float)w1[i];
        a2 += x[i] * (float)w2[i];
        a3 += x[i] * (float)w3[i];
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}

CLONES
static float dot1(const float *restrict x, const int8_t *restrict w, int64_t k) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t i = 0; i < k; i++) a += x[i] * (float)w[i];
    return a;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_I8_AVX512 1
/* dot4 in AVX-512 registers (the compiler's own vectorisation of dot4 used 4-wide registers):
   sixteen int8 weights sign-extended, converted and multiplied into each row's accumulator. */
__attribute__((target("avx512f"))) static void dot4_avx512(const float *restrict x,
                                                           const int8_t *restrict w, int64_t k,
                                                           float *restrict out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
#define I8_W16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
    for (; i + 16 <= k; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(xv, I8_W16(w + i), a0);
        a1 = _mm512_fmadd_ps(xv, I8_W16(w + k + i), a1);
        a2 = _mm512_fmadd_ps(xv, I8_W16(w + 2 * k + i), a2);
        a3 = _mm512_fmadd_ps(xv, I8_W16(w + 3 * k + i), a3);
    }
#undef I8_W16
    float r[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                  _mm512_reduce_add_ps(a3)};
    for (; i < k; i++)
        for (int t = 0; t < 4; t++) r[t] += x[i] * (float)w[t * k + i];
    for (int t = 0; t < 4; t++) out[t] = r[t];
}
#endif

typedef void (*Dot4Fn)(const float *, const int8_t *, int64_t, float *);

static Dot4Fn dot4_fn(void) {
#ifdef HAVE_I8_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return dot4_avx512;
#endif
    return dot4;
}

static inline void put(void *y, int dt, int64_t at, float v) {
    if (dt == I8_F32) ((float *)y)[at] = v;
    else ((uint16_t *)y)[at] = i8_f32_to_bf16(v);
}

/* Returns 0, or -3 when scratch memory cannot be had. */
int confkv_i8_matmul(const void *x, int dt, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                     int64_t n, void *y, int threads) {
    float *xf = malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL) return -3;
    for (int64_t i = 0; i < rows * k; i++)
        xf[i] = dt == I8_F32 ? ((const float *)x)[i] : i8_bf16_to_f32(((const uint16_t *)x)[i]);
    const int64_t quads = n / 4;
    const Dot4Fn dot = dot4_fn();
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < quads; j++) {
            for (int64_t r = 0; r < rows; r++) {
                float o[4];
                dot(xf + r * k, q + 4 * j * k, k, o);
                for (int t = 0; t < 4; t++) put(y, dt, r * n + 4 * j + t, o[t] * scale[4 * j + t]);
            }
        }
#pragma omp single
        for (int64_t j = 4 * quads; j < n; j++)
            for (int64_t r = 0; r < rows; r++) put(y, dt, r * n + j, dot1(xf + r * k, q + j * k, k) * scale[j]);
    }
    free(xf);
    return 0;
}
