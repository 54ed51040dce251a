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
   builds in a second at install. Threads: OpenMP over blocks, as many as PyTorch uses. */

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

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
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

/* ---- Decode attention straight from the codes ------------------------------------------------

   One layer's attention of decode queries over their sequences' compressed blocks, never writing a
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
   build's -ffp-contract=off is for the decoder above). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#endif

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

static inline int six_at(const uint8_t *p, int64_t k) {
    const uint8_t *w = p + 3 * (k / 4);
    uint32_t word = (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16;
    return (int)((word >> (6 * (k % 4))) & 63u);
}

/* Group g's fp32 (scale, min) of one encoded block. */
static inline void group_param(const uint8_t *blk, const int64_t *lay, int64_t g, float *scale, float *min) {
    const uint8_t *p = blk + lay[L_OFFSET];
    if (!lay[L_DQ6]) {
        *scale = half_at(p, g);
        *min = half_at(p, lay[L_GROUPS] + g);
        return;
    }
    const int64_t row = g / lay[L_ROW_GROUPS], j = g % lay[L_ROW_GROUPS];
    const float top = half_at(p, 3 * row), floor_ = half_at(p, 3 * row + 1), step = half_at(p, 3 * row + 2);
    const uint8_t *codes = p + 6 * lay[L_ROWS] + row * lay[L_ROW_BYTES];
    *scale = top * exp2f((float)six_at(codes, 2 * j) * -0.125f);
    *min = floor_ + (float)six_at(codes, 2 * j + 1) * step;
}

/* Groups [first, first + count) of one block's fp32 (scale, min): fp16 ones in one straight
   (vectorised) pass, dq6 ones per group. */
static inline __attribute__((always_inline)) void group_params(const uint8_t *blk, const int64_t *lay,
                                                                int64_t first, int count,
                                                                float *restrict scale, float *restrict min) {
    if (lay[L_DQ6]) {
        for (int i = 0; i < count; i++) group_param(blk, lay, first + i, &scale[i], &min[i]);
        return;
    }
    const uint8_t *p = blk + lay[L_OFFSET] + 2 * first, *q = p + 2 * lay[L_GROUPS];
    for (int i = 0; i < count; i++) {
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

/* The codecs' usual shape, compiled per (key bits, value bits, head_dim) with constant loop bounds:
   16-token blocks, one key group per channel along the block (kg = bs), one value group per
   (token, head) along head_dim (vg = D). The generic form (run-time bounds) measured ~4x slower. */
#define FOLD_FIXED(KB, VB, DD)                                                                           \
    CONFKV_CLONES static void fold_##KB##_##VB##_##DD(                                                   \
        const uint8_t *kblk, const int64_t *klay, const uint8_t *vblk, const int64_t *vlay, const float *q, \
        int G, int bs, int H, int D, int h, int valid, float *m, float *l, float *acc, scratch_t *s) {    \
        (void)bs; (void)D;                                                                               \
        block_scores(kblk, klay, q, G, 16, DD, h, valid, s, KB, 16);                                     \
        block_values(vblk, vlay, G, 16, H, DD, h, valid, m, l, acc, s, VB, DD);                          \
    }
FOLD_FIXED(8, 8, 64)
FOLD_FIXED(4, 4, 64)
FOLD_FIXED(4, 2, 64)
FOLD_FIXED(2, 2, 64)
FOLD_FIXED(8, 8, 128)
FOLD_FIXED(4, 4, 128)
FOLD_FIXED(4, 2, 128)
FOLD_FIXED(2, 2, 128)

static fold_fn pick_fold(const int64_t *klay, const int64_t *vlay, int bs, int D) {
    if (bs != 16 || klay[L_GROUP] != bs || vlay[L_GROUP] != D || (D != 64 && D != 128)) return fold_any;
    const int64_t kb = klay[L_BITS], vb = vlay[L_BITS];
#define PICK(KB, VB)                                                                                     \
    if (kb == KB && vb == VB) return D == 64 ? fold_##KB##_##VB##_64 : fold_##KB##_##VB##_128;
    PICK(8, 8)
    PICK(4, 4)
    PICK(4, 2)
    PICK(2, 2)
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
int confkv_codes_abi(void) { return 2; }

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
