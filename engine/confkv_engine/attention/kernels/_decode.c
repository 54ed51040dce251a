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
   same head dims; 1.7-2.8x the plain-C clone on an AVX2-only EPYC, 2 threads: 59 -> 33 us for one
   row of 300 fp32 slots at Gemma 3's 4 x 256 heads, 1.02 -> 0.60 ms for 32 rows, 1.65 -> 0.87 ms
   for 8 rows of 2,048 at SmolLM2's 9 x 64, 246 -> 89 us for 4 bf16 rows of 500; static-decode
   logprobs stay within the test's 1e-5), both with the softmax's exps 8 lanes at a time and both in
   _decode_simd.c, else in plain C compiled for AVX-512, AVX2 and x86-64 (`target_clones`: the
   loader picks the best the CPU runs). */

#include <stdlib.h>

#include "_decode.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

/* Whether this CPU runs the AVX2 path (where it lacks the AVX-512 one). */
static int use_avx2(int64_t d) {
#ifdef HAVE_SIMD_PATHS
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
#ifdef HAVE_SIMD_PATHS
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
   no visible slot), so another part of the same attention can be merged in exactly. Returns 0, or -1
   (a dtype it does not read), -2 (head dim above MAX_D, heads not grouped or more than MAX_GROUP per
   KV head), -3 (out of memory for the scores). */
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
#ifdef HAVE_SIMD_PATHS
            if (avx512) confkv_attend_group_avx512(&p, qf, group, a, b, h, scale, scores, po, ps);
            else if (avx2) confkv_attend_group_avx2(&p, qf, group, a, b, h, scale, scores, po, ps);
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
