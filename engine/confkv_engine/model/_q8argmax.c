/* The native matmul's fused greedy argmax (built into the _native library; q8native.bound_argmax):
   each activation row's index of its largest output, without writing the [rows, n] outputs.

   Why: a greedy step only needs the argmax of the LM head's logits, and for a large vocabulary
   writing them and scanning them again is a large share of the head: Gemma 3's 262,144 x 640 Q8_0
   head, 2 threads, AVX2 EPYC, matmul then torch's max 13.6 / 87.6 ms at 1 / 32 rows against 8.8 /
   63.6 ms fused. Here each thread runs the matmul's own tiles (_q8matmul.c) over chunks of SPAN
   weight blocks into a small scratch and scans it while it is in cache; the answer is the index
   the unfused call's outputs give under torch.max: the first on ties, a NaN counting as the
   largest, bf16 outputs rounded as the matmul rounds them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_q8tile.h"

/* The first index of v[0..m)'s maximum, a NaN counting as the maximum (torch.max's semantics);
   its value in *top. */
static int64_t first_max(const float *v, int64_t m, float *top) {
    int64_t at = 0;
    for (int64_t i = 1; i < m; i++)
        if (v[at] == v[at] && (v[i] > v[at] || v[i] != v[i])) at = i;
    *top = v[at];
    return at;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2")
/* The first index of v[0..m)'s maximum (m >= 8) and its value: the maximum 8 lanes at a time, then
   its first position; a row holding a NaN goes to the scalar scan (first_max), which counts it
   as the maximum. */
static int64_t scan_row_avx2(const float *v, int64_t m, float *top) {
    __m256 mx = _mm256_loadu_ps(v), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
    int64_t i = 8;
    for (; i + 8 <= m; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, x);
    }
    float lanes[8], t;
    _mm256_storeu_ps(lanes, mx);
    t = lanes[0];
    for (int l = 1; l < 8; l++) t = lanes[l] > t ? lanes[l] : t;
    for (int64_t j = i; j < m; j++) {
        if (v[j] != v[j]) return first_max(v, m, top);
        t = v[j] > t ? v[j] : t;
    }
    if (_mm256_movemask_ps(nan)) return first_max(v, m, top);
    *top = t;
    const __m256 want = _mm256_set1_ps(t);
    for (i = 0; i + 8 <= m; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    while (i < m && v[i] != t) i++;
    return i;
}

#pragma GCC pop_options
#else
#define HAVE_X86 0
#endif

#define SPAN 64 /* weight blocks (1,024 outputs) per argmax chunk: a tile's logits stay in cache */

/* Weights w from block b0 on, as a W8 of their own (a chunk's tiles index blocks from 0). */
static W8 from_block(const W8 *w, int64_t b0) {
    W8 v = *w;
    if (w->minimum != NULL) {
        v.q = (const int8_t *)chunk4(w, b0, 0);
        v.minimum = group_of(w->minimum, w, b0, 0);
    } else {
        v.q = chunk(w, b0, 0);
    }
    if (w->wg) v.half = group_of(w->half, w, b0, 0);
    else v.scale = w->scale + b0 * 16;
    return v;
}

/* bf16 rounding of a stored fp32 value, as store_y does (the unfused call's logits in bf16). */
static inline float as_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

static int64_t scan_row(const float *v, int64_t m, float *top) {
#if HAVE_X86
    if (m >= 8 && __builtin_cpu_supports("avx2")) return scan_row_avx2(v, m, top);
#endif
    return first_max(v, m, top);
}

/* idx[r] = the first index of row r's largest output (the matmul's, rounded to bf16 when x is
   bf16, as the unfused call returns them), val[r] its value, without writing the [rows, n] outputs:
   each thread's chunks of SPAN blocks go through the tiles into a scratch of rows x SPAN x 16
   floats, scanned while it is in cache. Chunks merge in order, so ties keep the first index. */
static int run_argmax(const W8 *w, const void *x, int x_dtype, int64_t rows, int64_t n, int64_t *idx,
                      float *val, int isa, int threads) {
    int rc;
    TileFn tile = confkv_q8_tile(w, isa, &rc);
    Quantized qa;
    if (tile == NULL || (rc = confkv_q8_quantize(x, x_dtype, rows, w->k, threads, &qa)) != 0) return rc;
    const int64_t blocks = (n + 15) / 16, chunks = (blocks + SPAN - 1) / SPAN;
    float *best = malloc(sizeof(float) * (size_t)(chunks * rows));
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(chunks * rows));
    int failed = best == NULL || where == NULL;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1) if (!failed)
    {
        float *y = failed ? NULL : malloc(sizeof(float) * (size_t)(rows * SPAN * 16));
        if (y == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (y == NULL) continue;
            const int64_t b0 = c * SPAN, nb = blocks - b0 < SPAN ? blocks - b0 : SPAN;
            const int64_t m = (n < (b0 + nb) * 16 ? n : (b0 + nb) * 16) - b0 * 16;
            const W8 part = from_block(w, b0);
            for (int64_t b = 0; b < nb; b++)
                for (int64_t r0 = 0; r0 < rows; r0 += RT)
                    tile(&part, b, &qa.a, r0, rows - r0 < RT ? (int)(rows - r0) : RT, y, DT_F32, m);
            for (int64_t r = 0; r < rows; r++) {
                float *row = y + r * m;
                if (x_dtype == DT_BF16)
                    for (int64_t i = 0; i < m; i++) row[i] = as_bf16(row[i]);
                where[c * rows + r] = b0 * 16 + scan_row(row, m, &best[c * rows + r]);
            }
        }
        free(y);
    }
    if (!failed)
        for (int64_t r = 0; r < rows; r++) {
            float top = best[r];
            int64_t at = where[r];
            for (int64_t c = 1; c < chunks; c++) {
                const float v = best[c * rows + r];
                if (top == top && (v > top || v != v)) {
                    top = v;
                    at = where[c * rows + r];
                }
            }
            idx[r] = at;
            val[r] = top;
        }
    free(best);
    free(where);
    confkv_q8_release(&qa);
    return failed ? -3 : 0;
}

/* idx [rows] (int64) = each row's argmax over confkv_q8_matmul's outputs (y_dtype = x_dtype), the
   first index on ties, a NaN counting as the largest (torch.max's semantics); val [rows] the value
   there. Same arguments and error codes as confkv_q8_matmul. */
int confkv_q8_argmax(const void *x, int x_dtype, int64_t rows, int64_t k, const int8_t *wq,
                     const void *wscale, int wgroup, const uint8_t *narrow, int64_t n, int64_t *idx,
                     float *val, int isa, int threads) {
    const W8 w = {.q = wq, .scale = wgroup ? NULL : wscale, .half = wgroup ? wscale : NULL,
                  .narrow = wgroup ? narrow : NULL, .k = k, .wg = wgroup};
    return run_argmax(&w, x, x_dtype, rows, n, idx, val, isa, threads);
}

/* The same over confkv_q4i_matmul's outputs. */
int confkv_q4i_argmax(const void *x, int x_dtype, int64_t rows, int64_t k, const uint8_t *wq,
                      const uint16_t *wd, const uint16_t *wmin, int64_t n, int64_t *idx, float *val,
                      int isa, int threads) {
    const W8 w = {.q = (const int8_t *)wq, .half = wd, .minimum = wmin, .k = k, .wg = GROUP};
    return run_argmax(&w, x, x_dtype, rows, n, idx, val, isa, threads);
}
