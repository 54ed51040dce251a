/* Decode attention straight from the codes of compressed KV blocks (int8 / int4 / int2, k4v2): part
   of the codec's native library (_dequant.c holds the block decoder), loaded with ctypes by
   codec.native. Plain C with a C ABI, OpenMP over work items where the compiler has it. */

#include "_codes.h"
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

/* exp2f(k * -1/8) for the 64 dq6 scale codes (_codes.h). */
float confkv_dq6_octaves[64];

__attribute__((constructor)) static void fill_dq6_octaves(void) {
    for (int k = 0; k < 64; k++) confkv_dq6_octaves[k] = exp2f((float)k * -0.125f);
}

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
   extension, compiled for x86-64-v3; _codes_vec.c), since the array form was bound by its dependency
   chains, not by arithmetic (perf annotate at 8 x 2,048 under conf-kv+tiers: the key scores one multiply-add chain
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
FOLD_SHAPES(FOLD_FIXED)

static int vector_folds = -1; /* -1: not chosen yet */

/* Whether the vector folds run: on >= 0 asks for them (1) or the array ones (0; the tests run both on
   one machine), on < 0 only asks. They run only where the CPU has x86-64-v3. */
int confkv_codes_vector_folds(int on) {
#if CONFKV_VECTOR_FOLDS
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
#define PICK(KB, VB) \
    if (kb == KB && vb == VB) return FOLD_BY_DIM(fold_, KB, VB, D);
#if CONFKV_VECTOR_FOLDS
    const fold_fn vector = confkv_codes_vector_folds(-1) ? confkv_codes_vector_fold(kb, vb, D) : NULL;
    if (vector) return vector;
#endif
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
