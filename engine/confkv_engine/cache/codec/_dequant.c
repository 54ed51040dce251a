/* Native decode of codec blocks (int8 / int4 / int2) straight into a gathered table, one pass.

   The PyTorch form (group_quant.dequantize_blocks) unpacks the bit fields, stacks them, converts
   the codes to fp32 in the block layout and multiplies-adds: four passes over every element of every
   frozen block, in every layer of every decode step. This reads each packed byte once and writes
   each element once, in the layout and dtype of the table it is gathered into.

   The arithmetic is the PyTorch path's to the bit: x = code * scale + min in fp32, rounded once
   (fma) where that path uses ATen's addcmul and twice where it multiplies and adds (nothing
   else is contracted: built with -ffp-contract=off), then fp32 -> bf16 round-to-nearest-even
   when the table is bf16 (finite values only; the codec refuses inf and nan).

   Plain C with a C ABI, loaded with ctypes (codec.native): no Python or PyTorch headers, so it
   builds in a second at install. Threads: OpenMP over blocks, as many as PyTorch uses. Attention
   straight from the codes, in the same library, is _codes.c. */

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(CONFKV_NO_CLONES)
#define CONFKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CONFKV_CLONES
#endif

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (finite inputs) */
    return (uint16_t)(u >> 16);
}

/* code * scale + min: fused (one rounding) where the PyTorch path uses addcmul (one group along the
   axis), two roundings where it multiplies and adds (several groups along the axis). */
static inline float mad(float code, float scale, float min, int fused) {
    return fused ? fmaf(code, scale, min) : code * scale + min;
}

/* One block's codes [groups_shape..., group] unpacked to uint8 in code order. */
static inline void unpack_codes(const uint8_t *src, uint8_t *dst, int64_t count, int bits) {
    if (bits == 8) {
        memcpy(dst, src, (size_t)count);
        return;
    }
    if (bits == 4) {  /* the usual case, spelled out so that it vectorises */
        for (int64_t i = 0; i < count / 2; i++) {
            dst[2 * i] = src[i] & 15u;
            dst[2 * i + 1] = src[i] >> 4;
        }
        return;
    }
    const int per = 8 / bits;
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    for (int64_t i = 0; i < count / per; i++) {
        uint8_t b = src[i];
        for (int k = 0; k < per; k++) dst[i * per + k] = (uint8_t)((b >> (bits * k)) & mask);
    }
}

/* Element (t, h, c) of a [bs, heads, dim] block (per layer): its code index and group index.
   axis 2 (values, grouped along dim): code (t*heads + h)*dim + c (the block order), group code/g.
   axis 0 (keys, grouped along tokens): code (h*dim + c)*bs + t, group (h*dim + c)*(bs/g) + t/g;
   the codes are transposed to the block order first (a few KB, in L1), so both loops run over
   contiguous memory and vectorise. */
CONFKV_CLONES
static void decode_block(const uint8_t *codes, const float *scales, const float *mins, float *out,
                         int axis, int bs, int heads, int dim, int group, int fused, uint8_t *tmp, float *st,
                         float *mt) {
    if (axis != 0) {
        const int groups = bs * heads * dim / group;
        for (int g = 0; g < groups; g++) {
            const float sc = scales[g], mn = mins[g];
            const uint8_t *c = codes + (int64_t)g * group;
            float *o = out + (int64_t)g * group;
            for (int j = 0; j < group; j++) o[j] = mad((float)c[j], sc, mn, fused);
        }
        return;
    }
    const int hd = heads * dim, per_row = bs / group;
    for (int hc = 0; hc < hd; hc++) {
        for (int t = 0; t < bs; t++) tmp[t * hd + hc] = codes[hc * bs + t];
        for (int r = 0; r < per_row; r++) {
            st[r * hd + hc] = scales[hc * per_row + r];
            mt[r * hd + hc] = mins[hc * per_row + r];
        }
    }
    for (int t = 0; t < bs; t++) {
        const float *sc = st + (t / group) * hd, *mn = mt + (t / group) * hd;
        const uint8_t *c = tmp + t * hd;
        float *o = out + t * hd;
        for (int hc = 0; hc < hd; hc++) o[hc] = mad((float)c[hc], sc[hc], mn[hc], fused);
    }
}

/* Decode n encoded blocks of one layer: raw uint8 [n, raw_stride] (codes first in each row),
   scales / mins fp32 [n, num_groups]; block i goes to row dst[i] of out (rows of bs*heads*dim
   elements; out_bf16: bf16 elements, else fp32); a negative dst[i] skips block i. */
void confkv_dequantize(const uint8_t *raw, int64_t raw_stride, const float *scales, const float *mins,
                       int64_t num_groups, void *out, int out_bf16, const int64_t *dst, int64_t n,
                       int bits, int axis, int bs, int heads, int dim, int group, int threads) {
    const int64_t elems = (int64_t)bs * heads * dim;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        uint8_t codes[elems], tmp[elems];
        float block[elems], st[elems], mt[elems];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (dst[i] < 0) continue;
            unpack_codes(raw + i * raw_stride, codes, elems, bits);
            float *target = out_bf16 ? block : (float *)out + dst[i] * elems;
            decode_block(codes, scales + i * num_groups, mins + i * num_groups, target, axis, bs, heads,
                         dim, group, group == (axis ? dim : bs), tmp, st, mt);
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + dst[i] * elems;
                for (int64_t e = 0; e < elems; e++) o[e] = to_bf16(block[e]);
            }
        }
    }
}

/* Keys (grouped along tokens, axis 0) decoded channel-major, fp32: element (h, c, t) of block i goes
   to out[(h*dim + c)*ld + dst[i]*bs + t], i.e. K^T [heads*dim, ld] as a score matmul reads it. The
   codes are stored channel-major already, so each channel's bs codes become bs contiguous floats
   (the token-major decode above transposes every block first, most of its time). Blocks go in runs
   of KEYS_RUN, channel by channel: a channel's row then receives one contiguous stretch per run
   (consecutive destinations, as a sequence's frozen blocks have) instead of one cache line per
   block, which measured as slow as the transpose. Same values as the token-major decode. */
#define KEYS_RUN 16

CONFKV_CLONES
static void decode_keys_run(const uint8_t *codes, int64_t elems, const float *scales, const float *mins,
                            int64_t num_groups, float *out, int64_t ld, const int64_t *dst, int run, int bs,
                            int hd, int group) {
    const int per_row = bs / group, fused = group == bs;
    for (int hc = 0; hc < hd; hc++) {
        for (int r = 0; r < run; r++) {
            if (dst[r] < 0) continue;
            const uint8_t *c = codes + r * elems + (int64_t)hc * bs;
            const float *sc = scales + r * num_groups + (int64_t)hc * per_row;
            const float *mn = mins + r * num_groups + (int64_t)hc * per_row;
            float *o = out + (int64_t)hc * ld + dst[r] * bs;
            if (per_row == 1) {
                for (int t = 0; t < bs; t++) o[t] = mad((float)c[t], sc[0], mn[0], fused);
            } else {
                for (int t = 0; t < bs; t++) o[t] = mad((float)c[t], sc[t / group], mn[t / group], fused);
            }
        }
    }
}

void confkv_dequantize_keys_cm(const uint8_t *raw, int64_t raw_stride, const float *scales, const float *mins,
                               int64_t num_groups, float *out, int64_t ld, const int64_t *dst, int64_t n,
                               int bits, int bs, int heads, int dim, int group, int threads) {
    const int64_t elems = (int64_t)bs * heads * dim, runs = (n + KEYS_RUN - 1) / KEYS_RUN;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        uint8_t codes[KEYS_RUN * elems];  /* unpacked codes of one run (48 KB for SmolLM2's blocks) */
#pragma omp for schedule(static)
        for (int64_t k = 0; k < runs; k++) {
            const int64_t i0 = k * KEYS_RUN;
            const int run = (int)(n - i0 < KEYS_RUN ? n - i0 : KEYS_RUN);
            for (int r = 0; r < run; r++) unpack_codes(raw + (i0 + r) * raw_stride, codes + r * elems, elems, bits);
            decode_keys_run(codes, elems, scales + i0 * num_groups, mins + i0 * num_groups, num_groups, out, ld,
                            dst + i0, run, bs, heads * dim, group);
        }
    }
}
