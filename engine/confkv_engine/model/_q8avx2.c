/* The int8- and int4-weight tiles of the native matmuls' AVX2 + FMA path (_q8matmul.c says what
   the blocks, activations and offsets are; it picks this path where the CPU has no AVX-512 VNNI).
   Four activation rows at a time (16 ymm registers), three for narrow blocks.

   Narrow blocks: 16-row weight blocks whose codes all lie in -16..15 (GGUF's Q5_0, stored as int8
   groups of 32 by the loader) or, with groups of 16, in -32..31 (Q6_K's sub-blocks), flagged at
   packing (q8native.pack). AVX2 has no u8 x s8 dot into
   int32 (VNNI's dpbusd); its maddubs adds two u8 x s8 products into a saturating int16, so
   full-range int8 weights take the sign trick, maddubs(|w|, sign(a, w)) with |w| taken once per chunk
   for every row, and widen every chunk with madd: eight vector operations per row and chunk of
   4 x 16 products, four of them on the two pipes that multiply. A narrow code plus 16 is unsigned
   and at most 31, so maddubs(q + 16, a) needs no sign trick, and eight such products (four chunks: half a group) add up in int16 without overflow
   (8 x 31 x 127 = 31,496 < 32,767): per row and chunk two maddubs and two int16 adds, one widening
   per half group (Q6_K: q + 32, at most 63, two chunks per int16 round). The offset adds 16 (32) x
   (sum of the codes) to each group's dot, taken out in int32 from the activations' ``isum``
   (_qacts.c), so every output equals the sign-trick tile's bit for bit. Gemma 3 270M's Q4_K_M file
   stores q, k, gate and up (and half of v) as Q5_0, half of down as Q6_K: about three quarters of
   its layers' multiply-adds. With four rows, the int16 and int32 sums and the fp32
   outputs did not fit the 16 ymm registers and GCC spilled sums inside the chunk loop (slower). */

#include <stdint.h>
#include <string.h>

#include "_q8tile.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2_ROWS 4 /* activation rows the sign-trick and int4 tiles take at a time (16 registers) */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
/* A tile's outputs, rows row0 .. row0 + count - 1 of block b's 16 columns, into y (past n: dropped). */
static inline void store_rows(__m256 out[2][RT], int count, int64_t b, int64_t row0, void *y, int y_dtype,
                              int64_t n) {
    for (int r = 0; r < count; r++) {
        float v[16];
        _mm256_storeu_ps(v, out[0][r]);
        _mm256_storeu_ps(v + 8, out[1][r]);
        for (int l = 0; l < 16 && b * 16 + l < n; l++) store_y(y, y_dtype, (row0 + r) * n + b * 16 + l, v[l]);
    }
}

/* out[., r] += the group's int32 sums (dot) times its scales: the weights' (fp16 per group h of
   group g's `wg`-input parts; wg 0: none here, the row scale comes at the end) times the activation
   row's (per 32 inputs). */
static inline __attribute__((always_inline)) void add_group(__m256 out[2][RT], __m256i dot[2][RT],
                                                            const int rows, const W8 *w, int64_t b,
                                                            const Acts8 *a, int64_t r0, int64_t g, int h,
                                                            const int wg) {
    const int64_t groups = w->k / GROUP;
    __m256 ws0 = _mm256_set1_ps(1.f), ws1 = ws0;
    if (wg) {
        const uint16_t *ws = group_of(w->half, w, b, g * (wg == 16 ? 2 : 1) + h);
        ws0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)ws));
        ws1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + 8)));
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++) {
        const __m256 s = _mm256_set1_ps(a->s[(r0 + r) * groups + g]);
        out[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r]), wg ? _mm256_mul_ps(ws0, s) : s, out[0][r]);
        out[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1][r]), wg ? _mm256_mul_ps(ws1, s) : s, out[1][r]);
    }
}

#define NARROW_ROWS 3

/* `wg` 32 (Q5_0: codes -16..15, offset 16, four chunks a round) or 16 (Q6_K: codes -32..31, offset
   32, two chunks a round: 4 x 63 x 127 = 32,004 in int16); two rounds per scale group either way. */
static inline __attribute__((always_inline)) void narrow_body(const W8 *w, int64_t b, const Acts8 *a,
                                                              int64_t r0, const int rows, const int wg,
                                                              __m256 out[2][RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const int parts = wg == 16 ? 2 : 1, span = 8 / parts, offset = wg == 16 ? 32 : 16;
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)offset);
    _Pragma("GCC unroll 4")
    for (int r = 0; r < rows; r++) out[0][r] = out[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < parts; h++) {
            __m256i dot[2][RT];
            _Pragma("GCC unroll 4")
            for (int r = 0; r < rows; r++) { /* take the bias's offset x sum(a) out up front */
                const int32_t *sums = a->isum + (r0 + r) * 2 * groups + 2 * g; /* per 16 codes */
                dot[0][r] = dot[1][r] = _mm256_set1_epi32(-offset * (wg == 16 ? sums[h] : sums[0] + sums[1]));
            }
            for (int round = 0; round < 2; round++) {
                __m256i d16[2][NARROW_ROWS];
                _Pragma("GCC unroll 4")
                for (int r = 0; r < rows; r++) d16[0][r] = d16[1][r] = _mm256_setzero_si256();
                const int64_t c0 = g * 8 + h * span + round * span / 2;
                /* Unrolled, with the sums pinned below: without the pin GCC summed the products
                   as a tree and spilled them; without the unroll it copied every sum back into
                   place each chunk. Both at once: 0.82-0.90x the time on Gemma 3's Q5_0 shapes at
                   512-2,048 rows under the AVX2 emulation (docs/performance.md). */
                _Pragma("GCC unroll 4")
                for (int64_t c = c0; c < c0 + span / 2; c++) {
                    const __m256i w0 = _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)chunk(w, b, c)), bias);
                    const __m256i w1 = _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(chunk(w, b, c) + 32)),
                                                       bias);
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < rows; r++) {
                        const __m256i av = _mm256_set1_epi32(load4(a->q + (r0 + r) * k + c * 4));
                        d16[0][r] = _mm256_add_epi16(d16[0][r], _mm256_maddubs_epi16(w0, av));
                        d16[1][r] = _mm256_add_epi16(d16[1][r], _mm256_maddubs_epi16(w1, av));
                        __asm__("" : "+x"(d16[0][r]), "+x"(d16[1][r])); /* the pin: emits nothing */
                    }
                }
                _Pragma("GCC unroll 4")
                for (int r = 0; r < rows; r++) {
                    dot[0][r] = _mm256_add_epi32(dot[0][r], _mm256_madd_epi16(d16[0][r], ones));
                    dot[1][r] = _mm256_add_epi32(dot[1][r], _mm256_madd_epi16(d16[1][r], ones));
                }
            }
            add_group(out, dot, rows, w, b, a, r0, g, h, wg); /* the sign-trick tile's operations */
        }
}

#define NARROW_CASES(WG)                                                          \
    switch (count) {                                                              \
    case 1: narrow_body(w, b, a, r0 + r1, 1, WG, out); break;                     \
    case 2: narrow_body(w, b, a, r0 + r1, 2, WG, out); break;                     \
    default: narrow_body(w, b, a, r0 + r1, NARROW_ROWS, WG, out); break;          \
    }

static void tile_narrow(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y, int y_dtype,
                        int64_t n) {
    __m256 out[2][RT];
    for (int r1 = 0, count; r1 < rows; r1 += count) {
        const int left = rows - r1; /* 4 left: 2 + 2, not 3 + 1 (a one-row pass re-reads the block) */
        count = left == 4 ? 2 : left < NARROW_ROWS ? left : NARROW_ROWS;
        if (w->wg == 16) NARROW_CASES(16) else NARROW_CASES(32)
        store_rows(out, count, b, r0 + r1, y, y_dtype, n);
    }
}

/* One block (16 outputs, two registers of 8) by `rows` activation rows, `wg` as W8's (both
   constants once inlined). Sign trick: maddubs(|w|, sign(a, w)) pairs stay within int16 (2 x 128 x 127:
   a -128 code's |w| reads 128 unsigned, and the activations' codes are within -127..127), so there is
   no unsigned flip to take out. |w| is the weights' (one per chunk, shared by the rows), where the
   |a| of the tile before was taken per row and chunk: 0.96-0.97x the time on a 16,384 x 640 Q8_0
   slice at 32-256 rows under the AVX2 emulation (docs/performance.md, "Kernels per CPU"). */
static inline __attribute__((always_inline)) void avx2_body(const W8 *w, int64_t b, const Acts8 *a,
                                                            int64_t r0, const int rows, const int wg,
                                                            __m256 out[2][RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const int parts = wg == 16 ? 2 : 1, span = 8 / parts;
    const __m256i ones = _mm256_set1_epi16(1);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++) out[0][r] = out[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < parts; h++) {
            __m256i dot[2][RT];
            _Pragma("GCC unroll 8")
            for (int r = 0; r < rows; r++) dot[0][r] = dot[1][r] = _mm256_setzero_si256();
            for (int64_t c = g * 8 + h * span; c < g * 8 + (h + 1) * span; c++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)chunk(w, b, c));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(chunk(w, b, c) + 32));
                const __m256i w0abs = _mm256_abs_epi8(w0), w1abs = _mm256_abs_epi8(w1);
                _Pragma("GCC unroll 8")
                for (int r = 0; r < rows; r++) {
                    const __m256i av = _mm256_set1_epi32(load4(a->q + (r0 + r) * k + c * 4));
                    const __m256i p0 = _mm256_maddubs_epi16(w0abs, _mm256_sign_epi8(av, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(w1abs, _mm256_sign_epi8(av, w1));
                    dot[0][r] = _mm256_add_epi32(dot[0][r], _mm256_madd_epi16(p0, ones));
                    dot[1][r] = _mm256_add_epi32(dot[1][r], _mm256_madd_epi16(p1, ones));
                }
            }
            add_group(out, dot, rows, w, b, a, r0, g, h, wg);
        }
}

#define AVX2_ROWS_CASES(WG)                                                       \
    switch (count) {                                                              \
    case 1: avx2_body(w, b, a, r0 + r1, 1, WG, out); break;                       \
    case 2: avx2_body(w, b, a, r0 + r1, 2, WG, out); break;                       \
    case 3: avx2_body(w, b, a, r0 + r1, 3, WG, out); break;                       \
    default: avx2_body(w, b, a, r0 + r1, AVX2_ROWS, WG, out); break;              \
    }

void confkv_q8_tile_avx2(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                         int y_dtype, int64_t n) {
    if (w->narrow != NULL && w->narrow[b]) { /* codes in -16..15 / -32..31: no sign trick (above) */
        tile_narrow(w, b, a, r0, rows, y, y_dtype, n);
        return;
    }
    __m256 out[2][RT];
    for (int r1 = 0; r1 < rows; r1 += AVX2_ROWS) { /* 16 ymm registers: 4 rows at a time */
        const int count = rows - r1 < AVX2_ROWS ? rows - r1 : AVX2_ROWS;
        if (w->wg == 0) AVX2_ROWS_CASES(0) else if (w->wg == 16) AVX2_ROWS_CASES(16) else AVX2_ROWS_CASES(32)
        for (int r = 0; r < count && w->wg == 0; r++) {
            out[0][r] = _mm256_mul_ps(out[0][r], _mm256_loadu_ps(w->scale + b * 16));
            out[1][r] = _mm256_mul_ps(out[1][r], _mm256_loadu_ps(w->scale + b * 16 + 8));
        }
        store_rows(out, count, b, r0 + r1, y, y_dtype, n);
    }
}
/* 4-bit weights: the nibbles are unsigned (0..15), so maddubs(w, a) needs no sign trick (a pair is at
   most 2 * 15 * 127; the low and high nibbles' pairs are added in int16, at most 7,620). A group's
   four chunks add up in int16 as well (at most 30,480 < 32,767: exact), so each row widens to int32
   once per group, not once per chunk (the widening madd and its add go from the inner loop; 0.91 to
   1.01x the time on SmolLM2's shapes at 1-512 rows, outputs bit-identical). */
static inline __attribute__((always_inline)) void avx2_body4(const W8 *w, int64_t b, const Acts8 *a,
                                                             int64_t r0, const int rows, __m256 out[2][RT]) {
    const int64_t k = w->k, groups = k / GROUP;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < rows; r++) out[0][r] = out[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[2][RT]; /* int16 pair sums of the group's 32 inputs */
        _Pragma("GCC unroll 8")
        for (int r = 0; r < rows; r++) dot[0][r] = dot[1][r] = _mm256_setzero_si256();
        for (int64_t c = g * 4; c < g * 4 + 4; c++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)chunk4(w, b, c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(chunk4(w, b, c) + 32));
            const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < rows; r++) {
                const int8_t *ap = a->q + (r0 + r) * k + c * 8;
                const __m256i alo = _mm256_set1_epi32(load4(ap)), ahi = _mm256_set1_epi32(load4(ap + 4));
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, alo), _mm256_maddubs_epi16(hi0, ahi));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, alo), _mm256_maddubs_epi16(hi1, ahi));
                dot[0][r] = _mm256_add_epi16(dot[0][r], p0);
                dot[1][r] = _mm256_add_epi16(dot[1][r], p1);
            }
        }
        _Pragma("GCC unroll 8")
        for (int r = 0; r < rows; r++) {
            dot[0][r] = _mm256_madd_epi16(dot[0][r], ones);
            dot[1][r] = _mm256_madd_epi16(dot[1][r], ones);
        }
        const uint16_t *dh = group_of(w->half, w, b, g), *mh = group_of(w->minimum, w, b, g);
        const __m256 eight = _mm256_set1_ps(8.f);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 8)));
        const __m256 z0 = _mm256_fmadd_ps(eight, d0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh)));
        const __m256 z1 = _mm256_fmadd_ps(eight, d1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + 8))));
        _Pragma("GCC unroll 8")
        for (int r = 0; r < rows; r++) {
            const __m256 s = _mm256_set1_ps(a->s[(r0 + r) * groups + g]);
            const __m256 c8 = _mm256_set1_ps(a->flip32[(r0 + r) * groups + g] * 0.0625f);
            const __m256 xs = _mm256_set1_ps(a->xsum[(r0 + r) * groups + g]);
            const __m256 i0 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot[0][r]), s, c8);
            const __m256 i1 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot[1][r]), s, c8);
            out[0][r] = _mm256_fmadd_ps(z0, xs, _mm256_fmadd_ps(d0, i0, out[0][r]));
            out[1][r] = _mm256_fmadd_ps(z1, xs, _mm256_fmadd_ps(d1, i1, out[1][r]));
        }
    }
}

void confkv_q8_tile4_avx2(const W8 *w, int64_t b, const Acts8 *a, int64_t r0, int rows, void *y,
                          int y_dtype, int64_t n) {
    __m256 out[2][RT];
    for (int r1 = 0; r1 < rows; r1 += AVX2_ROWS) {
        const int count = rows - r1 < AVX2_ROWS ? rows - r1 : AVX2_ROWS;
        switch (count) {
        case 1: avx2_body4(w, b, a, r0 + r1, 1, out); break;
        case 2: avx2_body4(w, b, a, r0 + r1, 2, out); break;
        case 3: avx2_body4(w, b, a, r0 + r1, 3, out); break;
        default: avx2_body4(w, b, a, r0 + r1, AVX2_ROWS, out); break;
        }
        store_rows(out, count, b, r0 + r1, y, y_dtype, n);
    }
}

#pragma GCC pop_options
#endif
