/* Decode attention on CPU straight from the paged pool: one query row per sequence.

   Why: the gathering path copies every cached K and V block of a decode row into a fresh tensor
   once per layer (an index_select of the whole context) and then runs PyTorch's flash kernel on the
   copy with an additive mask; at one row the copy, the mask and the op dispatch cost several times
   the arithmetic. This kernel reads each slot where the pool holds it, through the block table.

   Inputs: q [B, Hq, D] (fp32 or bf16, contiguous), one pool layer [NB, bs, Hkv, D] in the same
   dtype, K and V block tables [B, width] (int64, padded), the visible slots per row (lens [B]: the
   row's own new slot included) and a sliding window (0: none; else the last `window` slots).
   Output [B, Hq, D] in q's dtype. Query head h reads KV head h / (Hq / Hkv), as grouped-query
   attention does.

   Maths, per (row, query head): s_n = scale * q . k_n in fp32 for the visible slots, the exact
   softmax (max first, then exp and sum) and out = sum_n p_n v_n / sum_n p_n, accumulated in fp32,
   rounded once to bf16 (to nearest even, as PyTorch rounds) when the tensors are bf16. PyTorch's
   flash kernel computes the same in fp32 in another order (online rescaling per block), so the two
   agree to fp32 rounding before the output's own rounding.

   Threads: OpenMP over (row, KV head) pairs (a KV head's query heads share each K and V read), as
   many as the caller passes (PyTorch's count, called from the engine thread: that thread's OpenMP
   team); with fewer pairs than twice the threads (one row: 3 pairs here) each pair's slots are cut
   in parts combined exactly through their maxima and exp sums. The inner loops run on AVX-512
   registers where the CPU has them (head dim a multiple of 16), else on AVX2 + FMA registers (the
   same head dims, with a vectorised exp; 1.7-2.8x the plain-C clone on an AVX2-only EPYC, 2
   threads: 59 -> 33 us for one row of 300 fp32 slots at Gemma 3's 4 x 256 heads, 1.02 -> 0.60 ms
   for 32 rows, 1.65 -> 0.87 ms for 8 rows of 2,048 at SmolLM2's 9 x 64, 246 -> 89 us for 4 bf16
   rows of 500; static-decode logprobs stay within the test's 1e-5), else in plain C compiled for
   AVX-512, AVX2 and x86-64
   (`target_clones`: the loader picks the best the CPU runs). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "../../_expf.h"

enum { DT_F32 = 0, DT_BF16 = 1 };
#define MAX_D 256
#define MAX_GROUP 16

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    const void *pool;
    const int64_t *k_table, *v_table;
    int64_t bs, hkv, d;
    int dtype;
} Pool;

/* Each of `rows` rows of `scores` ([rows, len]) replaced by exp(score - its max); stats[2 g] gets
   row g's max, stats[2 g + 1] the sum of its exps (the caller normalises, once all parts are in). */
static void softmax_rows(float *scores, int64_t rows, int64_t len, float *stats) {
    for (int64_t g = 0; g < rows; g++) {
        float *s = scores + g * len, best = -INFINITY, total = 0.0f;
        for (int64_t n = 0; n < len; n++) best = s[n] > best ? s[n] : best;
        for (int64_t n = 0; n < len; n++) {
            s[n] = expf(s[n] - best);
            total += s[n];
        }
        stats[2 * g] = best;
        stats[2 * g + 1] = total;
    }
}

/* Slots [lo, hi) of (table, head) in order, block by block (no division per slot): calls
   BODY(n, row) with `row` the slot's d values as fp32 (converted into `buf` from bf16). */
#define FOR_SLOTS(p, table, head, lo, hi, buf, ...)                                               \
    for (int64_t b0 = (lo) / (p)->bs * (p)->bs; b0 < (hi); b0 += (p)->bs) {                       \
        int64_t first = b0 > (lo) ? b0 : (lo), last = b0 + (p)->bs < (hi) ? b0 + (p)->bs : (hi);   \
        int64_t base = (table)[b0 / (p)->bs] * (p)->bs;                                             \
        for (int64_t n = first; n < last; n++) {                                                    \
            int64_t at = ((base + n - b0) * (p)->hkv + (head)) * (p)->d;                           \
            const float *row = (const float *)(p)->pool + at;                                       \
            if ((p)->dtype == DT_BF16) {                                                            \
                const uint16_t *src = (const uint16_t *)(p)->pool + at;                             \
                _Pragma("omp simd") for (int64_t i = 0; i < (p)->d; i++) buf[i] = bf16_to_f32(src[i]); \
                row = buf;                                                                          \
            }                                                                                       \
            __VA_ARGS__                                                                             \
        }                                                                                           \
    }

/* One KV head's `group` query heads (q: [group, d] fp32) over slots [lo, hi): out [group, d] fp32
   unnormalised (sum of exp(s - max) v) and stats [group, 2] (max, sum of exps); scores: room for
   group * (hi - lo) floats. */
CLONES
static void attend_group(const Pool *p, const float *q, int64_t group, int64_t lo, int64_t hi,
                         int64_t head, float scale, float *scores, float *out,
                         float *stats) {
    const int64_t d = p->d, len = hi - lo;
    float buf[MAX_D];
    FOR_SLOTS(p, p->k_table, head, lo, hi, buf, {
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * d;
            float acc = 0.0f;
            _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i < d; i++) acc += qg[i] * row[i];
            scores[g * len + (n - lo)] = acc * scale;
        }
    })
    softmax_rows(scores, group, len, stats);
    for (int64_t i = 0; i < group * d; i++) out[i] = 0.0f;
    FOR_SLOTS(p, p->v_table, head, lo, hi, buf, {
        for (int64_t g = 0; g < group; g++) {
            float w = scores[g * len + (n - lo)], *o = out + g * d;
            _Pragma("omp simd") for (int64_t i = 0; i < d; i++) o[i] += w * row[i];
        }
    })
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512 static inline __m512 load16(const Pool *p, int64_t at) {
    if (p->dtype == DT_F32) return _mm512_loadu_ps((const float *)p->pool + at);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p->pool + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* attend_group with AVX-512 registers for d = 16 * CHUNKS, CHUNKS a constant at each call site
   (attend_group_avx512 switches on it), so a query head's CHUNKS vectors and its CHUNKS output
   accumulators stay in registers. One query head of the group at a time: the group's K and V
   rows are read again per head, from L1 / L2 (a part is at most a few thousand slots). Every sum is
   taken in the order the earlier array-based version took it, so the results are the same bits.
   (A vectorised exp in the softmax, Cephes' polynomial, made it faster still but moved the decode
   logprobs about 1e-5 away from PyTorch's flash kernel, past what the static-decode test allows.) */
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
    softmax_rows(scores, group, len, stats);
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
AVX512 static void attend_group_avx512(const Pool *p, const float *q, int64_t group, int64_t lo,
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
#define AVX2F __attribute__((target("avx2,fma")))

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

AVX2F static void attend_group_avx2(const Pool *p, const float *q, int64_t group, int64_t lo, int64_t hi,
                                    int64_t head, float scale, float *scores, float *out, float *stats) {
    BY_HEADS(SCORES)
    softmax_rows_avx2(scores, group, hi - lo, stats);
    BY_HEADS(VALUES)
}
#endif

/* Whether this CPU runs the AVX2 path (where it lacks the AVX-512 one). */
static int use_avx2(int64_t d) {
#ifdef HAVE_AVX512_PATH
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cpu && d % 16 == 0;
#else
    (void)d;
    return 0;
#endif
}

/* Whether this CPU runs the AVX-512 path. */
static int use_avx512(int64_t d, int64_t group) {
#ifdef HAVE_AVX512_PATH
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl");
    }
    return cpu && d % 16 == 0 && d <= 256;
#else
    (void)d, (void)group;
    return 0;
#endif
}

/* Returns 0, or -1 (a dtype it does not read), -2 (head dim above MAX_D, heads not grouped or more than MAX_GROUP per KV head),
   -3 (out of memory for the scores). */
/* Part `part` of `parts` of [lo, hi), in whole blocks where it can. */
static void part_range(int64_t lo, int64_t hi, int64_t part, int64_t parts, int64_t bs, int64_t *a,
                       int64_t *b) {
    int64_t step = ((hi - lo + parts - 1) / parts + bs - 1) / bs * bs;
    *a = lo + part * step < hi ? lo + part * step : hi;
    *b = *a + step < hi ? *a + step : hi;
}

/* The version of confkv_decode_attention's arguments; native_decode checks it, so a library built from
   an older source is not called with arguments it would read differently. 2: the lse output. */
int confkv_decode_abi(void) { return 2; }

/* lse: NULL, or [B, Hq] fp32 that gets each query head's log-sum-exp of its scaled scores (-inf for
   no visible slot), so another part of the same attention can be merged in exactly. */
int confkv_decode_attention(const void *q, void *out, int dtype, int64_t rows, int64_t hq,
                            const void *pool, int64_t bs, int64_t hkv, int64_t d,
                            const int64_t *k_table, const int64_t *v_table, int64_t width,
                            const int64_t *lens, int64_t window, float scale, int threads, float *lse) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    if (d > MAX_D || hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP) return -2;
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
    /* Fewer (row, KV head) pairs than twice the threads: each pair's slots are cut in parts (split-K)
       so every thread has work; the parts are combined exactly through their maxima and sums. */
    int64_t group = hq / hkv, pairs = rows * hkv, gd = group * d;
    int64_t parts = threads > 1 && pairs < 2 * threads ? (2 * threads + pairs - 1) / pairs : 1;
    float *partial = malloc(sizeof(float) * (size_t)(pairs * parts * (gd + 2 * group)));
    if (partial == NULL) return -3;
    float *stats = partial + pairs * parts * gd;
    int failed = 0, avx512 = use_avx512(d, group), avx2 = !avx512 && use_avx2(d);
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (pairs * parts > 1 && threads > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(longest * group));
        float qf[MAX_GROUP * MAX_D];
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs * parts; t++) {
            if (scores == NULL) continue;
            int64_t pair = t / parts, r = pair / hkv, h = pair % hkv, hi = lens[r], a, b;
            int64_t lo = window > 0 && hi > window ? hi - window : 0;
            part_range(lo, hi, t % parts, parts, bs, &a, &b);
            Pool p = {pool, k_table + r * width, v_table + r * width, bs, hkv, d, dtype};
            int64_t at = (r * hq + h * group) * d; /* the group's heads are adjacent */
            if (dtype == DT_F32) memcpy(qf, (const float *)q + at, sizeof(float) * (size_t)gd);
            else
                for (int64_t i = 0; i < gd; i++) qf[i] = bf16_to_f32(((const uint16_t *)q)[at + i]);
            float *po = partial + t * gd, *ps = stats + t * 2 * group;
#ifdef HAVE_AVX512_PATH
            if (avx512) attend_group_avx512(&p, qf, group, a, b, h, scale, scores, po, ps);
            else if (avx2) attend_group_avx2(&p, qf, group, a, b, h, scale, scores, po, ps);
            else
#endif
                attend_group(&p, qf, group, a, b, h, scale, scores, po, ps);
        }
        free(scores);
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            int64_t r = pair / hkv, h = pair % hkv, at = (r * hq + h * group) * d;
            for (int64_t g = 0; g < group; g++) {
                float best = -INFINITY, total = 0.0f, of[MAX_D];
                for (int64_t k = 0; k < parts; k++) {
                    float m = stats[((pair * parts + k) * group + g) * 2];
                    best = m > best ? m : best;
                }
                for (int64_t i = 0; i < d; i++) of[i] = 0.0f;
                for (int64_t k = 0; k < parts; k++) {
                    const float *st = stats + ((pair * parts + k) * group + g) * 2;
                    if (st[1] == 0.0f) continue; /* an empty part */
                    float w = expf(st[0] - best);
                    total += w * st[1];
                    const float *o = partial + (pair * parts + k) * gd + g * d;
                    for (int64_t i = 0; i < d; i++) of[i] += w * o[i];
                }
                float inv = total > 0.0f ? 1.0f / total : 0.0f;
                if (lse) lse[r * hq + h * group + g] = total > 0.0f ? best + logf(total) : -INFINITY;
                for (int64_t i = 0; i < d; i++) {
                    if (dtype == DT_F32) ((float *)out)[at + g * d + i] = of[i] * inv;
                    else ((uint16_t *)out)[at + g * d + i] = f32_to_bf16(of[i] * inv);
                }
            }
        }
    }
    free(partial);
    return failed ? -3 : 0;
}
