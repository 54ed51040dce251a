/* Native int4-weight matmul for CPUs: y[r, n] = sum_k x[r, k] * w[n, k], w in 4-bit groups of 32.

   Why: PyTorch's weight-only int4 kernel wants bf16 activations; on a CPU without native bf16
   (AVX2-only ones) it falls off its fast path and one decode row became slower than the dense fp32
   matmul it was meant to beat. This kernel does integer dot products instead, on every x86 CPU
   since AVX2, the way llama.cpp's Q4_1 x Q8 dot does (maths written from its description):

   - weights: per output row n and group g of 32, codes q in 0..15, w = d * (q - 8) + z (fp32 d, z:
     exact for GGUF Q4_0 / Q4_1 / Q4_K groups). Packed at load (q4native.py), 16 bytes per group:
     byte j holds element j in its low nibble and element j + 16 in its high nibble (GGUF's order);
   - activations: per row and group, s = max|x| / 127, a = round(x / s) in -127..127 (int8), the
     exact fp32 sum of the group's x and c = 8 s sum_j a_j;
   - sum_k x w = sum_g [ d (s * sum_j q_j a_j - c) ] + sum_g [ z * sum_j x_j ]: an integer dot of
     unsigned 4-bit by signed 8-bit (maddubs / dpbusd take exactly u8 x s8) with the 8 taken back
     out, so the activations' rounding error meets the centred codes q - 8 (half the error that
     q in 0..15 would give, for asymmetric groups whose z is large), and the exact group sum for
     the rest, which adds no rounding of the activations.

   Paths, chosen by the caller (kernels.py reads the CPU flags) and re-checked here: AVX2+FMA
   (maddubs + madd), AVX-512 VNNI (dpbusd on 256-bit registers: a group of 32 codes fills one, so
   each group's scale applies to one register without shuffles), and portable scalar C.
   Threads: OpenMP over output rows, as many as the caller passes (PyTorch's count; called from
   the engine thread, it reuses that thread's OpenMP team). Plain C with a C ABI, loaded by ctypes. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "_qcommon.h"

#define TILE 4 /* activation rows that share one unpacked weight group */

typedef struct { /* quantized activations, rows x k */
    const int8_t *q;   /* [rows, k] */
    const float *s;    /* [rows, k / 32] scale of each group */
    const float *sum;  /* [rows, k / 32] exact sum of each group's x */
    const float *corr; /* [rows, k / 32] 8 * s * sum of the group's int8 codes */
    int64_t k;
} Acts;

typedef struct { /* packed weights, n x k */
    const uint8_t *q;  /* [n, k / 2] */
    const float *d;    /* [n, k / 32] */
    const float *z;    /* [n, k / 32] */
    int64_t k;
} Weights;

/* One row of activations -> int8 groups. Scalar on purpose: it is O(rows * k) against the
   matmul's O(rows * k * n), and the compiler vectorises the plain loops. */
static void quantize_row(const void *x, int dtype, int64_t row, int64_t k, int8_t *q, float *s,
                         float *sum, float *corr) {
    float buf[GROUP];
    for (int64_t g = 0; g < k / GROUP; g++) {
        float amax = 0.f, total = 0.f;
        for (int j = 0; j < GROUP; j++) {
            buf[j] = load_x(x, dtype, row * k + g * GROUP + j);
            amax = fmaxf(amax, fabsf(buf[j]));
            total += buf[j];
        }
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t codes = 0;
        for (int j = 0; j < GROUP; j++) {
            q[g * GROUP + j] = (int8_t)nearbyintf(buf[j] * inv);
            codes += q[g * GROUP + j];
        }
        s[g] = scale;
        sum[g] = total;
        corr[g] = 8.f * scale * (float)codes;
    }
}

/* The terms of one (weight row n, activation row r) pair outside the integer dot:
   sum_g z[g] * sum_x[g] - d[g] * corr[g]. */
static inline float offset_term(const Weights *w, int64_t n, const Acts *a, int64_t r) {
    const int64_t groups = w->k / GROUP;
    const float *z = w->z + n * groups, *d = w->d + n * groups;
    const float *sum = a->sum + r * groups, *corr = a->corr + r * groups;
    float t = 0.f;
    for (int64_t g = 0; g < groups; g++) t += z[g] * sum[g] - d[g] * corr[g];
    return t;
}

/* ------------------------------------------------------------------ scalar path */

static void row_tile_scalar(const Weights *w, int64_t n, const Acts *a, int64_t r0, int rows,
                            float *out) {
    const int64_t groups = w->k / GROUP;
    const uint8_t *wq = w->q + n * (w->k / 2);
    for (int r = 0; r < rows; r++) {
        const int8_t *aq = a->q + (r0 + r) * w->k;
        const float *as = a->s + (r0 + r) * groups;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t dot = 0;
            for (int j = 0; j < GROUP / 2; j++) {
                uint8_t b = wq[g * 16 + j];
                dot += (b & 15) * aq[g * GROUP + j] + (b >> 4) * aq[g * GROUP + j + 16];
            }
            acc += w->d[n * groups + g] * as[g] * (float)dot;
        }
        out[r] = acc + offset_term(w, n, a, r0 + r);
    }
}

/* ------------------------------------------------------------------ SIMD paths */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>

/* The body is the same for AVX2 and VNNI except for the 32-element integer dot, so it is written
   once in q4_simd.h and included twice, under each ISA's target options. */
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SUFFIX avx2
static inline __m256i dot32_avx2(__m256i w, __m256i a) {
    /* u8 x s8 pairs summed into 16 int16 (no overflow: 2 * 15 * 127), then into 8 int32 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}
#define DOT32 dot32_avx2
#include "q4_simd.h"
#undef DOT32
#undef SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#define SUFFIX vnni
static inline __m256i dot32_vnni(__m256i w, __m256i a) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a); /* u8 x s8, four per int32 lane */
}
#define DOT32 dot32_vnni
#include "q4_simd.h"
#undef DOT32
#undef SUFFIX
#pragma GCC pop_options
#else
#define HAVE_X86 0
#endif

typedef void (*TileFn)(const Weights *, int64_t, const Acts *, int64_t, int, float *);

static TileFn tile_fn(int isa) {
#if HAVE_X86
    __builtin_cpu_init();
    if (isa == ISA_VNNI && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
        return row_tile_vnni;
    if (isa == ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return row_tile_avx2;
#endif
    return isa == ISA_SCALAR ? row_tile_scalar : NULL;
}

/* ------------------------------------------------------------------ entry point */

/* y [rows, n] (dtype y_dtype) = x [rows, k] (x_dtype) times the packed weights' transpose.
   Returns 0, or -1 when the CPU lacks the ISA asked for, -2 when k is not a multiple of 32,
   -3 when scratch memory cannot be had. */
int confkv_q4_matmul(const void *x, int x_dtype, int64_t rows, int64_t k, const uint8_t *wq,
                     const float *wd, const float *wz, int64_t n, void *y, int y_dtype, int isa,
                     int threads) {
    TileFn tile = tile_fn(isa);
    if (tile == NULL) return -1;
    if (k % GROUP) return -2;
    const int64_t groups = k / GROUP;
    int8_t *aq = malloc((size_t)(rows * k));
    float *as = malloc(sizeof(float) * (size_t)(rows * groups * 3));
    if (aq == NULL || as == NULL) { free(aq); free(as); return -3; }
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x, x_dtype, r, k, aq + r * k, as + r * groups, as + (rows + r) * groups,
                     as + (2 * rows + r) * groups);
    const Weights w = {wq, wd, wz, k};
    const Acts a = {aq, as, as + rows * groups, as + 2 * rows * groups, k};
    /* Each thread owns a range of output rows (weights are read once, from its own cores' cache);
       inside it, the activation rows go in tiles of TILE sharing each unpacked group. */
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float out[TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int count = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            tile(&w, j, &a, r0, count, out);
            for (int r = 0; r < count; r++) store_y(y, y_dtype, (r0 + r) * n + j, out[r]);
        }
    }
    free(aq);
    free(as);
    return 0;
}

/* Which paths this CPU can run: bit ISA set for each (the scalar one always). */
int confkv_q4_supported(void) {
    int bits = 1 << ISA_SCALAR;
    for (int isa = ISA_AVX2; isa <= ISA_VNNI; isa++)
        if (tile_fn(isa) != NULL) bits |= 1 << isa;
    return bits;
}
