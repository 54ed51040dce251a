/* Attention mass per cached token at a decision point: the softmax of the recorded queries' scores
   and its fold into per-key sums, in one pass over each score row.

   Why: retention scores the queries of a decision interval against the cached keys at once (one
   matmul per few layers, ``retention.scoring``). In PyTorch the softmax, the sum over each KV head's
   query heads and the fold into the accumulators (decay weights, the visible-key counts, the peak's
   far-query means) are a dozen passes over [units, G, T, n] tensors of several MB each, each pass
   out of the caches; here each score row (n floats) is read while it is in L1.

   Inputs: scores [units, G * T, n] fp32, row g * T + i of a unit = query i's scaled scores through the
   unit's query head g (the layout ``attention_probs`` builds), overwritten; key_pos [units, n] int32
   (row stride pos_stride); query_pos [T] int32 ascending; w [T] fp32, each query's decay weight.
   Query i sees the keys with pos <= query_pos[i] (its own included).

   Outputs, [units, n] fp32 each, overwritten:
     mass[n]  = sum_i w_i P_i(n), P_i(n) = sum_g softmax of row (g, i) over the keys query i sees, at n
     seen[n]  = sum_i w_i [key n visible to query i]
     peak_sum[n], peak_count[n] (NULL: not wanted): over the queries i with
       query_pos[i] - reach <= pos_n <= query_pos[i] - min_distance (reach < 0: no lower bound),
       the sum of P_i(n) * (keys query i sees), and how many such queries there were.
   ``scorer.update_attention`` / ``update_peak`` define the same quantities in PyTorch; the tests
   hold the two to fp32 rounding (the exp here, ../_expf.h, is a polynomial good to about 2 ulp).

   Threads: OpenMP over units. Loops are plain C compiled for AVX-512, AVX2 and x86-64
   (`target_clones`), the exp written so that they vectorise; the row's maximum and sum run in
   lanes (summed in another order than one by one: fp32 rounding). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* The exp's float-to-int conversion may raise an FP exception flag (never read here), which without
   this keeps the loops scalar on CPUs without masked vector lanes (AVX2). Results do not change. */
#pragma GCC optimize("no-trapping-math")
#endif

#include "../_expf.h" /* after the pragma: its exp is compiled under it */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Sums and maxima run in LANES independent lanes (summed at the end), which the compiler maps onto
   vector registers without being allowed to reorder a single running sum. */
#define LANES 16

/* Row (g, i) of one unit replaced by exp(s - max) over the keys query i sees (0 elsewhere); returns
   the sum of those exps (0 when it sees none). */
CLONES static float exp_row(float *row, const int32_t *pos, int32_t qp, int64_t n) {
    float lane[LANES];
    int64_t body = n / LANES * LANES;
    for (int l = 0; l < LANES; l++) lane[l] = -INFINITY;
    for (int64_t j = 0; j < body; j += LANES) {
        for (int l = 0; l < LANES; l++) {
            float s = pos[j + l] <= qp ? row[j + l] : -INFINITY;
            lane[l] = s > lane[l] ? s : lane[l];
        }
    }
    for (int64_t j = body; j < n; j++) {
        float s = pos[j] <= qp ? row[j] : -INFINITY;
        lane[0] = s > lane[0] ? s : lane[0];
    }
    float best = -INFINITY;
    for (int l = 0; l < LANES; l++) best = lane[l] > best ? lane[l] : best;
    if (best == -INFINITY) return 0.0f;
    for (int64_t j = 0; j < n; j++) {
        /* exp of every key, then 0 for the hidden ones: a select after the exp vectorises where a
           conditional exp does not (AVX2 has no masked lanes). Hidden keys may score above the
           maximum: clamped at 0 so their exp stays finite. */
        float x = row[j] - best;
        float e = confkv_expf(x > 0.0f ? 0.0f : x);
        row[j] = pos[j] <= qp ? e : 0.0f;
    }
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
    for (int64_t j = 0; j < body; j += LANES) {
        for (int l = 0; l < LANES; l++) lane[l] += row[j + l];
    }
    for (int64_t j = body; j < n; j++) lane[0] += row[j];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += lane[l];
    return sum;
}

/* p (+)= row / sum. */
CLONES static void add_scaled(float *p, const float *row, float scale, int64_t n, int first) {
    if (first) {
        for (int64_t j = 0; j < n; j++) p[j] = row[j] * scale;
    } else {
        for (int64_t j = 0; j < n; j++) p[j] += row[j] * scale;
    }
}

CLONES static int64_t count_visible(const int32_t *pos, int32_t qp, int64_t n) {
    int64_t c = 0; /* integers: any order is exact, so the compiler vectorises the sum itself */
    for (int64_t j = 0; j < n; j++) c += pos[j] <= qp;
    return c;
}

/* Query i's fold into the unit's sums: its probabilities p (summed over the query heads), weight w. */
CLONES static void fold_query(const float *p, const int32_t *pos, int32_t qp, float w, int64_t n,
                              float *mass, float *seen) {
    for (int64_t j = 0; j < n; j++) {
        mass[j] += w * p[j];
        seen[j] += pos[j] <= qp ? w : 0.0f;
    }
}

/* Query i's part of the peak: the keys at pos in [lo, hi] get p * visible and one count. */
CLONES static void fold_peak(const float *p, const int32_t *pos, int64_t lo, int64_t hi, float visible,
                             int64_t n, float *peak_sum, float *peak_count) {
    for (int64_t j = 0; j < n; j++) {
        int far = pos[j] <= hi && pos[j] >= lo;
        peak_sum[j] += far ? p[j] * visible : 0.0f;
        peak_count[j] += far ? 1.0f : 0.0f;
    }
}

static void mass_unit(float *scores, int64_t group, int64_t t, int64_t n, const int32_t *pos,
                      const int32_t *query_pos, const float *w, float *mass, float *seen, float *peak_sum,
                      float *peak_count, int64_t min_distance, int64_t reach, float *p) {
    memset(mass, 0, (size_t)n * sizeof(float));
    memset(seen, 0, (size_t)n * sizeof(float));
    if (peak_sum) {
        memset(peak_sum, 0, (size_t)n * sizeof(float));
        memset(peak_count, 0, (size_t)n * sizeof(float));
    }
    for (int64_t i = 0; i < t; i++) {
        int32_t qp = query_pos[i];
        int any = 0;
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + (g * t + i) * n;
            float sum = exp_row(row, pos, qp, n);
            if (sum > 0.0f) {
                add_scaled(p, row, 1.0f / sum, n, !any);
                any = 1;
            }
        }
        if (!any) continue; /* a query that sees no key adds nothing (it cannot: it sees itself) */
        fold_query(p, pos, qp, w[i], n, mass, seen);
        if (peak_sum) {
            int64_t lo = reach < 0 ? INT64_MIN : (int64_t)qp - reach;
            float visible = (float)count_visible(pos, qp, n);
            fold_peak(p, pos, lo, (int64_t)qp - min_distance, visible, n, peak_sum, peak_count);
        }
    }
}

/* The version of confkv_attention_mass's arguments; native_mass checks it. */
int confkv_mass_abi(void) { return 1; }

/* Returns 0, or -3 (out of memory for a row of scratch). */
int confkv_attention_mass(float *scores, int64_t units, int64_t group, int64_t t, int64_t n,
                          const int32_t *key_pos, int64_t pos_stride, const int32_t *query_pos,
                          const float *w, float *mass, float *seen, float *peak_sum, float *peak_count,
                          int64_t min_distance, int64_t reach, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!p) continue;
            size_t at = (size_t)u * (size_t)n;
            mass_unit(scores + at * (size_t)(group * t), group, t, n, key_pos + u * pos_stride, query_pos, w,
                      mass + at, seen + at, peak_sum ? peak_sum + at : NULL,
                      peak_count ? peak_count + at : NULL, min_distance, reach, p);
        }
        free(p);
    }
    return failed ? -3 : 0;
}
