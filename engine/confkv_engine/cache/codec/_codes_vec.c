/* Decode attention from the codes in 8-lane vectors (GCC's vector extension, compiled for x86-64-v3):
   the folds of the codecs' usual shape (16-token blocks, key groups along the block, value groups
   along head_dim); _codes.c says why this form exists and picks it where the CPU has AVX2 / FMA /
   F16C. */

#include "_codes.h"

#if CONFKV_VECTOR_FOLDS

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

fold_fn confkv_codes_vector_fold(int64_t kb, int64_t vb, int D) {
#define PICK(KB, VB) \
    if (kb == KB && vb == VB) return FOLD_BY_DIM(vfold_, KB, VB, D);
    PICK(8, 8)
    PICK(4, 4)
    PICK(4, 2)
    PICK(2, 2)
#undef PICK
    return NULL;
}
#endif
