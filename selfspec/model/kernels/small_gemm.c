/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in float32 for the few rows of a decode step.
 *
 * Why: a decode step multiplies 1..K+1 rows by every weight matrix, so it is bound by reading the weights.
 * MKL's sgemm with 2-9 rows reads them at a fraction of the memory bandwidth and its 1-row gemv does not
 * use the second core on this machine kind; verifying K+1 tokens then costs ~2x one step instead of ~1x.
 * This kernel streams each weight row once, keeps R rows x M inputs of partial sums in AVX2 registers,
 * and splits the output rows over OpenMP threads (the same libgomp torch uses).
 *
 * Each output is one dot product over K accumulated in 8 lanes, then summed across lanes: a summation order
 * of its own, like any BLAS. The engine's exactness tests compare whole decodes against HF generate.
 */
#include <immintrin.h>
#include <stddef.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* R weight rows (w + r*K) against M input rows (x + m*ldx); K8 = K rounded down to 8, tail done in scalar. */
#define BLOCK(R, M)                                                                                   \
    static inline void block_##R##_##M(const float *x, ptrdiff_t ldx, const float *w, int K, float *y,  \
                                       ptrdiff_t ldy, const float *bias) {                            \
        __m256 acc[R][M];                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                              \
        int K8 = K & ~7, k = 0;                                                                       \
        for (; k < K8; k += 8) {                                                                      \
            __m256 xv[M];                                                                             \
            for (int m = 0; m < M; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);                     \
            for (int r = 0; r < R; r++) {                                                             \
                __m256 wv = _mm256_loadu_ps(w + (ptrdiff_t)r * K + k);                                \
                for (int m = 0; m < M; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);        \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int m = 0; m < M; m++) {                                                             \
                float s = hsum(acc[r][m]);                                                            \
                for (int kk = K8; kk < K; kk++) s += w[(ptrdiff_t)r * K + kk] * x[m * ldx + kk];       \
                if (bias) s += bias[r];                                                               \
                y[m * ldy + r] = s;                                                                   \
            }                                                                                         \
    }

BLOCK(1, 1) BLOCK(1, 2) BLOCK(1, 3) BLOCK(1, 4) BLOCK(1, 5) BLOCK(1, 6) BLOCK(1, 7) BLOCK(1, 8)
BLOCK(2, 1) BLOCK(2, 2) BLOCK(2, 3) BLOCK(2, 4) BLOCK(2, 5) BLOCK(2, 6)
BLOCK(4, 1) BLOCK(4, 2) BLOCK(4, 3)

#ifndef ROWS_FOR
/* Weight rows per block for M input rows: enough independent FMA chains to hide latency, within 16 ymm registers. */
#define ROWS_FOR(M) ((M) <= 2 ? 4 : 1)
#endif

typedef void (*block_fn)(const float *, ptrdiff_t, const float *, int, float *, ptrdiff_t, const float *);

static block_fn pick(int R, int M) {
    switch (R * 16 + M) {
        case 16 + 1: return block_1_1; case 16 + 2: return block_1_2; case 16 + 3: return block_1_3;
        case 16 + 4: return block_1_4; case 16 + 5: return block_1_5; case 16 + 6: return block_1_6;
        case 16 + 7: return block_1_7; case 16 + 8: return block_1_8;
        case 32 + 1: return block_2_1; case 32 + 2: return block_2_2; case 32 + 3: return block_2_3;
        case 32 + 4: return block_2_4; case 32 + 5: return block_2_5; case 32 + 6: return block_2_6;
        case 64 + 1: return block_4_1; case 64 + 2: return block_4_2; case 64 + 3: return block_4_3;
    }
    return 0;
}

/* Entry point: x (M, K) with row stride ldx, w (N, K) contiguous, y (M, N) with row stride ldy, bias (N) or NULL.
 * Threads split the weight rows; each block of R weight rows is multiplied with every group of up to 8 input
 * rows while it sits in L1, so the weights are read from memory once whatever M is. Returns 0. */
int selfspec_small_gemm(const float *x, long ldx, int M, const float *w, int N, int K, float *y, long ldy,
                        const float *bias) {
    int R = ROWS_FOR(M < 8 ? M : 8);
    int groups = (M + 7) / 8, last = M - 8 * (groups - 1);
    block_fn full = pick(R, M < 8 ? M : 8), tail = pick(R, last), full1 = pick(1, M < 8 ? M : 8), tail1 = pick(1, last);
    int nblocks = N / R;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        int n = b * R;
        const float *wb = w + (ptrdiff_t)n * K;
        const float *bb = bias ? bias + n : NULL;
        for (int g = 0; g < groups; g++)
            (g < groups - 1 ? full : tail)(x + (ptrdiff_t)8 * g * ldx, ldx, wb, K, y + (ptrdiff_t)8 * g * ldy + n, ldy, bb);
    }
    for (int n = nblocks * R; n < N; n++) /* leftover rows, one at a time */
        for (int g = 0; g < groups; g++)
            (g < groups - 1 ? full1 : tail1)(x + (ptrdiff_t)8 * g * ldx, ldx, w + (ptrdiff_t)n * K, K,
                                             y + (ptrdiff_t)8 * g * ldy + n, ldy, bias ? bias + n : NULL);
    return 0;
}
