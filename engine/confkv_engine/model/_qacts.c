/* The native matmuls' activations (_q8matmul.c): every row quantized to int8 per group of 32, with
   the per-group numbers the tiles need. In the library ``_native``; declared in _qcommon.h.

   Per row and group g of 32 inputs x_j: s = max|x| / 127, a_j = round(x_j / s) (nearest, ties to
   even) in -127..127, and
     flip16[2g + h] = 128 s (sum of a over half h), flip32[g] = 128 s (sum of a over the group),
     isum[2g + h]   = the sum of a over half h itself (int32: the narrow int8 tiles' exact offset),
     xsum[g]        = the fp32 sum of the group's x (the 4-bit weights' zero term),
     off            = 128 sum_g s[g] (sum of a over group g), accumulated in double.

   Why a file of its own, with an AVX2 path: the matmuls quantize their whole input at every call,
   and the portable loop called libm's nearbyintf per element (x86-64's baseline has no rounding
   instruction) on one thread. At 512 prefill rows of SmolLM2's 576 inputs that was 1.9 ms a call,
   82 % of a 192 x 576 int4 matmul and 60 % of a 576 x 576 one (2 threads, AMD EPYC, AVX2 path;
   scratch timing of the library before this file). The AVX2 path rounds eight lanes with one
   instruction (the same rounding as nearbyintf in the default mode, so the codes, scales and flips
   are the portable loop's exactly); only ``xsum`` adds in another order (eight lanes, then pairs),
   a last-bit difference. Rows go to OpenMP threads once there are enough of them. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "_qcommon.h"

/* Group g's scale and flips from the sums of its codes' two halves; returns its share of ``off``
   (before the factor 128). */
static inline double group_numbers(int64_t g, float scale, int32_t h0, int32_t h1, float *s, float *flip16,
                                   float *flip32, int32_t *isum) {
    s[g] = scale;
    isum[2 * g] = h0;
    isum[2 * g + 1] = h1;
    flip16[2 * g] = 128.f * scale * (float)h0;
    flip16[2 * g + 1] = 128.f * scale * (float)h1;
    flip32[g] = 128.f * scale * (float)(h0 + h1);
    return (double)scale * (h0 + h1);
}

/* One row, portable C. */
static void quantize_row(const void *x, int dtype, int64_t row, int64_t k, int8_t *q, float *s,
                         float *off, float *flip16, float *flip32, float *xsum, int32_t *isum) {
    float buf[GROUP];
    double total = 0.0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        float amax = 0.f, exact = 0.f;
        for (int j = 0; j < GROUP; j++) {
            buf[j] = load_x(x, dtype, row * k + g * GROUP + j);
            amax = fmaxf(amax, fabsf(buf[j]));
            exact += buf[j];
        }
        xsum[g] = exact;
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t half[2] = {0, 0};
        for (int j = 0; j < GROUP; j++) {
            q[g * GROUP + j] = (int8_t)nearbyintf(buf[j] * inv);
            half[j / 16] += q[g * GROUP + j];
        }
        total += group_numbers(g, scale, half[0], half[1], s, flip16, flip32, isum);
    }
    *off = (float)(128.0 * total);
}

typedef void (*RowFn)(const void *, int, int64_t, int64_t, int8_t *, float *, float *, float *, float *,
                      float *, int32_t *);

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2")
static inline __m256 load8(const void *x, int dtype, int64_t i) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)x + i);
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
}

/* quantize_row, eight lanes at a time (the products and roundings are the same operations). */
static void quantize_row_avx2(const void *x, int dtype, int64_t row, int64_t k, int8_t *q, float *s,
                              float *off, float *flip16, float *flip32, float *xsum, int32_t *isum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane split */
    double total = 0.0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = load8(x, dtype, row * k + g * GROUP + 8 * i);
        const float amax = hmax8(_mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
            _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask))));
        xsum[g] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* int32 -> int8 (codes are within -127..127: no saturation), back in input order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permutevar8x32_epi32(packed, order));
        const int32_t h0 = hsum8i(_mm256_add_epi32(c[0], c[1])), h1 = hsum8i(_mm256_add_epi32(c[2], c[3]));
        total += group_numbers(g, scale, h0, h1, s, flip16, flip32, isum);
    }
    *off = (float)(128.0 * total);
}
#pragma GCC pop_options

static RowFn pick_row_fn(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? quantize_row_avx2 : quantize_row;
}
#else
static RowFn pick_row_fn(void) { return quantize_row; }
#endif

/* The row function, chosen once (every thread that races here stores the same pointer). */
static RowFn row_fn(void) {
    static RowFn fn;
    if (fn == NULL) fn = pick_row_fn();
    return fn;
}

/* Rows below this many elements stay on the calling thread (a parallel region costs a few us). */
#define PARALLEL_MIN 8192

void confkv_quantize_rows(const void *x, int dtype, int64_t rows, int64_t k, int8_t *q, float *s,
                          float *off, float *flip16, float *flip32, float *xsum, int32_t *isum, int threads) {
    const RowFn fn = row_fn();
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        fn(x, dtype, r, k, q + r * k, s + r * groups, off + r, flip16 + 2 * r * groups, flip32 + r * groups,
           xsum + r * groups, isum + 2 * r * groups);
}
