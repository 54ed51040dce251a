/* Native int8-weight x int8-activation matmul for CPUs: y[r, n] = wscale[n] * sum_k x[r, k] q[n, k].

   Why: PyTorch's int8 weight-only kernel converts every weight to bf16 and runs bf16 FMAs, so once
   a step sends many rows through a layer it is compute-bound (Gemma 3's 262,144 x 640 LM head:
   132 ms at 32 rows, 6x its one-row time), and bf16 GEMM needs a dense copy twice the int8 size.
   Integer dot products do four multiply-adds per 32-bit lane (dpbusd: 64 per 512-bit instruction).

   - weights: ``Int8Weight`` (q in -127..127, one fp32 scale per output row), repacked once at load
     (q8native.pack, the same number of bytes) into blocks of 16 output rows: chunk c of block b
     holds inputs 4c..4c+3 of each of the 16 rows, 64 bytes, so one 512-bit load feeds one dpbusd
     whose 16 int32 lanes are 16 different outputs: no horizontal sums, and a group's integer sums
     take their scale once per 32 x 16 multiply-adds instead of once per 64;
   - activations: per row and group of 32, s = max|x| / 127, a = round(x / s) in -127..127 (as the
     int4 kernel, _q4matmul.c), so an outlier channel costs precision in its own group only; each
     row's 4-byte chunk is broadcast to all lanes;
   - y = wscale[n] * sum_g s[r, g] * dot(q[n, g], a[r, g]), exact int32 dots, fp32 accumulation.

   u8 x s8: dpbusd multiplies unsigned by signed bytes. The weights are flipped to unsigned as they
   are loaded (q ^ 0x80 = q + 128, once per load, shared by every activation row of the tile),
   which adds 128 * sum_j a_j to each group's dot; with a per-row weight scale, the sum over groups
   of s[g] * 128 * sum_j a[g, j] depends on the activation row only, so it is computed once per row
   at quantization (``off``) and taken out at the end. AVX2's maddubs saturates its int16 pairs, so
   that path uses the sign trick instead: maddubs(|a|, sign(q, a)), at most 2 * 127 * 127 < 32767.

   Paths, chosen by the caller (kernels.py reads the CPU flags) and re-checked here: AVX-512 VNNI
   (a block by up to RT activation rows: each weight chunk loaded once per tile), AVX2+FMA (4 rows
   at a time, 16 registers) and portable scalar C. Threads: OpenMP over the blocks of output rows,
   as many as the caller passes. Plain C with a C ABI, loaded by ctypes (q8native.py). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "_qcommon.h"

#define RT 8 /* activation rows per tile */
#define AVX2_ROWS 4 /* of which the AVX2 path takes at a time (16 registers) */

typedef struct {      /* quantized activations, rows x k */
    const int8_t *q;  /* [rows, k] */
    const float *s;   /* [rows, k / 32] each group's scale */
    const float *off; /* [rows] 128 * sum_g s[g] * sum_j a[g, j]: what the unsigned flip adds */
    int64_t k;
} Acts8;

typedef struct { /* packed weights: [n / 16][k / 4][16][4] int8 (see the header comment) */
    const int8_t *q;
    const float *scale; /* [n rounded up to 16] */
    int64_t k;
} W8;

/* One row of activations -> int8 groups, their scales and the row's offset. */
static void quantize_row(const void *x, int dtype, int64_t row, int64_t k, int8_t *q, float *s,
                         float *off) {
    float buf[GROUP];
    double total = 0.0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        float amax = 0.f;
        for (int j = 0; j < GROUP; j++) {
            buf[j] = load_x(x, dtype, row * k + g * GROUP + j);
            amax = fmaxf(amax, fabsf(buf[j]));
        }
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t codes = 0;
        for (int j = 0; j < GROUP; j++) {
            q[g * GROUP + j] = (int8_t)nearbyintf(buf[j] * inv);
            codes += q[g * GROUP + j];
        }
        s[g] = scale;
        total += (double)scale * codes;
    }
    *off = (float)(128.0 * total);
}

/* The 64 bytes of weight block b's chunk c (output row 16 b + l at bytes 4 l .. 4 l + 3). */
static inline const int8_t *chunk(const W8 *w, int64_t b, int64_t c) {
    return w->q + (b * (w->k / 4) + c) * 64;
}

/* ------------------------------------------------------------------ scalar path */

typedef void (*TileFn)(const W8 *, int64_t, const Acts8 *, int64_t, int, void *, int, int64_t);

/* Weight block b against activation rows r0 .. r0 + rows - 1; outputs past n are not stored. */
static void tile_scalar(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                        int y_dtype, int64_t n) {
    const int64_t k = w->k, groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        const int8_t *aq = a->q + (r0 + r) * k;
        float acc[16] = {0};
        for (int64_t g = 0; g < groups; g++) {
            int32_t dot[16] = {0};
            for (int64_t c = g * 8; c < g * 8 + 8; c++)
                for (int l = 0; l < 16; l++)
                    for (int i = 0; i < 4; i++) dot[l] += chunk(w, b, c)[l * 4 + i] * aq[c * 4 + i];
            for (int l = 0; l < 16; l++) acc[l] += a->s[(r0 + r) * groups + g] * (float)dot[l];
        }
        for (int l = 0; l < 16 && b * 16 + l < n; l++)
            store_y(y, y_dtype, (r0 + r) * n + b * 16 + l, w->scale[b * 16 + l] * acc[l]);
    }
}

/* ------------------------------------------------------------------ SIMD paths */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
/* One block (16 outputs, two registers of 8) by `rows` activation rows (a constant once inlined).
   Sign trick: maddubs(|a|, sign(w, a)) pairs stay within int16 (2 * 127 * 127). */
static inline __attribute__((always_inline)) void avx2_body(const W8 *w, int64_t b, const Acts8 *a,
                                                            int64_t r0, const int rows, __m256 out[2][RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) out[0][r] = out[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[2][RT];
        for (int r = 0; r < rows; r++) dot[0][r] = dot[1][r] = _mm256_setzero_si256();
        for (int64_t c = g * 8; c < g * 8 + 8; c++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)chunk(w, b, c));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(chunk(w, b, c) + 32));
            for (int r = 0; r < rows; r++) {
                const __m256i av = _mm256_set1_epi32(load4(a->q + (r0 + r) * k + c * 4));
                const __m256i aabs = _mm256_abs_epi8(av);
                const __m256i p0 = _mm256_maddubs_epi16(aabs, _mm256_sign_epi8(w0, av));
                const __m256i p1 = _mm256_maddubs_epi16(aabs, _mm256_sign_epi8(w1, av));
                dot[0][r] = _mm256_add_epi32(dot[0][r], _mm256_madd_epi16(p0, ones));
                dot[1][r] = _mm256_add_epi32(dot[1][r], _mm256_madd_epi16(p1, ones));
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 s = _mm256_set1_ps(a->s[(r0 + r) * groups + g]);
            out[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r]), s, out[0][r]);
            out[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1][r]), s, out[1][r]);
        }
    }
}

static void tile_avx2(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                      int y_dtype, int64_t n) {
    __m256 out[2][RT];
    for (int r1 = 0; r1 < rows; r1 += AVX2_ROWS) { /* 16 ymm registers: 4 rows at a time */
        const int count = rows - r1 < AVX2_ROWS ? rows - r1 : AVX2_ROWS;
        switch (count) {
        case 1: avx2_body(w, b, a, r0 + r1, 1, out); break;
        case 2: avx2_body(w, b, a, r0 + r1, 2, out); break;
        case 3: avx2_body(w, b, a, r0 + r1, 3, out); break;
        default: avx2_body(w, b, a, r0 + r1, AVX2_ROWS, out); break;
        }
        for (int r = 0; r < count; r++) {
            float v[16];
            _mm256_storeu_ps(v, _mm256_mul_ps(out[0][r], _mm256_loadu_ps(w->scale + b * 16)));
            _mm256_storeu_ps(v + 8, _mm256_mul_ps(out[1][r], _mm256_loadu_ps(w->scale + b * 16 + 8)));
            for (int l = 0; l < 16 && b * 16 + l < n; l++)
                store_y(y, y_dtype, (r0 + r1 + r) * n + b * 16 + l, v[l]);
        }
    }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
/* One block (16 outputs in the 16 int32 lanes) by `rows` activation rows (a constant once
   inlined): per 4-byte chunk, one weight load (flipped to unsigned, shared by the rows) and one
   dpbusd per row against the row's 4 activation bytes broadcast; the int32 sums of a group take
   its scale once (one convert and one fma per 32 * 16 multiply-adds per row). */
static inline __attribute__((always_inline)) void vnni_body(const W8 *w, int64_t b, const Acts8 *a,
                                                            int64_t r0, const int rows, __m512 out[RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[RT];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int64_t c = g * 8; c < g * 8 + 8; c++) {
            const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(chunk(w, b, c)), flip);
            for (int r = 0; r < rows; r++)
                dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(load4(a->q + (r0 + r) * k + c * 4)));
        }
        for (int r = 0; r < rows; r++)
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(a->s[(r0 + r) * groups + g]),
                                     out[r]);
    }
    const __m512 scale = _mm512_loadu_ps(w->scale + b * 16);
    for (int r = 0; r < rows; r++)
        out[r] = _mm512_mul_ps(_mm512_sub_ps(out[r], _mm512_set1_ps(a->off[r0 + r])), scale);
}

static void tile_vnni(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                      int y_dtype, int64_t n) {
    __m512 out[RT];
    switch (rows) {
    case 1: vnni_body(w, b, a, r0, 1, out); break;
    case 2: vnni_body(w, b, a, r0, 2, out); break;
    case 3: vnni_body(w, b, a, r0, 3, out); break;
    case 4: vnni_body(w, b, a, r0, 4, out); break;
    case 5: vnni_body(w, b, a, r0, 5, out); break;
    case 6: vnni_body(w, b, a, r0, 6, out); break;
    case 7: vnni_body(w, b, a, r0, 7, out); break;
    default: vnni_body(w, b, a, r0, RT, out); break;
    }
    for (int r = 0; r < rows; r++) {
        if (b * 16 + 16 > n) { /* the last, partial block */
            float v[16];
            _mm512_storeu_ps(v, out[r]);
            for (int l = 0; b * 16 + l < n; l++) store_y(y, y_dtype, (r0 + r) * n + b * 16 + l, v[l]);
        } else if (y_dtype == DT_F32) {
            _mm512_storeu_ps((float *)y + (r0 + r) * n + b * 16, out[r]);
        } else { /* bf16, round to nearest even as store_y */
            __m512i u = _mm512_castps_si512(out[r]);
            u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (r0 + r) * n + b * 16),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        }
    }
}
#pragma GCC pop_options
#else
#define HAVE_X86 0
#endif

static TileFn tile_fn(int isa) {
#if HAVE_X86
    __builtin_cpu_init();
    if (isa == ISA_VNNI && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl"))
        return tile_vnni;
    if (isa == ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return tile_avx2;
#endif
    return isa == ISA_SCALAR ? tile_scalar : NULL;
}

/* ------------------------------------------------------------------ entry point */

/* y [rows, n] (dtype y_dtype) = x [rows, k] (x_dtype) times (wq * wscale[:, None])'s transpose.
   Returns 0, or -1 when the CPU lacks the ISA asked for, -2 when k is not a multiple of 32,
   -3 when scratch memory cannot be had. */
int confkv_q8_matmul(const void *x, int x_dtype, int64_t rows, int64_t k, const int8_t *wq,
                     const float *wscale, int64_t n, void *y, int y_dtype, int isa, int threads) {
    TileFn tile = tile_fn(isa);
    if (tile == NULL) return -1;
    if (k % GROUP) return -2;
    const int64_t groups = k / GROUP;
    int8_t *aq = malloc((size_t)(rows * k));
    float *s = malloc(sizeof(float) * (size_t)(rows * groups + rows));
    if (aq == NULL || s == NULL) { free(aq); free(s); return -3; }
    float *off = s + rows * groups;
    for (int64_t r = 0; r < rows; r++) quantize_row(x, x_dtype, r, k, aq + r * k, s + r * groups, off + r);
    const W8 w = {wq, wscale, k};
    const Acts8 a = {aq, s, off, k};
    const int64_t blocks = (n + 15) / 16;
    /* Each thread owns a range of weight blocks (each weight read from memory once); inside a
       block the activation rows go in tiles of RT, the block's weights staying in L1. */
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r0 = 0; r0 < rows; r0 += RT)
            tile(&w, b, &a, r0, rows - r0 < RT ? (int)(rows - r0) : RT, y, y_dtype, n);
    free(aq);
    free(s);
    return 0;
}

/* Which paths this CPU can run: bit ISA set for each (the scalar one always). */
int confkv_q8_supported(void) {
    int bits = 1 << ISA_SCALAR;
    for (int isa = ISA_AVX2; isa <= ISA_VNNI; isa++)
        if (tile_fn(isa) != NULL) bits |= 1 << isa;
    return bits;
}
