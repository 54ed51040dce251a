/* The SIMD body of _q4matmul.c, included once per ISA with SUFFIX (the path's name) and DOT32
   (its 32-element u8 x s8 -> 8 x int32 dot) defined, under that ISA's target options. Not a
   public header: it relies on the including file's types (Weights, Acts) and helpers. */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

static inline float FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> 32 codes in element order: the low nibbles are elements 0..15, the high
   ones 16..31, so the low half of the register takes the low nibbles. */
static inline __m256i FN(unpack32)(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b); /* one mask for both halves */
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* offset_term, 8 groups per step: a scalar loop is one long chain of dependent adds, which at one
   activation row cost about as much as the integer dots themselves. */
static inline float FN(offsets)(const Weights *w, int64_t n, const Acts *a, int64_t r) {
    const int64_t groups = w->k / GROUP;
    const float *z = w->z + n * groups, *d = w->d + n * groups;
    const float *sum = a->sum + r * groups, *corr = a->corr + r * groups;
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(z + g), _mm256_loadu_ps(sum + g), acc);
        acc = _mm256_fnmadd_ps(_mm256_loadu_ps(d + g), _mm256_loadu_ps(corr + g), acc);
    }
    float t = FN(hsum)(acc);
    for (; g < groups; g++) t += z[g] * sum[g] - d[g] * corr[g];
    return t;
}

/* Weight row n against activation rows r0 .. r0 + rows - 1 (rows <= TILE, a constant at each
   call site once inlined, so the accumulators stay in registers). Two accumulators per row
   alternate between even and odd groups: one row alone would otherwise wait on the latency of
   its previous fma every group. */
static inline __attribute__((always_inline)) void FN(tile_body)(
    const Weights *w, int64_t n, const Acts *a, int64_t r0, const int rows, float *out) {
    const int64_t k = w->k, groups = k / GROUP;
    const uint8_t *wq = w->q + n * (k / 2);
    const float *wd = w->d + n * groups;
    __m256 acc[2][TILE];
    for (int r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i wv = FN(unpack32)(wq + g * 16);
        for (int r = 0; r < rows; r++) {
            const int8_t *aq = a->q + (r0 + r) * k + g * GROUP;
            const __m256i av = _mm256_loadu_si256((const __m256i *)aq);
            const __m256 scale = _mm256_set1_ps(wd[g] * a->s[(r0 + r) * groups + g]);
            acc[g & 1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT32(wv, av)), scale, acc[g & 1][r]);
        }
    }
    for (int r = 0; r < rows; r++)
        out[r] = FN(hsum)(_mm256_add_ps(acc[0][r], acc[1][r])) + FN(offsets)(w, n, a, r0 + r);
}

static void FN(row_tile)(const Weights *w, int64_t n, const Acts *a, int64_t r0, int rows,
                         float *out) {
    switch (rows) {
    case 1: FN(tile_body)(w, n, a, r0, 1, out); break;
    case 2: FN(tile_body)(w, n, a, r0, 2, out); break;
    case 3: FN(tile_body)(w, n, a, r0, 3, out); break;
    default: FN(tile_body)(w, n, a, r0, TILE, out); break;
    }
}

#undef FN
#undef CAT
#undef CAT_
