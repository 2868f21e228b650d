/* One llama-family decoder layer for the few rows of a decode step (batch 1, float32, CPU), in place on h.
 *
 * Why: with the weights read by selfspec_small_gemm, what is left of a step on a small model is the per-op
 * overhead of ~40 small tensor ops per layer (RMSNorm, rotary, cache writes, SDPA, SiLU, adds): as much time
 * as the matmuls on a 135M model. Here a layer is one call.
 *
 * The math is HF's llama layer (modeling_llama.py), also qwen2 and mistral:
 *   x = rms_norm(h) * ln1;  q, k, v = x Wqkv^T + bqkv;  q, k = rotary(q, k);  cache[pos0..pos0+T) = k, v
 *   h += softmax(scale * q K^T, causal and optional sliding window) V  Wo^T + bo
 *   x = rms_norm(h) * ln2;  g, u = x Wgu^T + bgu;  h += (silu(g) * u) Wd^T + bd
 * Rows of h sit at absolute positions pos0..pos0+T-1; row t attends keys j with j <= pos0+t and, with a window,
 * j > pos0+t-window (HF's sliding-window overlay). Sums run in float32 in an order of their own, like any BLAS;
 * the exactness tests compare whole decodes against HF generate.
 *
 * Tree attention (selfspec_decoder_layer_tree): the T rows are nodes of a draft tree, still written to cache slots
 * pos0..pos0+T-1, but their rotary positions (in cos/sin) follow their depth, and which of the last S slots
 * [kv_len-S, kv_len) a row sees is given by a (T, S) ancestor mask; every slot before kv_len-S (the committed
 * prefix, where slot == position) is visible. A window counts positions: prefix slot j is kept when
 * j > qpos[t] - window, and a tree slot when fewer than `window` visible tree slots lie from it up to the row
 * itself (the visible tree slots of a row are its root-to-node path, one position apart).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

int selfspec_small_gemm(const float *x, long ldx, int M, const float *w, int N, int K, float *y, long ldy,
                        const float *bias);

/* Mirrors QuantWeightC in quant_gemm.c (a weight stored in 8 or 4 bits). */
typedef struct {
    int kind;
    const void *q;
    const float *scale, *zero, *exact;
    int shortlist;
} QuantWeightC;
int selfspec_quant_gemm(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                        const float *bias);

/* Mirrors the ctypes Structure in selfspec/model/cpu_kernels.py (same field order). */
typedef struct {
    int hidden, q_heads, kv_heads, head_dim, inter;
    float eps1, eps2, scale;
    const float *ln1, *ln2;      /* (hidden) */
    const float *wqkv, *bqkv;    /* ((q_heads + 2 kv_heads) head_dim, hidden), bias or NULL */
    const float *wo, *bo;        /* (hidden, q_heads head_dim) */
    const float *wgu, *bgu;      /* (2 inter, hidden): gate rows then up rows */
    const float *wd, *bd;        /* (hidden, inter) */
    /* A low-precision copy of the same layer (the draft pass of head.draft_precision=int8|int4|int4_mlp): when set, these
     * replace wqkv, wo, wgu, wd (biases and norms stay float32). NULL: the float32 weights above. */
    const QuantWeightC *qqkv, *qo, *qgu, *qd;
} LayerWeights;

/* y = x W^T + b with W in float32 or in the layer's low-precision copy. */
static inline void layer_mm(const float *w, const QuantWeightC *qw, const float *x, long ldx, int M, int N, int K,
                            float *y, long ldy, const float *bias) {
    if (qw) selfspec_quant_gemm(x, ldx, M, qw, N, K, y, ldy, bias);
    else selfspec_small_gemm(x, ldx, M, w, N, K, y, ldy, bias);
}

/* Dot product and y += a x over n floats in 8 AVX2 lanes (the compiler would not reorder a float sum itself). */
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int n8 = n & ~7, i = 0;
    for (; i < n8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    float s = _mm_cvtss_f32(lo);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float a, const float *x, float *y, int n) {
    __m256 av = _mm256_set1_ps(a);
    int n8 = n & ~7, i = 0;
    for (; i < n8; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* e^x in 8 lanes, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness),
 * e^r by its degree-7 Taylor-like minimax polynomial (Cephes expf coefficients), 2^n through the exponent bits.
 * Scalar expf was a third of a K=4 verify layer's time outside the matmuls. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* x[i] = e^(x[i] - shift) for i < n; returns their sum. */
static inline float exp_shift_sum(float *x, long n, float shift) {
    __m256 sv = _mm256_set1_ps(shift), acc = _mm256_setzero_ps();
    long n8 = n & ~7L, i = 0;
    for (; i < n8; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float tail[8] = {0}, out[8];
    if (i < n) {
        for (long j = i; j < n; j++) tail[j - i] = x[j] - shift;
        _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(tail)));
        for (long j = i; j < n; j++) x[j] = out[j - i];
    }
    _mm256_storeu_ps(tail, acc);
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += tail[j];
    for (long j = i; j < n; j++) s += x[j];
    return s;
}

/* g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u. */
static inline void silu_mul(float *g, const float *u, int n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int n8 = n & ~7, i = 0;
    for (; i < n8; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

static void rms_norm_rows(const float *x, int T, int H, const float *w, float eps, float *y) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (ptrdiff_t)t * H;
        float ss = dot(xr, xr, H);
        float r = 1.f / sqrtf(ss / H + eps);
        for (int i = 0; i < H; i++) y[(ptrdiff_t)t * H + i] = w[i] * (xr[i] * r);
    }
}

/* HF's rotate_half convention: out = x * cos + cat(-x[D/2:], x[:D/2]) * sin. */
static void rotary(float *x, int D, const float *cos, const float *sin) {
    int half = D / 2;
    for (int d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        x[d] = a * cos[d] - b * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* ---- attention of one query row
 * Scores: each key's dot product accumulates over the head dimension in 8 lanes, chunk by chunk, and its lanes are
 * then summed as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). Eight keys at a time do that sum for all eight in one
 * transposing tree of horizontal adds (key_sums8); a key alone does it in scalar (key_sum1), in the same order, so a
 * key's score does not depend on which keys it was computed with (a verify's row and a decode step's agree).
 * Values: the output row stays in registers across the keys (64 dimensions at a time), o = fma(p_j, v_j, o) in key
 * order. Was: a horizontal sum per key and a load/store of the output per key, ~3x the time at a 700-token context. */
static inline float key_sum1(__m256 a) {
    float l[8];
    _mm256_storeu_ps(l, a);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static inline __m256 key_sums8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float key_score(const float *q, const float *k, int D) {
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(k + d), _mm256_loadu_ps(q + d), acc);
    return key_sum1(acc);
}

/* sc[i] = scale * q . k_j over the keys [lo, hi) then idx[0..n) (D % 8 == 0); returns their maximum. */
static inline float row_scores(const float *q, const float *kh, int D, float scale, long lo, long hi, const int *idx,
                               int n, float *sc) {
    float mx = -INFINITY;
    long j = lo;
    const __m256 sv = _mm256_set1_ps(scale);
    for (; j + 8 <= hi; j += 8) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kh + (j + i) * D + d), qv, acc[i]);
        }
        float out[8];
        _mm256_storeu_ps(out, _mm256_mul_ps(key_sums8(acc), sv));
        for (int i = 0; i < 8; i++) {
            sc[j - lo + i] = out[i];
            if (out[i] > mx) mx = out[i];
        }
    }
    for (; j < hi; j++) {
        sc[j - lo] = key_score(q, kh + j * D, D) * scale;
        if (sc[j - lo] > mx) mx = sc[j - lo];
    }
    for (int i = 0; i < n; i++) {
        float *s = sc + (hi - lo) + i;
        *s = key_score(q, kh + (ptrdiff_t)idx[i] * D, D) * scale;
        if (*s > mx) mx = *s;
    }
    return mx;
}

/* o = sum_j (sc_j / den) v_j over the same keys, in their order (D % 8 == 0). */
static inline void row_values(const float *vh, int D, long lo, long hi, const int *idx, int n, const float *sc,
                              float den, float *o) {
    const long np = hi - lo;
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nv = (D - d0 < 64 ? D - d0 : 64) / 8;
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (long j = 0; j < np + n; j++) {
            const float *v = vh + (j < np ? lo + j : (long)idx[j - np]) * D + d0;
            const __m256 p = _mm256_set1_ps(sc[j] / den);
            for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
    }
}

/* One row's attention over keys [lo, hi) then the n slots in idx (ascending); sc holds hi - lo + n floats. */
static inline void attend(const float *q, const float *kh, const float *vh, int D, float scale, long lo, long hi,
                          const int *idx, int n, float *sc, float *o) {
    const long np = hi - lo;
    if (D % 8 == 0) {
        const float mx = row_scores(q, kh, D, scale, lo, hi, idx, n, sc);
        row_values(vh, D, lo, hi, idx, n, sc, exp_shift_sum(sc, np + n, mx), o);
        return;
    }
    float mx = -INFINITY; /* a head size that is not a multiple of 8: one key at a time */
    for (long j = 0; j < np + n; j++) {
        sc[j] = dot(q, kh + (j < np ? lo + j : (long)idx[j - np]) * D, D) * scale;
        if (sc[j] > mx) mx = sc[j];
    }
    const float den = exp_shift_sum(sc, np + n, mx);
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (long j = 0; j < np + n; j++) axpy(sc[j] / den, vh + (j < np ? lo + j : (long)idx[j - np]) * D, o, D);
}

/* work must hold T * (hidden + qkv + q_heads*head_dim + 2*inter) + q_heads * T * (pos0 + T) floats, plus T * S
 * for the tree layer's key lists. qpos/tmask NULL: the causal layer. */
static int decoder_layer(const LayerWeights *L, float *h, int T, const float *cos, const float *sin, float *kc,
                         float *vc, long max_len, long pos0, long window, const long *qpos, const unsigned char *tmask,
                         long S, float *work) {
    const int H = L->hidden, Hq = L->q_heads, Hkv = L->kv_heads, D = L->head_dim, I = L->inter;
    const int QD = Hq * D, KD = Hkv * D, QKV = QD + 2 * KD, group = Hq / Hkv;
    const long kv_len = pos0 + T;
    float *xn = work, *qkv = xn + (ptrdiff_t)T * H, *att = qkv + (ptrdiff_t)T * QKV, *gu = att + (ptrdiff_t)T * QD;
    float *scores = gu + (ptrdiff_t)T * 2 * I;

    /* attention block */
    rms_norm_rows(h, T, H, L->ln1, L->eps1, xn);
    layer_mm(L->wqkv, L->qqkv, xn, H, T, QKV, H, qkv, QKV, L->bqkv);
    for (int t = 0; t < T; t++) {
        float *row = qkv + (ptrdiff_t)t * QKV;
        const float *c = cos + (ptrdiff_t)t * D, *s = sin + (ptrdiff_t)t * D;
        for (int hh = 0; hh < Hq + Hkv; hh++) rotary(row + (ptrdiff_t)hh * D, D, c, s); /* q heads, then k heads */
        for (int g = 0; g < Hkv; g++) {
            ptrdiff_t at = ((ptrdiff_t)g * max_len + pos0 + t) * D;
            memcpy(kc + at, row + QD + (ptrdiff_t)g * D, sizeof(float) * D);
            memcpy(vc + at, row + QD + KD + (ptrdiff_t)g * D, sizeof(float) * D);
        }
    }
    if (tmask) {
        /* Per row: the visible prefix range [lo[t], base) and the visible tree slots, ascending, in keys[t*S..]. */
        const long base = kv_len - S;
        int *keys = (int *)(scores + (ptrdiff_t)Hq * T * kv_len), *nkeys = keys + (ptrdiff_t)T * S, *lo = nkeys + T;
        for (int t = 0; t < T; t++) {
            const long p = qpos[t];
            long l = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
            lo[t] = (int)(l < base ? l : base);
            const unsigned char *m = tmask + (ptrdiff_t)t * S;
            int cnt = 0;
            for (long c = 0; c < S; c++) cnt += m[c] != 0;
            /* the visible tree slots are the row's path, one position apart: a window keeps its last `window` */
            const int n = (window > 0 && cnt > window) ? (int)window : cnt;
            int *kt = keys + (ptrdiff_t)t * S, seen = 0;
            for (long c = S - 1; c >= 0 && seen < n; c--)
                if (m[c]) kt[n - 1 - seen++] = (int)(base + c);
            nkeys[t] = n;
        }
#pragma omp parallel for schedule(static) collapse(2)
        for (int hq = 0; hq < Hq; hq++)
            for (int t = 0; t < T; t++) {
                const float *kh = kc + (ptrdiff_t)(hq / group) * max_len * D, *vh = vc + (ptrdiff_t)(hq / group) * max_len * D;
                attend(qkv + (ptrdiff_t)t * QKV + (ptrdiff_t)hq * D, kh, vh, D, L->scale, lo[t], base,
                       keys + (ptrdiff_t)t * S, nkeys[t], scores + ((ptrdiff_t)hq * T + t) * kv_len,
                       att + (ptrdiff_t)t * QD + (ptrdiff_t)hq * D);
            }
    } else {
#pragma omp parallel for schedule(static) collapse(2)
    for (int hq = 0; hq < Hq; hq++)
        for (int t = 0; t < T; t++) {
            const long p = pos0 + t;
            const long lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
            const float *kh = kc + (ptrdiff_t)(hq / group) * max_len * D, *vh = vc + (ptrdiff_t)(hq / group) * max_len * D;
            attend(qkv + (ptrdiff_t)t * QKV + (ptrdiff_t)hq * D, kh, vh, D, L->scale, lo, p + 1, NULL, 0,
                   scores + ((ptrdiff_t)hq * T + t) * kv_len, att + (ptrdiff_t)t * QD + (ptrdiff_t)hq * D);
        }
    }
    layer_mm(L->wo, L->qo, att, QD, T, H, QD, xn, H, L->bo); /* xn reused as the projection's output */
    for (ptrdiff_t i = 0; i < (ptrdiff_t)T * H; i++) h[i] += xn[i];

    /* MLP block */
    rms_norm_rows(h, T, H, L->ln2, L->eps2, xn);
    layer_mm(L->wgu, L->qgu, xn, H, T, 2 * I, H, gu, 2 * I, L->bgu);
    for (int t = 0; t < T; t++) {
        float *g = gu + (ptrdiff_t)t * 2 * I;
        silu_mul(g, g + I, I); /* silu(gate) * up, into the gate half */
    }
    layer_mm(L->wd, L->qd, gu, 2 * I, T, H, I, xn, H, L->bd);
    for (ptrdiff_t i = 0; i < (ptrdiff_t)T * H; i++) h[i] += xn[i];
    return 0;
}

int selfspec_decoder_layer(const LayerWeights *L, float *h, int T, const float *cos, const float *sin, float *kc,
                           float *vc, long max_len, long pos0, long window, float *work) {
    return decoder_layer(L, h, T, cos, sin, kc, vc, max_len, pos0, window, NULL, NULL, 0, work);
}

/* The tree layer: qpos (T) rotary positions (for the window), tmask (T, S) uint8 row-major ancestor mask over slots
 * [pos0+T-S, pos0+T), S in [T, pos0+T]. work additionally holds T*S + 2T floats (key lists). */
int selfspec_decoder_layer_tree(const LayerWeights *L, float *h, int T, const float *cos, const float *sin, float *kc,
                                float *vc, long max_len, long pos0, long window, const long *qpos,
                                const unsigned char *tmask, long S, float *work) {
    return decoder_layer(L, h, T, cos, sin, kc, vc, max_len, pos0, window, qpos, tmask, S, work);
}

/* A run of n layers in one call: what a decode step, a verify or a draft's layers < E does, without a trip back to
 * Python between layers (~0.1 ms per layer on a 2-vCPU EPYC, as much as a 135M model's int8 layer itself).
 * Layer i: weights Ls[i], cache buffers kc[i] / vc[i], window windows[i] (0 = none), rotary rows cos[kind[i]] /
 * sin[kind[i]] (a model's layer types may rotate differently). qpos/tmask/S as in the tree layer, or NULL/0 for
 * the causal one. work as for one layer (every layer of a stack has the same sizes). */
int selfspec_decoder_layers(const LayerWeights *const *Ls, int n, float *h, int T, const int *kind,
                            const float *const *cos, const float *const *sin, float *const *kc, float *const *vc,
                            long max_len, long pos0, const long *windows, const long *qpos, const unsigned char *tmask,
                            long S, float *work) {
    for (int i = 0; i < n; i++) {
        const int r = decoder_layer(Ls[i], h, T, cos[kind[i]], sin[kind[i]], kc[i], vc[i], max_len, pos0, windows[i],
                                    qpos, tmask, S, work);
        if (r) return r;
    }
    return 0;
}

/* Sampling inside the draft chain: the tempered softmax of a row of logits, cut to its top-p nucleus (the fewest
 * most probable tokens whose mass reaches top_p, as sampling.process_logits: a token stays while the mass before it
 * is below top_p) and renormalized, in q; then the index drawn from q by inverse CDF with the uniform u. Tokens under
 * (1 - top_p) / V hold less than 1 - top_p of the mass together, so the nucleus lies among the others: only they are
 * sorted. `cand` holds V (prob, index) pairs. */
typedef struct {
    float p;
    int i;
} ProbIdx;

static int by_prob_desc(const void *a, const void *b) {
    const float x = ((const ProbIdx *)a)->p, y = ((const ProbIdx *)b)->p;
    return (x < y) - (x > y);
}

static long sample_row(const float *logits, int V, float temperature, float top_p, float u, float *q, ProbIdx *cand) {
    float mx = logits[0];
    for (int j = 1; j < V; j++)
        if (logits[j] > mx) mx = logits[j];
    const float inv = 1.f / temperature;
    for (int j = 0; j < V; j++) q[j] = logits[j] * inv;
    const float norm = 1.f / exp_shift_sum(q, V, mx * inv);
    for (int j = 0; j < V; j++) q[j] *= norm;
    if (top_p < 1.f) {
        const float floor = (1.f - top_p) / (float)V;
        int n = 0;
        for (int j = 0; j < V; j++)
            if (q[j] >= floor) cand[n++] = (ProbIdx){q[j], j};
        qsort(cand, (size_t)n, sizeof *cand, by_prob_desc);
        float mass = 0.f;
        int keep = 0;
        while (keep < n && (keep == 0 || mass < top_p)) mass += cand[keep++].p;
        memset(q, 0, sizeof(float) * V);
        for (int k = 0; k < keep; k++) q[cand[k].i] = cand[k].p / mass;
    }
    float acc = 0.f;
    long last = 0;
    for (int j = 0; j < V; j++) {
        if (q[j] <= 0.f) continue;
        acc += q[j];
        last = j;
        if (acc > u) return j;
    }
    return last; /* u above the rounded total */
}

/* A greedy draft chain in one call: `count` drafts, each the argmax of the model's own final norm + LM head on the
 * state after the n layers, fed back as the next step's token. Step s embeds tokens[pos0+s] at cache slot pos0+s,
 * runs the layers there (writing their K/V, attending over [0, pos0+s]), and writes its draft's token id to
 * tokens[pos0+s+1] (vocab_ids[index] with a draft vocabulary, else the index): greedy (temperature 0) the first of
 * equal maxima, as torch.argmax; sampled (temperature > 0) a draw with uniforms[s] from the processed distribution
 * (sample_row), which goes to q_out row s (count, V) for the accept test.
 * Why: a draft step of a 135M model's int8 layers reads ~130 MB of weights in ~7 ms, and the Python between the
 * steps (embedding, rotary, norm, LM head, argmax, the next call) cost another 1.2-2 ms (a 2-vCPU EPYC, measured
 * in the decode loop).
 * cos/sin[kind]: (count, head_dim) rows for positions pos0.. ; embed: (V_model, hidden); lm: (V, hidden) as lm_q or
 * lm_w, bias lm_b or NULL; hidden_out: (count, hidden) states after the layers, or NULL. work: the stack's work for
 * one row at kv_len = pos0 + count, plus 2 hidden + V floats (+ 2 V when sampling). */
int selfspec_draft_chain(const LayerWeights *const *Ls, int n, const int *kind, const float *const *cos,
                         const float *const *sin, float *const *kc, float *const *vc, long max_len, const long *windows,
                         const float *embed, const float *norm_w, float eps, const QuantWeightC *lm_q,
                         const float *lm_w, const float *lm_b, int V, const long *vocab_ids, long pos0, long *tokens,
                         int count, float temperature, float top_p, const float *uniforms, float *q_out,
                         float *hidden_out, float *work) {
    const int H = Ls[0]->hidden, D = Ls[0]->head_dim;
    float *h = work, *hn = h + H, *logits = hn + H;
    ProbIdx *cand = (ProbIdx *)(logits + V);
    float *lw = logits + V + (temperature > 0.f ? 2 * (ptrdiff_t)V : 0);
    for (int s = 0; s < count; s++) {
        memcpy(h, embed + (ptrdiff_t)tokens[pos0 + s] * H, sizeof(float) * H);
        for (int i = 0; i < n; i++) {
            const int r = decoder_layer(Ls[i], h, 1, cos[kind[i]] + (ptrdiff_t)s * D, sin[kind[i]] + (ptrdiff_t)s * D,
                                        kc[i], vc[i], max_len, pos0 + s, windows[i], NULL, NULL, 0, lw);
            if (r) return r;
        }
        if (hidden_out) memcpy(hidden_out + (ptrdiff_t)s * H, h, sizeof(float) * H);
        rms_norm_rows(h, 1, H, norm_w, eps, hn);
        layer_mm(lm_w, lm_q, hn, H, 1, V, H, logits, V, lm_b);
        long best = 0;
        if (temperature > 0.f) {
            best = sample_row(logits, V, temperature, top_p, uniforms[s], q_out + (ptrdiff_t)s * V, cand);
        } else {
            for (long j = 1; j < V; j++)
                if (logits[j] > logits[best]) best = j;
        }
        tokens[pos0 + s + 1] = vocab_ids ? vocab_ids[best] : best;
    }
    return 0;
}

/* A context head's draft chain (heads/context.py) in one call: what HeadChain's passes of
 * EarlyExitDrafter.draft_logits + ContextHead compute, its dynamic-K rule included, without Python between them.
 * Why: a context head's draft step is ~0.4 ms of C (its layer, fc, an 8,192-row readout) inside ~1.3 ms of Python
 * (norms, concatenation, rotary rows, the kernel's weight checks, the readout's dispatch), and the target's layers
 * < E for each new row is one more trip (a 2-vCPU EPYC, measured in the decode loop).
 * p0: the round's first row (the last committed token); drafts go to tokens[p0+1 ..].
 *  1. Layers [0, E) (Ls, the target's cache) over tokens[early .. p0] -> hidden rows early .. p0 (none: E = 0,
 *     the rows are the embeddings).
 *  2. The head over rows seen .. p0 in one batch: x_r = fc([rms(hidden_r) * nh, rms(feats_{r-1}) * nf]) (feats_{-1}
 *     = 0), then its layers HLs over its own cache (hkc / hvc); feats_r = x_r where r >= real_upto (a verified
 *     feature is never overwritten). Every row's feats_{r-1} must be known: real_upto >= p0.
 *  3. Step s (row p = p0 + s): the row's x -> final norm -> readout (V rows) -> the argmax (first of equal maxima)
 *     and conf, its softmax probability. conf < threshold: stop without it. Else tokens[p+1] = the draft (vocab_ids
 *     mapped), layers [0, E) over it (verification reads its layer-E state), joint *= conf; stop when joint < cont
 *     or s + 1 == count; else the head's row p+1 reads hidden_{p+1} and feats_p (its own prediction): step s + 1.
 * cos/sin[kind] and hcos/hsin: rotary rows (.., head_dim) from position `base` = min(early, seen) on.
 * Sampled (temperature > 0): each draft is drawn with uniforms[s] from the tempered softmax cut to its top-p nucleus
 * (sample_row), which goes to q_out row s (count, V), and conf is that distribution's largest probability (as
 * HeadChain's pick); the row of a draft that the threshold stops is written but not used.
 * out[0] = drafts made, out[1] = head rows stepped (draft passes). work: T (3 hidden) + hidden + V floats (+ 2 V
 * when sampling), then what the largest layer needs for T = max(p0 + 1 - early, p0 + 1 - seen, 1) rows at
 * kv_len = p0 + count + 1. */
int selfspec_context_chain(const LayerWeights *const *Ls, int n, const int *kind, const float *const *cos,
                           const float *const *sin, float *const *kc, float *const *vc, long max_len,
                           const long *windows, const float *embed, const float *nh, const float *nf, float head_eps,
                           const QuantWeightC *fc_q, const float *fc_w, const LayerWeights *const *HLs, int hn,
                           float *const *hkc, float *const *hvc, long hmax_len, const float *hcos, const float *hsin,
                           const float *norm_w, float eps, const QuantWeightC *lm_q, const float *lm_w,
                           const float *lm_b, int V, const long *vocab_ids, long *tokens, float *hidden, float *feats,
                           long base, long early, long seen, long real_upto, long p0, int count, float threshold,
                           float cont, float temperature, float top_p, const float *uniforms, float *q_out, long *out,
                           float *work) {
    const int H = HLs[0]->hidden, D = HLs[0]->head_dim;
    const long Te = p0 + 1 - early, Th = p0 + 1 - seen;
    if (Te < 0 || Th < 1 || early < base || seen < base || real_upto < p0 || count < 1) return -1;
    float *xin = work, *x = xin + (ptrdiff_t)Th * 2 * H, *hn_ = x + (ptrdiff_t)Th * H, *logits = hn_ + H;
    ProbIdx *cand = (ProbIdx *)(logits + V);
    float *lw = logits + V + (temperature > 0.f ? 2 * (ptrdiff_t)V : 0);
    /* 1. layers < E over the rows not yet run */
    for (long r = early; r <= p0; r++) memcpy(hidden + r * H, embed + (ptrdiff_t)tokens[r] * H, sizeof(float) * H);
    if (Te > 0)
        for (int i = 0; i < n; i++) {
            const int rc = decoder_layer(Ls[i], hidden + early * H, (int)Te, cos[kind[i]] + (early - base) * D,
                                         sin[kind[i]] + (early - base) * D, kc[i], vc[i], max_len, early, windows[i],
                                         NULL, NULL, 0, lw);
            if (rc) return rc;
        }
    long lo = seen, T = Th, drafts = 0, steps = 0;
    float joint = 1.f;
    for (int s = 0;; s++) {
        /* 2. the head over rows lo .. lo+T-1 */
        for (long t = 0; t < T; t++) {
            const long r = lo + t;
            float *in = xin + t * 2 * H;
            rms_norm_rows(hidden + r * H, 1, H, nh, head_eps, in);
            if (r > 0) rms_norm_rows(feats + (r - 1) * H, 1, H, nf, head_eps, in + H);
            else memset(in + H, 0, sizeof(float) * H);
        }
        layer_mm(fc_w, fc_q, xin, 2 * H, (int)T, H, 2 * H, x, H, NULL);
        for (int i = 0; i < hn; i++) {
            const int rc = decoder_layer(HLs[i], x, (int)T, hcos + (lo - base) * D, hsin + (lo - base) * D, hkc[i],
                                         hvc[i], hmax_len, lo, 0, NULL, NULL, 0, lw);
            if (rc) return rc;
        }
        for (long t = 0; t < T; t++)
            if (lo + t >= real_upto) memcpy(feats + (lo + t) * H, x + t * H, sizeof(float) * H);
        steps++;
        /* 3. the draft after row p = lo + T - 1 */
        const long p = lo + T - 1;
        rms_norm_rows(x + (T - 1) * H, 1, H, norm_w, eps, hn_);
        layer_mm(lm_w, lm_q, hn_, H, 1, V, H, logits, V, lm_b);
        long best = 0;
        float conf;
        if (temperature > 0.f) {
            float *q = q_out + (ptrdiff_t)s * V;
            best = sample_row(logits, V, temperature, top_p, uniforms[s], q, cand);
            conf = q[0];
            for (long j = 1; j < V; j++)
                if (q[j] > conf) conf = q[j];
        } else {
            for (long j = 1; j < V; j++)
                if (logits[j] > logits[best]) best = j;
            conf = 1.f / exp_shift_sum(logits, V, logits[best]);
        }
        if (threshold > 0.f && conf < threshold) break;
        tokens[p + 1] = vocab_ids ? vocab_ids[best] : best;
        drafts++;
        float *h = hidden + (p + 1) * H;
        memcpy(h, embed + (ptrdiff_t)tokens[p + 1] * H, sizeof(float) * H);
        for (int i = 0; i < n; i++) {
            const int rc = decoder_layer(Ls[i], h, 1, cos[kind[i]] + (p + 1 - base) * D, sin[kind[i]] + (p + 1 - base) * D,
                                         kc[i], vc[i], max_len, p + 1, windows[i], NULL, NULL, 0, lw);
            if (rc) return rc;
        }
        joint *= conf;
        if ((cont > 0.f && joint < cont) || s + 1 == count) break;
        lo = p + 1;
        T = 1;
    }
    out[0] = drafts;
    out[1] = steps;
    return 0;
}
