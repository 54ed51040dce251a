/* Row-wise elementwise blocks of the decoder layers in one call each (built into the _native
   library; loaded by rowops.py).

   Why: at one decode row each of these is a few hundred elements of work, while the PyTorch ops
   that compute it (RMSNorm alone is upcast, pow, mean, add, rsqrt, mul, downcast, weight: eight
   dispatches) cost 30-60 us a call in dispatch and allocation, times several calls per layer.

   Each function repeats the PyTorch reference's roundings (llama.py: rms_norm, apply_rope,
   silu_mul, gelu_tanh_mul) so that its output equals the reference's up to the order of a sum and
   the last bit of exp / tanh: statistics and rotations in fp32, a bf16 result rounded where the
   reference rounds (to nearest even), fp32 left unrounded. Plain C for any CPU (no target options,
   so no fused multiply-adds either: the reference rounds every product; contraction is off below).
   OpenMP over rows when there are enough of them to pay for the team. */

#pragma GCC optimize("fp-contract=off")
/* No FP traps are enabled, so the float-to-int conversion in confkv_expf (../_expf.h) may vectorise:
   with GCC's default -ftrapping-math it kept the AVX2 clone of the activation scalar (it could raise
   an FP flag a scalar loop would not). The values are the same either way. */
#pragma GCC optimize("no-trapping-math")

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../_expf.h"

enum { RT_F32 = 0, RT_BF16 = 1 };

/* The activation's loop is cloned for AVX-512, AVX2 and x86-64, chosen at load (no fused
   multiply-adds in any: contraction is off, so the three give the same bits). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

#define PAR_ROWS 8 /* fewer rows run on the calling thread */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The value a tensor of dtype dt holds for fp32 v (bf16: rounded). */
static inline float round_to(float v, int dt) { return dt == RT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void load_row(const void *src, int dt, int64_t off, int64_t n, float *dst) {
    if (dt == RT_F32) { memcpy(dst, (const float *)src + off, sizeof(float) * (size_t)n); return; }
    const uint16_t *s = (const uint16_t *)src + off;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static inline void store_row(void *dst, int dt, int64_t off, int64_t n, const float *src) {
    if (dt == RT_F32) { memcpy((float *)dst + off, src, sizeof(float) * (size_t)n); return; }
    uint16_t *d = (uint16_t *)dst + off;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* In place: v = round(w * round(v / rms(v))), the reference's fp32 norm, downcast, weight. */
static void norm_vec(float *v, int64_t n, const void *w, int dt, int64_t w_off, float eps) {
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) part[j] += v[i + j] * v[i + j];
    float sq = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < n; i++) sq += v[i] * v[i];
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (i = 0; i < n; i++) {
        float wi = dt == RT_F32 ? ((const float *)w)[w_off + i] : bf16_to_f32(((const uint16_t *)w)[w_off + i]);
        v[i] = round_to(wi * round_to(v[i] * inv, dt), dt);
    }
}

#define ROW_MAX 16384 /* widest row handled (hidden size, intermediate size); wider: the caller's ops */

/* out[r] = norm(x[r]) * w. */
int confkv_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t dim, float eps,
                    int dt, int threads) {
    if (dim > ROW_MAX) return -1;
    #pragma omp parallel for num_threads(threads) if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float v[ROW_MAX];
        load_row(x, dt, r * dim, dim, v);
        norm_vec(v, dim, w, dt, 0, eps);
        store_row(out, dt, r * dim, dim, v);
    }
    return 0;
}

/* The residual stream's update and the next norm in one pass: s = round(resid + y'), with
   y' = y, or y' = norm(y) * y_w when y_w is given (Gemma's post-norm before the add);
   new_resid = s and out = norm(s) * w (skipped when w is NULL). */
int confkv_add_rms_norm(const void *resid, const void *y, const void *y_w, void *new_resid,
                        const void *w, void *out, int64_t rows, int64_t dim, float eps, int dt,
                        int threads) {
    if (dim > ROW_MAX) return -1;
    #pragma omp parallel for num_threads(threads) if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float s[ROW_MAX], t[ROW_MAX];
        load_row(resid, dt, r * dim, dim, s);
        load_row(y, dt, r * dim, dim, t);
        if (y_w != NULL) norm_vec(t, dim, y_w, dt, 0, eps);
        for (int64_t i = 0; i < dim; i++) s[i] = round_to(s[i] + t[i], dt);
        store_row(new_resid, dt, r * dim, dim, s);
        if (w == NULL) continue;
        norm_vec(s, dim, w, dt, 0, eps);
        store_row(out, dt, r * dim, dim, s);
    }
    return 0;
}

/* In place on the query and key heads of a fused projection, row r at qk + r * row_stride
   (elements): heads 0 .. nq - 1 are queries, nq .. heads - 1 keys, d elements each. Per head:
   the per-head norm (norm_w [heads, d], or NULL for none), the half-split rotation by
   cos / sin [rows, d / 2] (fp32), and for query heads a scale (1: none), each rounded as the
   reference rounds it. */
int confkv_qk_rope(void *qk, int64_t rows, int64_t row_stride, int64_t heads, int64_t nq, int64_t d,
                   const float *cos_t, const float *sin_t, const void *norm_w, float eps, float q_scale,
                   int dt, int threads) {
    if (d > ROW_MAX || d % 2) return -1;
    const int64_t half = d / 2;
    #pragma omp parallel for num_threads(threads) if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float v[ROW_MAX];
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t off = r * row_stride + h * d;
            load_row(qk, dt, off, d, v);
            if (norm_w != NULL) norm_vec(v, d, norm_w, dt, h * d, eps);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i] + x1 * s[i];
            }
            if (h < nq && q_scale != 1.0f)
                for (int64_t i = 0; i < d; i++) v[i] = round_to(v[i], dt) * q_scale;
            store_row(qk, dt, off, d, v);
        }
    }
    return 0;
}

/* exp(z) - 1 for z >= 0, accurate near 0 too: its Taylor series up to z^8 / 8! below 0.5 (truncation
   under 1e-8 relative there), exp(z) - 1 above. */
static inline float expm1_pos(float z) {
    float p = 1.0f / 40320.0f;
    p = p * z + 1.0f / 5040.0f;
    p = p * z + 1.0f / 720.0f;
    p = p * z + 1.0f / 120.0f;
    p = p * z + 1.0f / 24.0f;
    p = p * z + 1.0f / 6.0f;
    p = p * z + 0.5f;
    p = (p * z) * z + z;
    const float big = confkv_expf(z) - 1.0f;
    return z < 0.5f ? p : big;
}

/* silu(g) = g / (1 + exp(-g)), PyTorch's form. GELU's tanh form 0.5 g (1 + tanh(y)), y = beta (g +
   kappa g^3), in the reference's order, with tanh(y) = sign(y) d / (d + 2), d = expm1(2 |y|): within
   about an ulp of the reference's tanh, so that 1 + tanh(y) cancels where the reference's does (far
   negative g gives 0 in both) and bf16 results agree but for rare last-bit roundings (PyTorch's CPU
   kernels take tanh from Sleef, which returns 1 beyond |y| = 8.664339742; so does this). */
static inline float act_of(float g, int kind) {
    if (kind == ACT_SILU) return g / (1.0f + confkv_expf(-g));
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    const float y = beta * (g + kappa * ((g * g) * g));
    const float a = fabsf(y), d = expm1_pos(2.0f * a);
    const float t = copysignf(a > 8.664339742f ? 1.0f : d / (d + 2.0f), y); /* 1 past there, as Sleef's */
    return (0.5f * g) * (1.0f + t);
}

CLONES static void gated_row(float *g, const float *u, int64_t n, int kind, int dt) {
    if (kind == ACT_SILU)
        for (int64_t i = 0; i < n; i++) g[i] = round_to(act_of(g[i], ACT_SILU), dt) * u[i];
    else
        for (int64_t i = 0; i < n; i++) g[i] = round_to(act_of(g[i], ACT_GELU_TANH), dt) * u[i];
}

/* out[r] = round(act(gate)) * up, gate and up the two halves of gate_up[r] (inter each). */
int confkv_gated_act(const void *gate_up, void *out, int64_t rows, int64_t inter, int kind, int dt,
                     int threads) {
    if (inter > ROW_MAX) return -1;
    #pragma omp parallel for num_threads(threads) if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float g[ROW_MAX], u[ROW_MAX];
        load_row(gate_up, dt, r * 2 * inter, inter, g);
        load_row(gate_up, dt, r * 2 * inter + inter, inter, u);
        gated_row(g, u, inter, kind, dt);
        store_row(out, dt, r * inter, inter, g);
    }
    return 0;
}
