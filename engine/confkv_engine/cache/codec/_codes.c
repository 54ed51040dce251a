/* Decode attention straight from the codes of compressed KV blocks (int8 / int4 / int2, k4v2): part
   of the codec's native library (_dequant.c holds the block decoder), loaded with ctypes by
   codec.native. Plain C with a C ABI, OpenMP over work items where the compiler has it. */

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM omp_get_thread_num()
#else
#define THREAD_NUM 0
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(CONFKV_NO_CLONES)
#define CONFKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CONFKV_CLONES
#endif

/* One layer's attention of decode queries over their sequences' compressed blocks, never writing a
   decoded element. Keys are grouped per channel along the block's tokens (k = ks * code + km per
   (head, channel, token group)), so a block's scores are (q * ks) . codes + q . km; values per token
   along head_dim (v = vs * code + vm per (token, head, channel group)), so a block's output is
   (p * vs) . codes + p . vm. Online softmax over a run of blocks; work items are (row, KV head, run
   of blocks) in parallel, merged by log-sum-exp into running (m, l, acc) states the caller holds,
   so several calls (one per codec pair) and the pool's own part combine exactly.

   A block's layout (codec.spec): codes | pad to even | parameters, fp16 (scales | mins) or dq6
   (fp16 headers (top, floor, step) per row of groups | 6-bit (scale, min) codes, a row's run four
   per 3 bytes); the parameters are read here, per head, as the PyTorch path computes them. */

/* Attention needs 1e-5 agreement, not bit-identity: let the compiler fuse multiply-adds here (the
   build's -ffp-contract=off is for the decoder, _dequant.c). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#pragma GCC diagnostic ignored "-Wpsabi" /* vector-returning helpers are always inlined */
#endif

#include "../../_expf.h" /* after the pragma: its exp contracts as this file does */

#define INLINE static inline __attribute__((always_inline))

/* 8 fp32 / int32 lanes in GCC's vector extension: one AVX2 register, half an AVX-512 one (16-lane
   vectors measured 2.5x slower than the arrays in the AVX2 clone, where GCC spilled them to the
   stack; 8 lanes are the width every clone but the baseline holds in one register). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

INLINE v8f splat(float x) { return (v8f){0} + x; }

INLINE v8f pick(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

enum { L_BITS, L_GROUP, L_DQ6, L_OFFSET, L_GROUPS, L_ROW_GROUPS, L_ROWS, L_ROW_BYTES, L_NBYTES, L_LEN };

static inline __attribute__((unused)) float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0x1Fu) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp16 -> fp32 is exact either way; _Float16 compiles to one vcvtph2ps in the F16C (x86-64-v3/v4)
   clones, where the bit-level form costs branches per parameter (measured: most of the kernel's time). */
static inline float half_at(const uint8_t *p, int64_t i) {
#if defined(__FLT16_MAX__)
    _Float16 h;
    memcpy(&h, p + 2 * i, sizeof h);
    return (float)h;
#else
    uint16_t h;
    memcpy(&h, p + 2 * i, sizeof h);
    return from_half(h);
#endif
}

/* exp2f(k * -1/8) for the 64 dq6 scale codes: the same bits as calling exp2f per group (filled once, at
   load), which cost most of a dq6 block's parameter reads. */
static float dq6_octaves[64];

__attribute__((constructor)) static void fill_dq6_octaves(void) {
    for (int k = 0; k < 64; k++) dq6_octaves[k] = exp2f((float)k * -0.125f);
}

/* Groups [first, first + count) of one block's fp32 (scale, min). fp16: straight conversions (8 at a
   time where _Float16 vectors exist). dq6: per row of groups its fp16 header (top, floor, step) once,
   then per group scale = top * 2^(-code / 8), min = floor + code * step. */
static inline __attribute__((always_inline)) void group_params(const uint8_t *blk, const int64_t *lay,
                                                                int64_t first, int count,
                                                                float *restrict scale, float *restrict min) {
    const uint8_t *p = blk + lay[L_OFFSET];
    if (lay[L_DQ6]) {
        const int64_t per_row = lay[L_ROW_GROUPS];
        for (int i = 0; i < count;) {
            const int64_t g = first + i, row = g / per_row, j = g % per_row;
            const int n = (int)(count - i < per_row - j ? count - i : per_row - j);
            const float top = half_at(p, 3 * row), floor_ = half_at(p, 3 * row + 1), step = half_at(p, 3 * row + 2);
            const uint8_t *codes = p + 6 * lay[L_ROWS] + row * lay[L_ROW_BYTES];
            for (int k = 0; k < n; k++) { /* group j + k: codes 2 (j + k), +1 = half of a 3-byte word */
                const uint64_t at = (uint64_t)(j + k);
                const uint8_t *w = codes + 3 * (at >> 1);
                const uint32_t word = (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16;
                const unsigned shift = (unsigned)(at & 1) * 12;
                scale[i + k] = top * dq6_octaves[(word >> shift) & 63u];
                min[i + k] = floor_ + (float)((word >> (shift + 6)) & 63u) * step;
            }
            i += n;
        }
        return;
    }
    p += 2 * first;
    const uint8_t *q = p + 2 * lay[L_GROUPS];
    int i = 0;
#if defined(__FLT16_MAX__)
    typedef _Float16 v8h __attribute__((vector_size(16)));
    for (; i + 8 <= count; i += 8) {
        v8h s16, m16;
        memcpy(&s16, p + 2 * i, sizeof s16);
        memcpy(&m16, q + 2 * i, sizeof m16);
        store8(scale + i, __builtin_convertvector(s16, v8f));
        store8(min + i, __builtin_convertvector(m16, v8f));
    }
#endif
    for (; i < count; i++) {
        scale[i] = half_at(p, i);
        min[i] = half_at(q, i);
    }
}

/* Codes [count] unpacked to fp32 in code order (bits constant in the specialised kernels: the loop
   unrolls and vectorises). */
static inline __attribute__((always_inline)) void unpack_float(const uint8_t *src, float *restrict dst,
                                                                int count, int bits) {
    if (bits == 8) {
        for (int i = 0; i < count; i++) dst[i] = (float)src[i];
        return;
    }
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1u;
    for (int i = 0; i < count / per; i++) {
        const unsigned b = src[i];
        for (int k = 0; k < per; k++) dst[i * per + k] = (float)((b >> (bits * k)) & mask);
    }
}

/* The per-thread scratch: scores [G, bs], K codes [D, bs] and V codes [bs, D] as fp32, key parameters
   [D, bs / kg], value parameters [bs, D / vg], the values' running p . vm [D / vg]. */
typedef struct {
    float *sc, *kc, *vc, *ks, *km, *vs, *vm, *pm;
} scratch_t;

/* y += w * x over n floats. A function of its own so that restrict holds on the parameters: on the
   scratch pointers inside block_scores the compiler assumed aliasing, reloaded and stored every
   element and kept the loop scalar (measured: the kernel's hot spot). */
static inline __attribute__((always_inline)) void axpy(float *restrict y, const float *restrict x, float w, int n) {
    for (int t = 0; t < n; t++) y[t] += w * x[t];
}

/* Scores [G, bs] of head h's G scaled queries against one K block (tokens past `valid`: -inf).
   Inlined into kernels with constant bits / bs / D / group, whose loops then have fixed trip counts. */
static inline __attribute__((always_inline)) void block_scores(const uint8_t *blk, const int64_t *lay,
                                                                const float *q, int G, int bs, int D, int h,
                                                                int valid, scratch_t *s, int bits, int kg) {
    const int R = bs / kg, per = 8 / bits;
    float *restrict kc = s->kc, *restrict ks = s->ks, *restrict km = s->km;
    unpack_float(blk + (int64_t)h * D * bs / per, kc, D * bs, bits);
    group_params(blk, lay, (int64_t)h * D * R, D * R, ks, km);
    for (int g = 0; g < G; g++) {
        const float *qg = q + g * D;
        float *restrict sc = s->sc + g * bs;
        for (int r = 0; r < R; r++) {
            float a = 0;
            for (int c = 0; c < D; c++) a += qg[c] * km[c * R + r];
            for (int t = r * kg; t < (r + 1) * kg; t++) sc[t] = a;
        }
        for (int c = 0; c < D; c++) {
            const float *kr = kc + c * bs;
            for (int r = 0; r < R; r++) axpy(sc + r * kg, kr + r * kg, qg[c] * ks[c * R + r], kg);
        }
        for (int t = valid; t < bs; t++) sc[t] = -INFINITY;
    }
}

/* Folds one V block, weighted by exp(scores - running max), into (m, l, acc) of head h's G queries. */
static inline __attribute__((always_inline)) void block_values(const uint8_t *blk, const int64_t *lay, int G,
                                                                int bs, int H, int D, int h, int valid,
                                                                float *m, float *l, float *acc, scratch_t *s,
                                                                int bits, int vg) {
    const int R = D / vg, per = 8 / bits;
    float *restrict vc = s->vc, *restrict vs = s->vs, *restrict vm = s->vm, *restrict pm = s->pm;
    for (int t = 0; t < valid; t++) {
        unpack_float(blk + ((int64_t)t * H + h) * D / per, vc + t * D, D, bits);
        group_params(blk, lay, ((int64_t)t * H + h) * R, R, vs + t * R, vm + t * R);
    }
    for (int g = 0; g < G; g++) {
        const float *sc = s->sc + g * bs;
        float mx = m[g];
        for (int t = 0; t < valid; t++) mx = fmaxf(mx, sc[t]);
        if (mx == -INFINITY) continue;
        const float corr = expf(m[g] - mx);
        float *restrict o = acc + g * D;
        float lg = l[g] * corr;
        for (int c = 0; c < D; c++) o[c] *= corr;
        for (int r = 0; r < R; r++) pm[r] = 0;
        for (int t = 0; t < valid; t++) {
            const float p = expf(sc[t] - mx);
            const float *vr = vc + t * D;
            lg += p;
            for (int r = 0; r < R; r++) {
                const float ps = p * vs[t * R + r];
                pm[r] += p * vm[t * R + r];
                for (int c = r * vg; c < (r + 1) * vg; c++) o[c] += ps * vr[c];
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = r * vg; c < (r + 1) * vg; c++) o[c] += pm[r];
        l[g] = lg;
        m[g] = mx;
    }
}

/* One block pair folded into head h's G running states. */
typedef void (*fold_fn)(const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay,
                        const float *q, int G, int bs, int H, int D, int h, int valid, float *m, float *l,
                        float *acc, scratch_t *s);

CONFKV_CLONES
static void fold_any(const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay,
                     const float *q, int G, int bs, int H, int D, int h, int valid, float *m, float *l,
                     float *acc, scratch_t *s) {
    block_scores(kblk, klay, q, G, bs, D, h, valid, s, (int)klay[L_BITS], (int)klay[L_GROUP]);
    block_values(vblk, vlay, G, bs, H, D, h, valid, m, l, acc, s, (int)vlay[L_BITS], (int)vlay[L_GROUP]);
}

/* ---- The codecs' usual shape: 16-token blocks, one key group per channel along the block (kg = bs),
   one value group per (token, head) along head_dim (vg = D) ------------------------------------------

   Compiled per (key bits, value bits, head_dim 64 / 128 / 256) with constant loop bounds (the generic
   fold with run-time bounds measured ~4x slower). Two forms: the array one above with constants (every CPU,
   cloned per ISA) and, on x86-64 CPUs with AVX2 / FMA / F16C, one in 8-lane vectors (GCC's vector
   extension, compiled for x86-64-v3), since the array form was bound by its dependency chains, not by
   arithmetic (perf annotate at 8 x 2,048 under conf-kv+tiers: the key scores one multiply-add chain
   per query through memory, every value accumulator stored and reloaded per token, libm's expf per
   token). In the vector form a block's 16 scores are two vectors of two partial sums over the
   channels each, a query's output accumulators stay in registers over the block's tokens, and the 16
   weights come from a vectorised exp. (16-lane vectors lowered to spills on the stack in the AVX2
   clone: 2.5x slower than the arrays there; 8 lanes are one AVX2 register, and the AVX-512 CPUs
   measured the same with them.) */

#define FOLD_FIXED(KB, VB, DD)                                                                           \
    CONFKV_CLONES static void fold_##KB##_##VB##_##DD(                                                   \
        const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay, const float *q, \
        int G, int bs, int H, int D, int h, int valid, float *m, float *l, float *acc, scratch_t *s) {    \
        (void)bs; (void)D;                                                                               \
        block_scores(kblk, klay, q, G, 16, DD, h, valid, s, KB, 16);                                     \
        block_values(vblk, vlay, G, 16, H, DD, h, valid, m, l, acc, s, VB, DD);                          \
    }
#define FOLD_SHAPES(FOLD)                                                                                \
    FOLD(8, 8, 64) FOLD(4, 4, 64) FOLD(4, 2, 64) FOLD(2, 2, 64)                                          \
    FOLD(8, 8, 128) FOLD(4, 4, 128) FOLD(4, 2, 128) FOLD(2, 2, 128)                                      \
    FOLD(8, 8, 256) FOLD(4, 4, 256) FOLD(4, 2, 256) FOLD(2, 2, 256)
FOLD_SHAPES(FOLD_FIXED)

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_FOLDS 1

INLINE float sum8(v8f v) {
    v = v + __builtin_shuffle(v, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    v = v + __builtin_shuffle(v, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    v = v + __builtin_shuffle(v, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

INLINE float max8(v8f v) {
    v8f w = __builtin_shuffle(v, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    v = pick(v > w, v, w);
    w = __builtin_shuffle(v, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    v = pick(v > w, v, w);
    w = __builtin_shuffle(v, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    return pick(v > w, v, w)[0];
}

/* exp(x) for x <= 0 (scores less their running max; ../../_expf.h): within 2 ulp of libm's expf
   (tests/unit/test_codes_attention_native.py checks the attention within 1e-5); x below -87.3 (-inf:
   a masked slot) gives 0. */
INLINE v8f exp8(v8f x) {
    const v8i live = x >= CONFKV_EXP_LO;
    return (v8f)((v8i)confkv_exp8(x) & live);
}

/* One block pair folded into head h's G running states. kc [D, 16] and vc [valid, D]: the block's codes
   as fp32; ks / km [D]: the key parameters per channel; vs / vm [valid]: the value ones per token.
   Scores of tokens 0-7 and 8-15 in two vectors, each from two partial sums over the channels. */
INLINE void fold16(const float *restrict kc, const float *restrict ks, const float *restrict km,
                   const float *restrict vc, const float *restrict vs, const float *restrict vm,
                   const float *q, int G, int valid, float *m, float *l, float *acc, const int DD) {
    const v8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8i live_lo = lanes < valid, live_hi = lanes + 8 < valid;
    for (int g = 0; g < G; g++) {
        const float *restrict qg = q + g * DD;
        float qs[DD]; /* q * key scale per channel */
        v8f mins = {0}, a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
        for (int c = 0; c < DD; c += 8) {
            store8(qs + c, load8(qg + c) * load8(ks + c));
            mins += load8(qg + c) * load8(km + c);
        }
        for (int c = 0; c < DD; c += 2) {
            a0 += qs[c] * load8(kc + c * 16);
            b0 += qs[c] * load8(kc + c * 16 + 8);
            a1 += qs[c + 1] * load8(kc + (c + 1) * 16);
            b1 += qs[c + 1] * load8(kc + (c + 1) * 16 + 8);
        }
        const float mn = sum8(mins);
        const v8f lo = pick(live_lo, a0 + a1 + mn, splat(-INFINITY));
        const v8f hi = pick(live_hi, b0 + b1 + mn, splat(-INFINITY));
        const float mx = fmaxf(m[g], max8(pick(lo > hi, lo, hi)));
        if (mx == -INFINITY) continue;
        float p[16];
        store8(p, exp8(lo - mx));
        store8(p + 8, exp8(hi - mx));
        const float corr = expf(m[g] - mx);
        float *restrict o = acc + g * DD;
        v8f out[DD / 8];
        for (int j = 0; j < DD / 8; j++) out[j] = load8(o + 8 * j) * corr;
        float pmin = 0;
        for (int t = 0; t < valid; t++) {
            const float w = p[t] * vs[t];
            pmin += p[t] * vm[t];
            for (int j = 0; j < DD / 8; j++) out[j] += w * load8(vc + t * DD + 8 * j);
        }
        for (int j = 0; j < DD / 8; j++) store8(o + 8 * j, out[j] + pmin);
        l[g] = l[g] * corr + sum8(load8(p) + load8(p + 8));
        m[g] = mx;
    }
}

#define FOLD_VECTOR(KB, VB, DD)                                                                          \
    __attribute__((target("arch=x86-64-v3"))) static void vfold_##KB##_##VB##_##DD(                      \
        const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay, const float *q, \
        int G, int bs, int H, int D, int h, int valid, float *m, float *l, float *acc, scratch_t *s) {    \
        (void)bs; (void)D;                                                                               \
        unpack_float(kblk + (int64_t)h * DD * 16 * KB / 8, s->kc, DD * 16, KB);                          \
        group_params(kblk, klay, (int64_t)h * DD, DD, s->ks, s->km);                                     \
        for (int t = 0; t < valid; t++) {                                                                \
            unpack_float(vblk + ((int64_t)t * H + h) * DD * VB / 8, s->vc + t * DD, DD, VB);             \
            group_params(vblk, vlay, (int64_t)t * H + h, 1, s->vs + t, s->vm + t);                       \
        }                                                                                                \
        fold16(s->kc, s->ks, s->km, s->vc, s->vs, s->vm, q, G, valid, m, l, acc, DD);                    \
    }
FOLD_SHAPES(FOLD_VECTOR)
#else
#define VECTOR_FOLDS 0
#endif

static int vector_folds = -1; /* -1: not chosen yet */

/* Whether the vector folds run: on >= 0 asks for them (1) or the array ones (0; the tests run both on
   one machine), on < 0 only asks. They run only where the CPU has x86-64-v3. */
int confkv_codes_vector_folds(int on) {
#if VECTOR_FOLDS
    if (on >= 0 || vector_folds < 0) vector_folds = on != 0 && __builtin_cpu_supports("x86-64-v3");
#else
    (void)on;
    vector_folds = 0;
#endif
    return vector_folds;
}

static fold_fn pick_fold(const int64_t *klay, const int64_t *vlay, int bs, int D) {
    if (bs != 16 || klay[L_GROUP] != bs || vlay[L_GROUP] != D || (D != 64 && D != 128 && D != 256))
        return fold_any;
    const int64_t kb = klay[L_BITS], vb = vlay[L_BITS];
#define PICK(PREFIX, KB, VB)                                                                             \
    if (kb == KB && vb == VB)                                                                            \
        return D == 64 ? PREFIX##KB##_##VB##_64 : D == 128 ? PREFIX##KB##_##VB##_128 : PREFIX##KB##_##VB##_256;
#if VECTOR_FOLDS
    if (confkv_codes_vector_folds(-1)) {
        PICK(vfold_, 8, 8)
        PICK(vfold_, 4, 4)
        PICK(vfold_, 4, 2)
        PICK(vfold_, 2, 2)
    }
#endif
    PICK(fold_, 8, 8)
    PICK(fold_, 4, 4)
    PICK(fold_, 4, 2)
    PICK(fold_, 2, 2)
#undef PICK
    return fold_any;
}

/* Merges one partial (pm, pl, pacc) into a running state (m, l, acc) of D-wide rows. */
static void merge(float *m, float *l, float *acc, float pm, float pl, const float *pacc, int D) {
    if (pm == -INFINITY) return;
    const float mx = fmaxf(*m, pm), a = expf(*m - mx), b = expf(pm - mx);
    for (int c = 0; c < D; c++) acc[c] = acc[c] * a + pacc[c] * b;
    *l = *l * a + pl * b;
    *m = mx;
}

/* The version of confkv_codes_attention's arguments; codec.native checks it, so a library built from
   an older source is not called with arguments it would read differently. */
int confkv_codes_abi(void) { return 4; }

/* Block i of a stream: the nbytes at off[i], or, where tail[2i] < nbytes (a slot straddling two hosts
   that are not neighbours in the pool), its first tail[2i] bytes there and the rest at tail[2i + 1],
   joined into the thread's scratch (a few KB). tail NULL: every block is contiguous. */
static inline const uint8_t *block_at(const uint8_t *raw, const int64_t *off, const int64_t *tail, int64_t nbytes,
                                      int64_t i, uint8_t *scratch) {
    if (!tail || tail[2 * i] >= nbytes) return raw + off[i];
    memcpy(scratch, raw + off[i], (size_t)tail[2 * i]);
    memcpy(scratch + tail[2 * i], raw + tail[2 * i + 1], (size_t)(nbytes - tail[2 * i]));
    return scratch;
}

/* Whether each of blocks [0, n) lies inside the len bytes of its stream (block_at's pieces). */
static int blocks_inside(const int64_t *off, const int64_t *tail, int64_t nbytes, int64_t n, int64_t len) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t cut = tail && tail[2 * i] < nbytes ? tail[2 * i] : nbytes;
        if (cut <= 0 || off[i] < 0 || off[i] > len - cut) return 0;
        if (cut < nbytes && (tail[2 * i + 1] < 0 || tail[2 * i + 1] > len - (nbytes - cut))) return 0;
    }
    return 1;
}

/* Attention of B decode rows over n compressed block pairs of one codec pair: K block i starts at byte
   koff[i] of kraw (klen bytes, layout klay; ktail: see block_at), V block i at voff[i] of vraw (vlen,
   vlay, vtail), so the blocks are read where the pool holds them; row r owns blocks [row_start[r],
   row_start[r+1]) and block i holds valid[i] tokens. q [B, H*G, D] fp32, already scaled. The result is
   merged into the caller's states m, l [B, H*G] and acc [B, H*G, D] (unnormalised: out = acc / l,
   lse = m + log l). Returns 0, or -1 (nothing read or written) when a block lies outside its stream
   or row_start is not ascending from 0, or -2 when out of memory. */
int confkv_codes_attention(const uint8_t *kraw, int64_t klen, const int64_t *koff, const int64_t *ktail,
                           const int64_t *klay, const uint8_t *vraw, int64_t vlen, const int64_t *voff,
                           const int64_t *vtail, const int64_t *vlay, const int64_t *row_start, int64_t n,
                           const int32_t *valid, int B, const float *q, int G, int bs, int H, int D, int chunk,
                           int threads, float *m, float *l, float *acc) {
    if (row_start[0] != 0 || row_start[B] != n) return -1;
    for (int r = 0; r < B; r++)
        if (row_start[r + 1] < row_start[r]) return -1;
    if (!blocks_inside(koff, ktail, klay[L_NBYTES], n, klen)
        || !blocks_inside(voff, vtail, vlay[L_NBYTES], n, vlen))
        return -1;
    int64_t items = 0;
    for (int r = 0; r < B; r++) items += H * ((row_start[r + 1] - row_start[r] + chunk - 1) / chunk);
    if (!items) return 0;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)items * 3);
    float *pm = (float *)malloc(sizeof(float) * (size_t)items * G * (2 + D));
    const int nthreads = threads > 0 ? threads : 1;
    uint8_t *join = (ktail || vtail) ? (uint8_t *)malloc((size_t)(nthreads * (klay[L_NBYTES] + vlay[L_NBYTES]))) : NULL;
    if (!first || !pm || ((ktail || vtail) && !join)) { free(first); free(pm); free(join); return -2; }
    int64_t it = 0;
    for (int r = 0; r < B; r++)
        for (int h = 0; h < H; h++)
            for (int64_t b = row_start[r]; b < row_start[r + 1]; b += chunk, it++) {
                first[3 * it] = r * H + h;
                first[3 * it + 1] = b;
                first[3 * it + 2] = b + chunk < row_start[r + 1] ? b + chunk : row_start[r + 1];
            }
    float *pl = pm + items * G, *pacc = pl + items * G;
    const fold_fn fold = pick_fold(klay, vlay, bs, D);
    const int RK = bs / (int)klay[L_GROUP], RV = D / (int)vlay[L_GROUP];
#pragma omp parallel num_threads(nthreads)
    {
        float sc[G * bs], kc[D * bs], vc[bs * D], ks[D * RK], km[D * RK], vs[bs * RV], vm[bs * RV], pmr[RV];
        scratch_t s = {sc, kc, vc, ks, km, vs, vm, pmr};
        uint8_t *kjoin = join ? join + (int64_t)THREAD_NUM * (klay[L_NBYTES] + vlay[L_NBYTES]) : NULL;
        uint8_t *vjoin = kjoin ? kjoin + klay[L_NBYTES] : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            const int rh = (int)first[3 * w], h = rh % H;
            const float *qh = q + (int64_t)rh * G * D;
            float *mo = pm + w * G, *lo = pl + w * G, *ao = pacc + w * G * D;
            for (int g = 0; g < G; g++) { mo[g] = -INFINITY; lo[g] = 0; }
            memset(ao, 0, sizeof(float) * (size_t)G * D);
            for (int64_t i = first[3 * w + 1]; i < first[3 * w + 2]; i++) {
                const uint8_t *kb = block_at(kraw, koff, kjoin ? ktail : NULL, klay[L_NBYTES], i, kjoin);
                const uint8_t *vb = block_at(vraw, voff, vjoin ? vtail : NULL, vlay[L_NBYTES], i, vjoin);
                fold(kb, klay, vb, vlay, qh, G, bs, H, D, h, valid[i], mo, lo, ao, &s);
            }
        }
    }
    for (int64_t w = 0; w < items; w++) {
        const int64_t rh = first[3 * w];
        for (int g = 0; g < G; g++) {
            const int64_t row = rh * G + g;
            merge(m + row, l + row, acc + row * D, pm[w * G + g], pl[w * G + g], pacc + (w * G + g) * D, D);
        }
    }
    free(first);
    free(pm);
    free(join);
    return 0;
}
