/* Prototype, measured by bench.micro.codes_attention (not used by the engine): decode attention of one
   sequence over its int4 frozen blocks straight from the codes, never writing a decoded element.
   Keys are grouped per channel along the block's tokens (k = ks[h,c] * code + km[h,c]), so a block's
   scores are (q * ks) . codes + q . km; values per token along head_dim (v = vs[t,h] * code + vm[t,h]),
   so its output is (p * vs) . codes + p . vm. Online softmax over blocks (running max, sum, weighted
   sum), split-K over chunks of blocks merged by log-sum-exp. Limits: G <= 8, D <= 128, bs <= 16. */
#include <stdint.h>
#include <math.h>
#include <string.h>
/* Partial attention of G queries (one KV head h) over n int4 blocks straight from codes.
   K codes block: [Hkv, D, bs] packed 2/byte; k = ks[h,c]*code + km[h,c] per block.
   V codes block: [bs, Hkv, D] packed; v = vs[t,h]*code + vm[t,h].
   out: m[G], l[G], acc[G, D] (unnormalised). */
__attribute__((target_clones("arch=x86-64-v3","default")))
static void pa(const uint8_t *kraw, int64_t kstride, const float *ks, const float *km,
        const uint8_t *vraw, int64_t vstride, const float *vs, const float *vm,
        const float *q, int G, int n, int bs, int H, int D, int h, float scale,
        float *mo, float *lo, float *acc) {
    float qs[8*128], qm[8], sc[8*16], kc[128*16], vc[16*128];
    float m[8], l[8];
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0; for (int c = 0; c < D; c++) acc[g*D+c] = 0; }
    for (int b = 0; b < n; b++) {
        const uint8_t *kc8 = kraw + b*kstride + (int64_t)h*D*bs/2;
        for (int i = 0; i < D*bs/2; i++) { uint8_t x = kc8[i]; kc[2*i] = x & 15; kc[2*i+1] = x >> 4; }
        const float *s = ks + ((int64_t)b*H + h)*D, *mn = km + ((int64_t)b*H + h)*D;
        for (int g = 0; g < G; g++) {
            float a = 0;
            for (int c = 0; c < D; c++) { float qq = q[g*D+c]*scale; qs[g*D+c] = qq*s[c]; a += qq*mn[c]; }
            qm[g] = a;
            for (int t = 0; t < bs; t++) sc[g*bs+t] = a;
            for (int c = 0; c < D; c++) { float w = qs[g*D+c]; const float *kr = kc + c*bs;
                for (int t = 0; t < bs; t++) sc[g*bs+t] += w*kr[t]; }
        }
        for (int t = 0; t < bs; t++) {
            const uint8_t *v8 = vraw + b*vstride + ((int64_t)t*H + h)*D/2;
            for (int i = 0; i < D/2; i++) { uint8_t x = v8[i]; vc[t*D+2*i] = x & 15; vc[t*D+2*i+1] = x >> 4; }
        }
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            for (int t = 0; t < bs; t++) mx = fmaxf(mx, sc[g*bs+t]);
            float corr = expf(m[g] - mx); l[g] *= corr;
            float *o = acc + g*D;
            for (int c = 0; c < D; c++) o[c] *= corr;
            float pm = 0;
            for (int t = 0; t < bs; t++) {
                float p = expf(sc[g*bs+t] - mx); l[g] += p;
                float ps = p*vs[((int64_t)b*bs + t)*H + h]; pm += p*vm[((int64_t)b*bs + t)*H + h];
                const float *vr = vc + t*D;
                for (int c = 0; c < D; c++) o[c] += ps*vr[c];
            }
            for (int c = 0; c < D; c++) o[c] += pm;
            m[g] = mx;
        }
    }
    for (int g = 0; g < G; g++) { mo[g] = m[g]; lo[g] = l[g]; }
}
/* All heads, split-K in `parts` chunks of blocks, parallel over (head, chunk), merged by LSE. */
void pa_all(const uint8_t *kraw, int64_t kstride, const float *ks, const float *km,
            const uint8_t *vraw, int64_t vstride, const float *vs, const float *vm,
            const float *q, int G, int n, int bs, int H, int D, float scale, int parts, int threads,
            float *out /* [H, G, D] */) {
    float mo[H * parts * G], lo[H * parts * G], acc[H * parts * G * D];
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int w = 0; w < H * parts; w++) {
        int h = w / parts, p = w % parts, b0 = (int64_t)n * p / parts, b1 = (int64_t)n * (p + 1) / parts;
        pa(kraw + b0 * kstride, kstride, ks + (int64_t)b0 * H * D, km + (int64_t)b0 * H * D,
           vraw + b0 * vstride, vstride, vs + (int64_t)b0 * bs * H, vm + (int64_t)b0 * bs * H,
           q + (int64_t)h * G * D, G, b1 - b0, bs, H, D, h, scale, mo + w * G, lo + w * G, acc + (int64_t)w * G * D);
    }
    for (int h = 0; h < H; h++) for (int g = 0; g < G; g++) {
        float mx = -INFINITY, l = 0;
        for (int p = 0; p < parts; p++) mx = fmaxf(mx, mo[(h * parts + p) * G + g]);
        float *o = out + ((int64_t)h * G + g) * D;
        for (int c = 0; c < D; c++) o[c] = 0;
        for (int p = 0; p < parts; p++) {
            int w = h * parts + p; float e = expf(mo[w * G + g] - mx); l += e * lo[w * G + g];
            for (int c = 0; c < D; c++) o[c] += e * acc[((int64_t)w * G + g) * D + c];
        }
        for (int c = 0; c < D; c++) o[c] /= l;
    }
}
