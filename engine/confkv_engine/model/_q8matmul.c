/* Native int8- and int4-weight x int8-activation matmuls for CPUs, in blocks of 16 output rows:
   y[r, n] = sum_k x[r, k] w[n, k], w = q * scale (int8) or scale * (q - 8) + zero (int4).

   Why: PyTorch's int8 weight-only kernel converts every weight to bf16 and runs bf16 FMAs, so once
   a step sends many rows through a layer it is compute-bound (Gemma 3's 262,144 x 640 LM head:
   132 ms at 32 rows, 6x its one-row time), and bf16 GEMM needs a dense copy twice the int8 size;
   its int4 kernel wants bf16 activations and falls off its fast path without native bf16 (AVX2-only
   CPUs). Integer dot products do four multiply-adds per 32-bit lane (dpbusd: 64 per 512-bit
   instruction), the way llama.cpp's repacked Q8_0 / Q4 dots do (written from their description).

   - int8 weights: ``Int8Weight`` (q in -127..127, one fp32 scale per output row: wg = 0) or
     ``Int8GroupWeight`` (one fp32 scale per output row and group of wg = 32 or 16 inputs: GGUF's
     Q8_0 / Q5_0 blocks as stored, no second rounding; wg = 16 fits Q6_K's sub-blocks), repacked once at
     load (q8native.pack, the same number of bytes) into blocks of 16 output rows: chunk c of block
     b holds inputs 4c..4c+3 of each of the 16 rows, 64 bytes, so one 512-bit load feeds one dpbusd
     whose 16 int32 lanes are 16 different outputs: no horizontal sums, and a group's integer sums
     take their scale once per 32 x 16 multiply-adds instead of once per 64;
   - int4 weights (``Int4Weight``, groups of 32: GGUF's Q4_0 / Q4_1 / Q4_K), repacked
     (q8native.pack_int4) into the same blocks at half the bytes: chunk c holds inputs 8c..8c+7 of
     the 16 rows (``chunk4``), so one load feeds two dpbusd, the low nibbles and the high ones;
   - group scales (and int4's minimums, w = d q + m, so zero = m + 8 d) are fp16, 2 bytes per group
     and row instead of 4: GGUF's own precision for Q8_0 / Q5_0 / Q4_0 / Q4_1 (exact), a 2^-11
     relative rounding of Q4_K's products d * sc (PyTorch's int4 kernel keeps bf16, 2^-8). At one
     decode row these kernels are bound by reading the weights, and fp32 group scales were +12.5 %
     (int8) and +50 % (int4) on top of the codes;
   - activations: per row and group of 32, s = max|x| / 127, a = round(x / s) in -127..127, so an
     outlier channel costs precision in its own group only; each row's 4-byte chunk is broadcast
     to all lanes;
   - int8: y = sum_g s[r, g] * wscale[n(, g)] * dot(q[n, g], a[r, g]); int4: y = sum_g s[r, g] *
     scale[n, g] * dot(q[n, g] - 8, a[r, g]) + zero[n, g] * (exact fp32 sum of the group's x), so
     the activations' rounding meets only the centred codes (half the error of q in 0..15 for
     asymmetric groups) and none of it the zero term. Exact int32 dots, fp32 accumulation.

   u8 x s8: dpbusd multiplies unsigned by signed bytes. Int4 codes are unsigned already. Int8
   weights are flipped to unsigned as they are loaded (q ^ 0x80 = q + 128, once per load, shared by
   every activation row of the tile), which adds 128 * sum_j a_j to each group's dot; with a
   per-row weight scale, the sum over groups of s[g] * 128 * sum_j a[g, j] depends on the
   activation row only, so it is computed once per row at quantization (``off``) and taken out at
   the end. With per-group weight scales it is not: each group's int32 dot loses 128 * sum_j a_j
   (``flip16`` / ``flip32``, precomputed with the scale: one fused multiply-subtract per group). AVX2's maddubs
   saturates its int16 pairs, so that path uses the sign trick for int8: maddubs(|a|, sign(q, a)),
   at most 2 * 127 * 127 < 32767 (int4 needs none: 2 * 15 * 127; nor do blocks of Q5_0's narrow
   codes, which _q8avx2.c offsets by 16).

   Paths, chosen by the caller (kernels.py reads the CPU flags) and re-checked here: AVX-512 VNNI
   (a block by up to RT activation rows: each weight chunk loaded once per tile), AVX2+FMA
   (_q8avx2.c: 4 rows at a time, 16 registers) and portable scalar C. Threads: OpenMP over the blocks of output rows,
   as many as the caller passes. Plain C with a C ABI, loaded by ctypes (q8native.py). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "_q8tile.h"


/* IEEE half -> float, for the scalar path (the SIMD paths convert 8 or 16 at once). */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) { /* zero and subnormals: man * 2^-24 */
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ scalar path */

/* 4-bit weights, scalar: per group, s * d * (dot - 8 * sum a) + z * (exact sum of x). */
static void tile4_scalar(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                         int y_dtype, int64_t n) {
    const int64_t k = w->k, groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        const int8_t *aq = a->q + (r0 + r) * k;
        float acc[16] = {0};
        for (int64_t g = 0; g < groups; g++) {
            int32_t dot[16] = {0};
            for (int64_t c = g * 4; c < g * 4 + 4; c++)
                for (int l = 0; l < 16; l++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = chunk4(w, b, c)[l * 4 + i];
                        dot[l] += (byte & 15) * aq[c * 8 + i] + (byte >> 4) * aq[c * 8 + 4 + i];
                    }
            const uint16_t *dh = group_of(w->half, w, b, g), *mh = group_of(w->minimum, w, b, g);
            const float s = a->s[(r0 + r) * groups + g], c8 = a->flip32[(r0 + r) * groups + g] / 16.f;
            for (int l = 0; l < 16; l++) {
                const float d = h2f(dh[l]), z = h2f(mh[l]) + 8.f * d;
                acc[l] += d * (s * (float)dot[l] - c8) + z * a->xsum[(r0 + r) * groups + g];
            }
        }
        for (int l = 0; l < 16 && b * 16 + l < n; l++) store_y(y, y_dtype, (r0 + r) * n + b * 16 + l, acc[l]);
    }
}

/* Weight block b against activation rows r0 .. r0 + rows - 1; outputs past n are not stored. */
static void tile_scalar(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                        int y_dtype, int64_t n) {
    const int64_t k = w->k, groups = k / GROUP;
    const int parts = w->wg == 16 ? 2 : 1, span = 8 / parts; /* weight groups per activation group */
    for (int r = 0; r < rows; r++) {
        const int8_t *aq = a->q + (r0 + r) * k;
        float acc[16] = {0};
        for (int64_t g = 0; g < groups; g++)
            for (int h = 0; h < parts; h++) {
                int32_t dot[16] = {0};
                for (int64_t c = g * 8 + h * span; c < g * 8 + (h + 1) * span; c++)
                    for (int l = 0; l < 16; l++)
                        for (int i = 0; i < 4; i++) dot[l] += chunk(w, b, c)[l * 4 + i] * aq[c * 4 + i];
                const uint16_t *ws = w->wg ? group_of(w->half, w, b, g * parts + h) : NULL;
                for (int l = 0; l < 16; l++)
                    acc[l] += a->s[(r0 + r) * groups + g] * (ws ? h2f(ws[l]) : 1.f) * (float)dot[l];
            }
        for (int l = 0; l < 16 && b * 16 + l < n; l++)
            store_y(y, y_dtype, (r0 + r) * n + b * 16 + l, (w->wg ? 1.f : w->scale[b * 16 + l]) * acc[l]);
    }
}

/* ------------------------------------------------------------------ SIMD paths */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>


#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
/* One block (16 outputs in the 16 int32 lanes) by `rows` activation rows, `wg` as W8's (both
   constants once inlined): per 4-byte chunk, one weight load (flipped to unsigned, shared by the
   rows) and one dpbusd per row against the row's 4 activation bytes broadcast; the int32 sums of a
   group take their scale once (one convert and one fma per 32 * 16 multiply-adds per row). */
static inline __attribute__((always_inline)) void vnni_body(const W8 *w, int64_t b, const Acts8 *a,
                                                            int64_t r0, const int rows, const int wg,
                                                            __m512 out[RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const int parts = wg == 16 ? 2 : 1, span = 8 / parts;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < parts; h++) {
            __m512i dot[RT];
            _Pragma("GCC unroll 8")
            for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
            for (int64_t c = g * 8 + h * span; c < g * 8 + (h + 1) * span; c++) {
                const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(chunk(w, b, c)), flip);
                _Pragma("GCC unroll 8")
                for (int r = 0; r < rows; r++)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], wv,
                                                 _mm512_set1_epi32(load4(a->q + (r0 + r) * k + c * 4)));
            }
            if (wg == 0) {
                _Pragma("GCC unroll 8")
                for (int r = 0; r < rows; r++)
                    out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                             _mm512_set1_ps(a->s[(r0 + r) * groups + g]), out[r]);
                continue;
            }
            const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group_of(w->half, w, b, g * parts + h)));
            _Pragma("GCC unroll 8")
            for (int r = 0; r < rows; r++) {
                const float added = wg == 16 ? a->flip16[(r0 + r) * (k / 16) + 2 * g + h] : a->flip32[(r0 + r) * groups + g];
                const __m512 exact = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(a->s[(r0 + r) * groups + g]),
                                                     _mm512_set1_ps(added)); /* what the flip added, scaled */
                out[r] = _mm512_fmadd_ps(ws, exact, out[r]);
            }
        }
    if (wg) return;
    const __m512 scale = _mm512_loadu_ps(w->scale + b * 16);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++)
        out[r] = _mm512_mul_ps(_mm512_sub_ps(out[r], _mm512_set1_ps(a->off[r0 + r])), scale);
}

/* 4-bit weights: one load of a chunk feeds two dpbusd per row (low nibbles against the row's first
   4 bytes, high nibbles against the next 4); the nibbles are unsigned already, so there is no flip;
   each group's int32 sums take s * d * (dot - 8 * sum a), and z meets the exact sum of the group's
   x (the header says why). */
static inline __attribute__((always_inline)) void vnni_body4(const W8 *w, int64_t b, const Acts8 *a,
                                                             int64_t r0, const int rows, __m512 out[RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const __m512i low = _mm512_set1_epi8(15);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[RT];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int64_t c = g * 4; c < g * 4 + 4; c++) {
            const __m512i v = _mm512_loadu_si512(chunk4(w, b, c));
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < rows; r++) {
                const int8_t *ap = a->q + (r0 + r) * k + c * 8;
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(load4(ap)));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(load4(ap + 4)));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group_of(w->half, w, b, g)));
        const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(8.f), d,
                                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group_of(w->minimum, w, b, g))));
        _Pragma("GCC unroll 8")
        for (int r = 0; r < rows; r++) {
            const __m512 centred = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(a->s[(r0 + r) * groups + g]),
                                                   _mm512_set1_ps(a->flip32[(r0 + r) * groups + g] * 0.0625f));
            out[r] = _mm512_fmadd_ps(d, centred, out[r]);
            out[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(a->xsum[(r0 + r) * groups + g]), out[r]);
        }
    }
}

/* Stores a tile's rows of 16 outputs (fp32, or bf16 rounded to nearest even as store_y). */
static inline __attribute__((always_inline)) void store_vnni(const __m512 out[RT], int64_t b, int64_t r0,
                                                             int rows, void *y, int y_dtype, int64_t n) {
    for (int r = 0; r < rows; r++) {
        if (b * 16 + 16 > n) { /* the last, partial block */
            float v[16];
            _mm512_storeu_ps(v, out[r]);
            for (int l = 0; b * 16 + l < n; l++) store_y(y, y_dtype, (r0 + r) * n + b * 16 + l, v[l]);
        } else if (y_dtype == DT_F32) {
            _mm512_storeu_ps((float *)y + (r0 + r) * n + b * 16, out[r]);
        } else {
            __m512i u = _mm512_castps_si512(out[r]);
            u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (r0 + r) * n + b * 16),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        }
    }
}

/* One tile function per weight format (chosen once, in tile_fn): each holds its body for 1..8 rows
   only, as one function holding all four formats' 32 bodies measured slower (a 4-row tile took
   1.6x a 5-row one). */
#define VNNI_TILE(NAME, BODY)                                                                       \
    static void NAME(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,         \
                     int y_dtype, int64_t n) {                                                      \
        __m512 out[RT];                                                                             \
        switch (rows) {                                                                             \
        case 1: BODY(1); break;                                                                     \
        case 2: BODY(2); break;                                                                     \
        case 3: BODY(3); break;                                                                     \
        case 4: BODY(4); break;                                                                     \
        case 5: BODY(5); break;                                                                     \
        case 6: BODY(6); break;                                                                     \
        case 7: BODY(7); break;                                                                     \
        default: BODY(RT); break;                                                                   \
        }                                                                                           \
        store_vnni(out, b, r0, rows, y, y_dtype, n);                                                \
    }
#define ROW_SCALES(R) vnni_body(w, b, a, r0, R, 0, out)
#define GROUPS_OF_16(R) vnni_body(w, b, a, r0, R, 16, out)
#define GROUPS_OF_32(R) vnni_body(w, b, a, r0, R, 32, out)
#define NIBBLES(R) vnni_body4(w, b, a, r0, R, out)
VNNI_TILE(tile_vnni_rows, ROW_SCALES)
VNNI_TILE(tile_vnni_g16, GROUPS_OF_16)
VNNI_TILE(tile_vnni_g32, GROUPS_OF_32)
VNNI_TILE(tile4_vnni, NIBBLES)
#pragma GCC pop_options
#else
#define HAVE_X86 0
#endif

/* The tile of path `isa` for 8-bit weights with scales per wg inputs (0: per row) or 4-bit weights
(four); NULL when the CPU lacks the path. */
static TileFn tile_fn(int isa, int four, int wg) {
#if HAVE_X86
    __builtin_cpu_init();
    if (isa == ISA_VNNI && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl"))
        return four ? tile4_vnni : wg == 0 ? tile_vnni_rows : wg == 16 ? tile_vnni_g16 : tile_vnni_g32;
    if (isa == ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        return four ? confkv_q8_tile4_avx2 : confkv_q8_tile_avx2;
#endif
    if (isa != ISA_SCALAR) return NULL;
    return four ? tile4_scalar : tile_scalar;
}

/* ------------------------------------------------------------------ entry point */

/* x's rows quantized for the tiles; release with confkv_q8_release. */
int confkv_q8_quantize(const void *x, int x_dtype, int64_t rows, int64_t k, int threads, Quantized *out) {
    const int64_t groups = k / GROUP;
    int8_t *aq = malloc((size_t)(rows * k));
    /* per row: s, flip32 and xsum per group of 32, flip16 and isum (int32, the same size) per 16, off */
    float *s = malloc(sizeof(float) * (size_t)(7 * rows * groups + rows));
    if (aq == NULL || s == NULL) { free(aq); free(s); return -3; }
    float *flip32 = s + rows * groups, *xsum = flip32 + rows * groups, *flip16 = xsum + rows * groups;
    float *off = flip16 + 2 * rows * groups;
    int32_t *isum = (int32_t *)(off + rows);
    confkv_quantize_rows(x, x_dtype, rows, k, aq, s, off, flip16, flip32, xsum, isum, threads);
    const Acts8 a = {.q = aq, .s = s, .off = off, .flip16 = flip16, .flip32 = flip32, .xsum = xsum,
                     .isum = isum, .k = k};
    out->a = a;
    out->q = aq;
    out->f = s;
    return 0;
}

void confkv_q8_release(Quantized *qa) {
    free(qa->q);
    free(qa->f);
}

/* The checks every entry point makes, then the tile function of the path asked for; NULL with *rc
   set to the entry points' error code. */
TileFn confkv_q8_tile(const W8 *w, int isa, int *rc) {
    TileFn tile = tile_fn(isa, w->minimum != NULL, w->wg);
    *rc = tile == NULL ? -1 : w->k % GROUP ? -2 : (w->wg != 0 && w->wg != 16 && w->wg != 32) ? -4 : 0;
    return *rc ? NULL : tile;
}

/* Quantizes x's rows, then runs weight blocks x tiles of RT activation rows; the error codes of the
   entry points. */
static int run(const W8 *w, const void *x, int x_dtype, int64_t rows, int64_t n, void *y, int y_dtype,
               int isa, int threads) {
    int rc;
    TileFn tile = confkv_q8_tile(w, isa, &rc);
    Quantized qa;
    if (tile == NULL || (rc = confkv_q8_quantize(x, x_dtype, rows, w->k, threads, &qa)) != 0) return rc;
    const int64_t blocks = (n + 15) / 16;
    /* Each thread owns a range of weight blocks (each weight read from memory once); inside a
       block the activation rows go in tiles of RT, the block's weights staying in L1. */
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r0 = 0; r0 < rows; r0 += RT)
            tile(w, b, &qa.a, r0, rows - r0 < RT ? (int)(rows - r0) : RT, y, y_dtype, n);
    confkv_q8_release(&qa);
    return 0;
}

/* y [rows, n] (dtype y_dtype) = x [rows, k] (x_dtype) times the weights' transpose, the weights
   wq scaled by wscale per row (wgroup 0: fp32) or per row and group of wgroup (16 or 32) inputs
   (fp16, as group_of lays them out); narrow (optional, group scales only): per block of 16 rows, 1
   where all its codes lie in -16..15 (wgroup 32) or -32..31 (16), which the AVX2 path reads without
   the sign trick (_q8avx2.c).
   Returns 0, or -1 when the CPU lacks the ISA asked for, -2 when k is not a multiple of 32,
   -3 when scratch memory cannot be had, -4 for another wgroup. */
int confkv_q8_matmul(const void *x, int x_dtype, int64_t rows, int64_t k, const int8_t *wq,
                     const void *wscale, int wgroup, const uint8_t *narrow, int64_t n, void *y,
                     int y_dtype, int isa, int threads) {
    const W8 w = {.q = wq, .scale = wgroup ? NULL : wscale, .half = wgroup ? wscale : NULL,
                  .narrow = wgroup ? narrow : NULL, .k = k, .wg = wgroup};
    return run(&w, x, x_dtype, rows, n, y, y_dtype, isa, threads);
}

/* The same for 4-bit weights w = d * q + minimum per row and group of 32, q in 0..15 packed as
   chunk4 says, d and minimum fp16 [n / 16][k / 32][16]. */
int confkv_q4i_matmul(const void *x, int x_dtype, int64_t rows, int64_t k, const uint8_t *wq,
                      const uint16_t *wd, const uint16_t *wmin, int64_t n, void *y, int y_dtype, int isa,
                      int threads) {
    const W8 w = {.q = (const int8_t *)wq, .half = wd, .minimum = wmin, .k = k, .wg = GROUP};
    return run(&w, x, x_dtype, rows, n, y, y_dtype, isa, threads);
}

/* Which paths this CPU can run: bit ISA set for each (the scalar one always). */
int confkv_q8_supported(void) {
    int bits = 1 << ISA_SCALAR;
    for (int isa = ISA_AVX2; isa <= ISA_VNNI; isa++)
        if (tile_fn(isa, 0, 0) != NULL) bits |= 1 << isa;
    return bits;
}
