/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in float32 for the few rows of a decode step.
 *
 * Why: a decode step multiplies 1..K+1 rows by every weight matrix, so it is bound by reading the weights.
 * MKL's sgemm with 2-9 rows reads them at a fraction of the memory bandwidth and its 1-row gemv does not
 * use the second core on this machine kind; verifying K+1 tokens then costs ~2x one step instead of ~1x.
 * This kernel streams each weight row once, keeps R weight rows x M input rows of partial sums in vector
 * registers, and splits the output rows over OpenMP threads (the same libgomp torch uses).
 *
 * Two instruction sets, chosen when the library is first called (selfspec_gemm_isa): AVX2 (8 lanes, 16 registers)
 * everywhere the library runs, and AVX-512 (16 lanes, 32 registers: R x M blocks of 20-24 accumulators, enough
 * independent FMA chains to keep both FMA units busy) where the CPU has it. With 5 rows (a K=4 verify) AVX2 fits
 * only R=1, five chains for two 4-cycle FMA units, so the extra rows of a verify cost compute that AVX-512 hides
 * under the weight reads.
 *
 * How the weights are walked depends on the CPU, so it is two settings: blocks of R rows read side by side with a
 * software prefetch into L1 (tuned on a Xeon) or into L2 only (selfspec_gemm_prefetch_level), and, for calls of up
 * to `stream_rows` input rows, one weight row at a time front to back with no software prefetch, which the hardware
 * prefetcher follows (selfspec_gemm_stream_rows). On a 2-core AMD EPYC (Zen 4) prefetching into L1 left the reads
 * and the FMAs of a multi-row call serialized (7 rows cost 1.8x the fastest one-row call there); into L2 they
 * overlap and 2-8 rows cost about what one row costs, at the bare read rate. gemm_tuning.py measures which applies on the machine
 * at hand (BENCHMARKS.md).
 *
 * Each output is one dot product over K accumulated in 8 (AVX2) or 16 (AVX-512) lanes, then summed across lanes:
 * a summation order of its own, like any BLAS, and the same whichever way the weights are walked (R and the stream
 * setting change the order of the reads, not of any sum). The engine's exactness tests compare whole decodes against
 * HF generate.
 */
#include <immintrin.h>
#include <stddef.h>

/* Software prefetch distance, in floats (16 KB): the weights a block reads this far ahead are requested while it
 * computes. Without it the reads and the FMAs of a multi-row call did not overlap on the machine this was tuned on
 * (a Xeon with 2 cores): 5 rows cost 1.55x one row over 283 MB of weights; with it 1.15x, and one row 10% less. */
#ifndef PREFETCH
#define PREFETCH 4096
#endif

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* R weight rows (w + r*K) against M input rows (x + m*ldx); K8 = K rounded down to 8, tail done in scalar. */
#define BLOCK(R, M, SUF, HINT, PF)                                                                    \
    static inline void block##SUF##_##R##_##M(const float *x, ptrdiff_t ldx, const float *w, int K, float *y,  \
                                       ptrdiff_t ldy, const float *bias) {                            \
        __m256 acc[R][M];                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                              \
        int K8 = K & ~7, k = 0;                                                                       \
        for (; k < K8; k += 8) {                                                                      \
            __m256 xv[M];                                                                             \
            for (int m = 0; m < M; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);                     \
            for (int r = 0; r < R; r++) {                                                             \
                if ((PF) && !(k & 15)) _mm_prefetch((const char *)(w + (ptrdiff_t)r * K + k + PREFETCH), HINT); \
                __m256 wv = _mm256_loadu_ps(w + (ptrdiff_t)r * K + k);                                \
                for (int m = 0; m < M; m++) acc[r][m] = _mm256_fmadd_ps(wv, (R) * (M) + (M) + (R) > 16 ? _mm256_loadu_ps(x + m * ldx + k) : xv[m], acc[r][m]); \
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

/* Each block in two prefetch levels: into L1 (_MM_HINT_T0, suffix 1) and into L2 only (_MM_HINT_T1, suffix 2). */
#define BLOCKS(S, H)                                                                                                 \
    BLOCK(1, 1, S, H, 1) BLOCK(1, 2, S, H, 1) BLOCK(1, 3, S, H, 1) BLOCK(1, 4, S, H, 1) BLOCK(1, 5, S, H, 1)          \
    BLOCK(1, 6, S, H, 1) BLOCK(1, 7, S, H, 1) BLOCK(1, 8, S, H, 1)                                                   \
    BLOCK(2, 1, S, H, 1) BLOCK(2, 2, S, H, 1) BLOCK(2, 3, S, H, 1) BLOCK(2, 4, S, H, 1) BLOCK(2, 5, S, H, 1)          \
    BLOCK(2, 6, S, H, 1) BLOCK(2, 7, S, H, 1) BLOCK(4, 1, S, H, 1) BLOCK(4, 2, S, H, 1) BLOCK(4, 3, S, H, 1)
BLOCKS(1, _MM_HINT_T0) BLOCKS(2, _MM_HINT_T1)
/* Streaming (suffix 0): one weight row at a time, read front to back with no software prefetch. */
BLOCK(1, 1, 0, _MM_HINT_T0, 0) BLOCK(1, 2, 0, _MM_HINT_T0, 0) BLOCK(1, 3, 0, _MM_HINT_T0, 0) BLOCK(1, 4, 0, _MM_HINT_T0, 0)
BLOCK(1, 5, 0, _MM_HINT_T0, 0) BLOCK(1, 6, 0, _MM_HINT_T0, 0) BLOCK(1, 7, 0, _MM_HINT_T0, 0) BLOCK(1, 8, 0, _MM_HINT_T0, 0)

#ifndef ROWS_FOR
/* Weight rows per block for M input rows: enough independent FMA chains to hide latency, within 16 ymm registers. */
#define ROWS_FOR(M) ((M) <= 2 ? 4 : (M) <= 7 ? 2 : 1)
#endif

typedef void (*block_fn)(const float *, ptrdiff_t, const float *, int, float *, ptrdiff_t, const float *);

/* ---- AVX-512: the same blocks in 16 lanes; the K tail (K % 16) through masked loads. Compiled for avx512f
 * whatever the library's flags, and only called when the CPU has it. */
#define AVX512 __attribute__((target("avx512f")))

#define BLOCK512(R, M, SUF, HINT, PF)                                                                 \
    static AVX512 void b512##SUF##_##R##_##M(const float *x, ptrdiff_t ldx, const float *w, int K, float *y,  \
                                      ptrdiff_t ldy, const float *bias) {                             \
        __m512 acc[R][M];                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                              \
        int K16 = K & ~15, k = 0;                                                                     \
        for (; k < K16; k += 16) {                                                                    \
            __m512 xv[M];                                                                             \
            for (int m = 0; m < M; m++) xv[m] = _mm512_loadu_ps(x + m * ldx + k);                     \
            for (int r = 0; r < R; r++) {                                                             \
                if (PF) _mm_prefetch((const char *)(w + (ptrdiff_t)r * K + k + PREFETCH), HINT);       \
                __m512 wv = _mm512_loadu_ps(w + (ptrdiff_t)r * K + k);                                \
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);        \
            }                                                                                         \
        }                                                                                             \
        if (k < K) {                                                                                  \
            __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);                                       \
            __m512 xv[M];                                                                             \
            for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);         \
            for (int r = 0; r < R; r++) {                                                             \
                __m512 wv = _mm512_maskz_loadu_ps(mask, w + (ptrdiff_t)r * K + k);                    \
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);        \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int m = 0; m < M; m++) {                                                             \
                float s = _mm512_reduce_add_ps(acc[r][m]);                                            \
                if (bias) s += bias[r];                                                               \
                y[m * ldy + r] = s;                                                                   \
            }                                                                                         \
    }

#define BLOCKS512(S, H)                                                                                              \
    BLOCK512(1, 1, S, H, 1) BLOCK512(1, 2, S, H, 1) BLOCK512(1, 3, S, H, 1) BLOCK512(1, 4, S, H, 1)                  \
    BLOCK512(1, 5, S, H, 1) BLOCK512(1, 6, S, H, 1) BLOCK512(1, 7, S, H, 1) BLOCK512(1, 8, S, H, 1)                  \
    BLOCK512(2, 1, S, H, 1) BLOCK512(2, 2, S, H, 1) BLOCK512(2, 3, S, H, 1) BLOCK512(2, 4, S, H, 1)                  \
    BLOCK512(2, 5, S, H, 1) BLOCK512(2, 6, S, H, 1) BLOCK512(2, 7, S, H, 1) BLOCK512(2, 8, S, H, 1)                  \
    BLOCK512(8, 1, S, H, 1) BLOCK512(4, 2, S, H, 1) BLOCK512(4, 3, S, H, 1) BLOCK512(4, 4, S, H, 1)                  \
    BLOCK512(4, 5, S, H, 1) BLOCK512(4, 6, S, H, 1) BLOCK512(3, 7, S, H, 1)
BLOCKS512(1, _MM_HINT_T0) BLOCKS512(2, _MM_HINT_T1)
/* Streaming (suffix 0), as the AVX2 ones. */
BLOCK512(1, 1, 0, _MM_HINT_T0, 0) BLOCK512(1, 2, 0, _MM_HINT_T0, 0) BLOCK512(1, 3, 0, _MM_HINT_T0, 0)
BLOCK512(1, 4, 0, _MM_HINT_T0, 0) BLOCK512(1, 5, 0, _MM_HINT_T0, 0) BLOCK512(1, 6, 0, _MM_HINT_T0, 0)
BLOCK512(1, 7, 0, _MM_HINT_T0, 0) BLOCK512(1, 8, 0, _MM_HINT_T0, 0)
static const block_fn stream512[9] = {0, b5120_1_1, b5120_1_2, b5120_1_3, b5120_1_4, b5120_1_5, b5120_1_6, b5120_1_7,
                                      b5120_1_8};
static const block_fn stream256[9] = {0, block0_1_1, block0_1_2, block0_1_3, block0_1_4, block0_1_5, block0_1_6,
                                      block0_1_7, block0_1_8};

/* [R][M]: the AVX-512 block of R weight rows x M input rows. One group of M <= 8 input rows takes the widest R
 * whose R x M accumulators + M inputs + 1 weight fit in 32 registers; more rows run in groups of 8 at R = 2
 * (every group of a call walks the same weight blocks, so the last, shorter group needs the same R). */
#define TABLE512(S)                                                                                                  \
    {                                                                                                                \
        [1] = {0, b512##S##_1_1, b512##S##_1_2, b512##S##_1_3, b512##S##_1_4, b512##S##_1_5, b512##S##_1_6,           \
               b512##S##_1_7, b512##S##_1_8},                                                                        \
        [2] = {0, b512##S##_2_1, b512##S##_2_2, b512##S##_2_3, b512##S##_2_4, b512##S##_2_5, b512##S##_2_6,           \
               b512##S##_2_7, b512##S##_2_8},                                                                        \
        [3] = {[7] = b512##S##_3_7},                                                                                 \
        [4] = {[2] = b512##S##_4_2, [3] = b512##S##_4_3, [4] = b512##S##_4_4, [5] = b512##S##_4_5, [6] = b512##S##_4_6}, \
        [8] = {[1] = b512##S##_8_1},                                                                                 \
    }
/* [prefetch level - 1][R][M] */
static const block_fn table512[2][9][9] = {TABLE512(1), TABLE512(2)};
static int rows512(int M, int groups) { return groups > 1 ? 2 : M == 1 ? 8 : M <= 6 ? 4 : M == 7 ? 3 : 2; }

/* The instruction set in use: 1 = AVX2, 2 = AVX-512. selfspec_gemm_isa(0) chooses the best this CPU has (once),
 * selfspec_gemm_isa(1 or 2) asks for one (2 only where the CPU has it), a negative value changes nothing.
 * Returns the one in use. */
static int isa = 0;

int selfspec_gemm_isa(int want) {
    __builtin_cpu_init();
    int has512 = __builtin_cpu_supports("avx512f");
    if (want == 1 || (want == 2 && !has512)) isa = 1;
    else if (want == 0 || want == 2 || isa == 0) isa = has512 ? 2 : 1; /* want < 0: only asks */
    return isa;
}

/* Calls of 1..stream_rows input rows walk the weights row by row (stream512, stream256); 0 = never (the blocks).
 * selfspec_gemm_stream_rows(n) with 0 <= n <= 8 sets it, a negative value only asks. Returns the one in use. */
static int stream_rows = 0;

int selfspec_gemm_stream_rows(int want) {
    if (want >= 0) stream_rows = want > 8 ? 8 : want;
    return stream_rows;
}

/* The blocks prefetch the weights they read next into L1 (level 1, _MM_HINT_T0: tuned on a Xeon) or into L2 only
 * (level 2, _MM_HINT_T1: on a 2-core AMD EPYC, Zen 4, 2-8 input rows then cost about what one row costs, and
 * about 1.5x that with the prefetch into L1). selfspec_gemm_prefetch_level(1 or 2) sets it, anything else only asks. */
static int prefetch_level = 1;

int selfspec_gemm_prefetch_level(int want) {
    if (want == 1 || want == 2) prefetch_level = want;
    return prefetch_level;
}

#define PICK(S)                                                                                                      \
    static block_fn pick##S(int R, int M) {                                                                          \
        switch (R * 16 + M) {                                                                                        \
            case 16 + 1: return block##S##_1_1; case 16 + 2: return block##S##_1_2; case 16 + 3: return block##S##_1_3; \
            case 16 + 4: return block##S##_1_4; case 16 + 5: return block##S##_1_5; case 16 + 6: return block##S##_1_6; \
            case 16 + 7: return block##S##_1_7; case 16 + 8: return block##S##_1_8;                                  \
            case 32 + 1: return block##S##_2_1; case 32 + 2: return block##S##_2_2; case 32 + 3: return block##S##_2_3; \
            case 32 + 4: return block##S##_2_4; case 32 + 5: return block##S##_2_5; case 32 + 6: return block##S##_2_6; \
            case 32 + 7: return block##S##_2_7;                                                                      \
            case 64 + 1: return block##S##_4_1; case 64 + 2: return block##S##_4_2; case 64 + 3: return block##S##_4_3; \
        }                                                                                                            \
        return 0;                                                                                                    \
    }
PICK(1) PICK(2)
static block_fn pick(int R, int M) { return prefetch_level == 2 ? pick2(R, M) : pick1(R, M); }

/* Entry point: x (M, K) with row stride ldx, w (N, K) contiguous, y (M, N) with row stride ldy, bias (N) or NULL.
 * Threads split the weight rows; each block of R weight rows is multiplied with every group of up to 8 input
 * rows while it sits in L1, so the weights are read from memory once whatever M is. Returns 0. */
int selfspec_small_gemm(const float *x, long ldx, int M, const float *w, int N, int K, float *y, long ldy,
                        const float *bias) {
    if (isa == 0) selfspec_gemm_isa(0);
    int groups = (M + 7) / 8, last = M - 8 * (groups - 1), M8 = M < 8 ? M : 8, R;
    block_fn full, tail, full1, tail1;
    if (groups == 1 && M <= stream_rows) {
        R = 1;
        full = tail = full1 = tail1 = (isa == 2 ? stream512 : stream256)[M];
    } else if (isa == 2) {
        R = rows512(M8, groups);
        const block_fn(*t)[9] = table512[prefetch_level - 1];
        full = t[R][M8], tail = t[R][last], full1 = t[1][M8], tail1 = t[1][last];
    } else {
        R = ROWS_FOR(M8);
        full = pick(R, M8), tail = pick(R, last), full1 = pick(1, M8), tail1 = pick(1, last);
    }
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
