/* The CPU decode attention's SIMD paths (_decode.c holds the plain-C one and picks among them at run
   time): AVX-512 registers where the CPU has them, else AVX2 + FMA; each compiled for its own target,
   so the library still loads on any x86-64 CPU. */

#include "_decode.h"

#ifdef HAVE_SIMD_PATHS
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX2F __attribute__((target("avx2,fma")))

AVX2F static void softmax_rows_avx2(float *scores, int64_t rows, int64_t len, float *stats);

AVX512 static inline __m512 load16(const Pool *p, int64_t at) {
    if (p->dtype == DT_F32) return _mm512_loadu_ps((const float *)p->pool + at);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p->pool + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* attend_group with AVX-512 registers for d = 16 * CHUNKS, CHUNKS a constant at each call site
   (confkv_attend_group_avx512 switches on it), so a query head's CHUNKS vectors and its CHUNKS output
   accumulators stay in registers. One query head of the group at a time: the group's K and V
   rows are read again per head, from L1 / L2 (a part is at most a few thousand slots). The scores
   and the values are summed in the order the earlier array-based version took; the softmax is the
   AVX2 path's, 8 lanes at a time with the shared exp (../../_expf.h, within 2 ulp of libm's expf),
   where libm's scalar expf per slot was (docs/performance.md: `full`'s decode step at 32 x 2,048,
   327.7 and 348.1 ms against 373.1 ms for the scalar exps, runs in a row). An earlier
   vectorised exp, Cephes' polynomial, moved the decode logprobs about 1e-5 away from PyTorch's
   flash kernel, past what the static-decode test allows; this one stays within it. */
AVX512 static inline __attribute__((always_inline)) void attend_chunks(
    const Pool *p, const float *q, int64_t group, int64_t lo, int64_t hi, int64_t head, float scale,
    float *scores, float *out, float *stats, const int64_t CHUNKS) {
    const int64_t d = p->d, len = hi - lo, bs = p->bs;
    for (int64_t g = 0; g < group; g++) {
        __m512 qv[16];
        for (int64_t c = 0; c < CHUNKS; c++) qv[c] = _mm512_loadu_ps(q + g * d + c * 16);
        float *sg = scores + g * len;
        for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
            int64_t first = b0 > lo ? b0 : lo, last = b0 + bs < hi ? b0 + bs : hi;
            int64_t base = p->k_table[b0 / bs] * bs;
            for (int64_t n = first; n < last; n++) {
                int64_t at = ((base + n - b0) * p->hkv + head) * d;
                __m512 sum = _mm512_mul_ps(qv[0], load16(p, at));
                for (int64_t c = 1; c < CHUNKS; c++) sum = _mm512_fmadd_ps(qv[c], load16(p, at + c * 16), sum);
                sg[n - lo] = _mm512_reduce_add_ps(sum) * scale;
            }
        }
    }
    softmax_rows_avx2(scores, group, len, stats);
    for (int64_t g = 0; g < group; g++) {
        __m512 acc[16];
        for (int64_t c = 0; c < CHUNKS; c++) acc[c] = _mm512_setzero_ps();
        const float *sg = scores + g * len;
        for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
            int64_t first = b0 > lo ? b0 : lo, last = b0 + bs < hi ? b0 + bs : hi;
            int64_t base = p->v_table[b0 / bs] * bs;
            for (int64_t n = first; n < last; n++) {
                int64_t at = ((base + n - b0) * p->hkv + head) * d;
                __m512 w = _mm512_set1_ps(sg[n - lo]);
                for (int64_t c = 0; c < CHUNKS; c++) acc[c] = _mm512_fmadd_ps(w, load16(p, at + c * 16), acc[c]);
            }
        }
        for (int64_t c = 0; c < CHUNKS; c++) _mm512_storeu_ps(out + g * d + c * 16, acc[c]);
    }
}

/* For d a multiple of 16 up to 256. */
AVX512 void confkv_attend_group_avx512(const Pool *p, const float *q, int64_t group, int64_t lo,
                                       int64_t hi, int64_t head, float scale, float *scores, float *out,
                                       float *stats) {
    switch (p->d / 16) {
    case 4: attend_chunks(p, q, group, lo, hi, head, scale, scores, out, stats, 4); break;
    case 8: attend_chunks(p, q, group, lo, hi, head, scale, scores, out, stats, 8); break;
    case 16: attend_chunks(p, q, group, lo, hi, head, scale, scores, out, stats, 16); break;
    default: attend_chunks(p, q, group, lo, hi, head, scale, scores, out, stats, p->d / 16); break;
    }
}

/* The AVX2 + FMA form of attend_group for d a multiple of 16 (the target_clones form measured
   about 2 multiply-adds per cycle here: its horizontal sums went through the stack once per slot
   and head, and its output accumulators through memory once per slot). Up to four query heads of
   the group at a time: scores with two accumulators per head over a K row read once for them;
   values in tiles of 16 dims whose 4 x 2 accumulators stay in registers while the tile walks
   every slot. Sums are taken in another order than attend_group's, so results differ from it by
   fp32 rounding (the tests' tolerance for the native kernel holds either way). */

AVX2F static inline __m256 load8(const Pool *p, int64_t at) {
    if (p->dtype == DT_F32) return _mm256_loadu_ps((const float *)p->pool + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p->pool + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2F static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Scores of query heads g0 .. g0 + GN - 1 (GN <= 4, a constant once inlined) over [lo, hi). */
AVX2F static inline __attribute__((always_inline)) void scores_avx2(const Pool *p, const float *q, int64_t g0,
                                                                    const int GN, int64_t lo, int64_t hi,
                                                                    int64_t head, float scale, float *scores) {
    const int64_t d = p->d, len = hi - lo, bs = p->bs;
    for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
        const int64_t first = b0 > lo ? b0 : lo, last = b0 + bs < hi ? b0 + bs : hi;
        const int64_t base = p->k_table[b0 / bs] * bs;
        for (int64_t n = first; n < last; n++) {
            const int64_t at = ((base + n - b0) * p->hkv + head) * d;
            __m256 acc[4][2];
            for (int j = 0; j < GN; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                const __m256 k0 = load8(p, at + c), k1 = load8(p, at + c + 8);
                for (int j = 0; j < GN; j++) {
                    const float *qj = q + (g0 + j) * d + c;
                    acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qj), k0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8), k1, acc[j][1]);
                }
            }
            for (int j = 0; j < GN; j++) scores[(g0 + j) * len + n - lo] = hsum8(_mm256_add_ps(acc[j][0], acc[j][1])) * scale;
        }
    }
}

/* out rows g0 .. g0 + GN - 1 = sum_n scores[g, n] v_n, 16 dims at a time. */
AVX2F static inline __attribute__((always_inline)) void values_avx2(const Pool *p, int64_t g0, const int GN,
                                                                    int64_t lo, int64_t hi, int64_t head,
                                                                    const float *scores, float *out) {
    const int64_t d = p->d, len = hi - lo, bs = p->bs;
    for (int64_t c = 0; c < d; c += 16) {
        __m256 acc[4][2];
        for (int j = 0; j < GN; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
            const int64_t first = b0 > lo ? b0 : lo, last = b0 + bs < hi ? b0 + bs : hi;
            const int64_t base = p->v_table[b0 / bs] * bs;
            for (int64_t n = first; n < last; n++) {
                const int64_t at = ((base + n - b0) * p->hkv + head) * d + c;
                const __m256 v0 = load8(p, at), v1 = load8(p, at + 8);
                for (int j = 0; j < GN; j++) {
                    const __m256 w = _mm256_broadcast_ss(scores + (g0 + j) * len + n - lo);
                    acc[j][0] = _mm256_fmadd_ps(w, v0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(w, v1, acc[j][1]);
                }
            }
        }
        for (int j = 0; j < GN; j++) {
            _mm256_storeu_ps(out + (g0 + j) * d + c, acc[j][0]);
            _mm256_storeu_ps(out + (g0 + j) * d + c + 8, acc[j][1]);
        }
    }
}

#define BY_HEADS(CALL)                                                                            \
    for (int64_t g0 = 0; g0 < group; g0 += 4) {                                                   \
        switch (group - g0 < 4 ? group - g0 : 4) {                                                \
        case 1: CALL(1); break;                                                                   \
        case 2: CALL(2); break;                                                                   \
        case 3: CALL(3); break;                                                                   \
        default: CALL(4); break;                                                                  \
        }                                                                                         \
    }
#define SCORES(GN) scores_avx2(p, q, g0, GN, lo, hi, head, scale, scores)
#define VALUES(GN) values_avx2(p, g0, GN, lo, hi, head, scores, out)

/* softmax_rows with the maximum, the exps and their sum 8 lanes at a time (libm's scalar expf was
   about 40 % of a one-row call at SmolLM2's 9 x 64 heads and 300 slots). */
AVX2F static void softmax_rows_avx2(float *scores, int64_t rows, int64_t len, float *stats) {
    for (int64_t g = 0; g < rows; g++) {
        float *s = scores + g * len, best = -INFINITY, total = 0.0f;
        int64_t n = 0;
        if (len >= 8) {
            __m256 m = _mm256_loadu_ps(s);
            for (n = 8; n + 8 <= len; n += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + n));
            float lanes[8];
            _mm256_storeu_ps(lanes, m);
            for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
        }
        for (int64_t i = n; i < len; i++) best = s[i] > best ? s[i] : best;
        const __m256 top = _mm256_set1_ps(best);
        __m256 sum = _mm256_setzero_ps();
        for (n = 0; n + 8 <= len; n += 8) {
            const __m256 e = (__m256)confkv_exp8((confkv_v8f)_mm256_sub_ps(_mm256_loadu_ps(s + n), top));
            _mm256_storeu_ps(s + n, e);
            sum = _mm256_add_ps(sum, e);
        }
        total = hsum8(sum);
        for (; n < len; n++) {
            s[n] = expf(s[n] - best);
            total += s[n];
        }
        stats[2 * g] = best;
        stats[2 * g + 1] = total;
    }
}

AVX2F void confkv_attend_group_avx2(const Pool *p, const float *q, int64_t group, int64_t lo, int64_t hi,
                                    int64_t head, float scale, float *scores, float *out, float *stats) {
    BY_HEADS(SCORES)
    softmax_rows_avx2(scores, group, hi - lo, stats);
    BY_HEADS(VALUES)
}
#endif
