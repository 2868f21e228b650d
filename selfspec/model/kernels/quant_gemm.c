/* y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias[N]) for the few rows of a draft step, weights stored in
 * 8 or 4 bits and dequantized in registers (weight-only quantization: x, y and every sum stay float32).
 *
 * Why: a draft step through a small model's layers is bound by reading the weights (selfspec_small_gemm streams
 * float32 rows at the machine's memory bandwidth). The same weights in int8 are a quarter of the bytes, in int4 an
 * eighth; converting them to float32 costs a few vector instructions per 16 weights, which hide under the reads.
 * (torch's _weight_int8pack_mm on CPU was 7x slower than the float32 matmul for one row on the machine this was
 * written for: it is not used.)
 *
 * Formats (selfspec/model/quant.py makes them from the model's own float weights at load time):
 *   kind 1, int8:  q (N, K) int8, scale (N): w[n, k] = scale[n] * q[n, k]                (symmetric, per row)
 *   kind 2, int4:  groups of 32 along K; group g of row n is 16 bytes, byte j holds w[.., 32g + j] in its low
 *                  nibble and w[.., 32g + 16 + j] in its high nibble; scale, zero (N, K/32):
 *                  w[n, k] = scale[n, g] * q[n, k] + zero[n, g]                          (asymmetric, per group)
 * int4 needs K % 32 == 0 (checked in Python).
 *
 * Threads split the weight rows (OpenMP, as selfspec_small_gemm). In AVX2 each int8 weight row is read front to back
 * once and multiplied with every input row (I8_SEQ below); the AVX-512 and int4 blocks multiply R weight rows at a
 * time while they sit in L1. AVX-512 where the CPU has it (the ISA chosen by selfspec_gemm_isa), else AVX2. */
#include <immintrin.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QGROUP 32
#ifndef QPREFETCH
#define QPREFETCH 8192 /* bytes ahead (the float kernel prefetches 16 KB = 4096 floats; here a quarter of the bytes/row) */
#endif

int selfspec_gemm_isa(int want);

/* Mirrors the ctypes Structure QuantWeightC in selfspec/model/cpu_kernels.py. */
typedef struct {
    int kind;           /* 1 = int8 per row, 2 = int4 in groups of 32 */
    const void *q;      /* int8 (N, K) or uint8 (N, K/2) */
    const float *scale; /* (N) or (N, K/32) */
    const float *zero;  /* int4: (N, K/32); else NULL */
} QuantWeightC;

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* ------------------------------------------------------------------------------------------------ int8, AVX2 */
/* AVX2 multiplies in integers: each input row is rounded to int16 with a scale of its own (max |x| / X16_MAX, 14 bits
 * so that int32 sums cannot overflow within a chunk), the weights are widened to int16, and vpmaddwd multiplies 16
 * pairs and adds neighbours into 8 int32 lanes: two instructions per 16 weights where converting them to float took
 * four per 8 (the float path ran at ~3.5 weights per cycle on a 2-vCPU EPYC, compute-bound: its two vCPUs share
 * a core). Every X16_CHUNK inputs the int32 sums are moved to float accumulators. The K % 16 tail is summed in
 * float with the unrounded inputs. y = (sum q_w q_x) * scale_w * scale_x (+ tail * scale_w) + bias. */
#define X16_MAX 16383.0f
#define X16_CHUNK 4096

/* Input rows -> int16 (row stride ld >= K) and their scales: xq = round(x / sx), sx = max |x| / X16_MAX. Both ISAs
 * multiply these rounded inputs, so the result does not depend on the CPU (quant.py's reference does the same). */
static void round_rows16(const float *x, ptrdiff_t ldx, int M, int K, int16_t *xq, int ld, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int K16 = K & ~15;
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        __m256 mv = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= K; k += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
        float lanes[8], mx = 0.f;
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; j++) mx = fmaxf(mx, lanes[j]);
        for (; k < K; k++) mx = fmaxf(mx, fabsf(xr[k]));
        const float s = mx > 0.f ? mx / X16_MAX : 1.f;
        sx[m] = s;
        int16_t *q = xq + (ptrdiff_t)m * ld;
        const __m256 sv = _mm256_set1_ps(s);
        /* x / s (a true division, as the reference), rounded to nearest even like lrintf; |x / s| <= X16_MAX */
        for (k = 0; k < K16; k += 16) {
            __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k), sv));
            __m256i b = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k + 8), sv));
            _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
        }
        for (; k < K; k++) q[k] = (int16_t)lrintf(xr[k] / s);
    }
}

static inline int hsum_epi32(__m256i v) {
    __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xB1));
    return _mm_cvtsi128_si32(lo);
}


/* One weight row against M input rows, U x 16 weights per step, the row read front to back with a software prefetch
 * QSEQ_PREFETCH bytes ahead. Measured on a 2-vCPU EPYC (Zen 3), one input row, weights streamed from memory: 21-28 G
 * weights/s through selfspec_quant_gemm (28-31 in a bare loop), against 14-16 for blocks of 4 rows read side by side
 * (their interleaved streams defeat the hardware prefetcher; out of L2 both run at 40-60). */
#ifndef QSEQ_PREFETCH
#define QSEQ_PREFETCH 1024
#endif
#define I8_SEQ(U, M)                                                                                        \
    static void i8s_##M(const int16_t *xq, int ld, const float *sx, const int8_t *w, const float *s, int K,  \
                        float *y, ptrdiff_t ldy, const float *bias) {                                       \
        const int K16 = K & ~15, KU = K & ~(16 * (U) - 1);                                                  \
        float f[M];                                                                                         \
        for (int m = 0; m < M; m++) f[m] = 0.f;                                                             \
        for (int c = 0; c < K16; c += X16_CHUNK) {                                                          \
            const int end = c + X16_CHUNK < K16 ? c + X16_CHUNK : K16, endU = end < KU ? end : KU;          \
            __m256i acc[M][U];                                                                              \
            for (int m = 0; m < M; m++)                                                                     \
                for (int u = 0; u < (U); u++) acc[m][u] = _mm256_setzero_si256();                           \
            int k = c;                                                                                      \
            for (; k < endU; k += 16 * (U)) {                                                               \
                _mm_prefetch((const char *)(w + k + QSEQ_PREFETCH), _MM_HINT_T0);                           \
                for (int u = 0; u < (U); u++) {                                                             \
                    __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16 * u)));   \
                    for (int m = 0; m < M; m++)                                                             \
                        acc[m][u] = _mm256_add_epi32(acc[m][u], _mm256_madd_epi16(wv,                       \
                            _mm256_loadu_si256((const __m256i *)(xq + (ptrdiff_t)m * ld + k + 16 * u))));   \
                }                                                                                           \
            }                                                                                               \
            for (; k < end; k += 16) {                                                                      \
                __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));               \
                for (int m = 0; m < M; m++)                                                                 \
                    acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(wv,                           \
                        _mm256_loadu_si256((const __m256i *)(xq + (ptrdiff_t)m * ld + k))));                \
            }                                                                                               \
            for (int m = 0; m < M; m++) {                                                                   \
                __m256i t = acc[m][0];                                                                      \
                for (int u = 1; u < (U); u++) t = _mm256_add_epi32(t, acc[m][u]);                           \
                f[m] += (float)hsum_epi32(t);                                                               \
            }                                                                                               \
        }                                                                                                   \
        for (int m = 0; m < M; m++) {                                                                       \
            int t = 0;                                                                                      \
            for (int kk = K16; kk < K; kk++) t += (int)w[kk] * xq[(ptrdiff_t)m * ld + kk];                  \
            y[m * ldy] = (f[m] + (float)t) * sx[m] * s[0] + (bias ? bias[0] : 0.f);                         \
        }                                                                                                   \
    }
I8_SEQ(4, 1) I8_SEQ(2, 2) I8_SEQ(2, 3) I8_SEQ(2, 4) I8_SEQ(1, 5) I8_SEQ(1, 6) I8_SEQ(1, 7) I8_SEQ(1, 8)

/* ------------------------------------------------------------------------------------------------ int8, AVX-512 */
#define AVX512 __attribute__((target("avx512f")))
/* R weight rows against M input rows; the K tail (K % 16) through masked loads. */
#define I8_512(R, M)                                                                                        \
    static AVX512 void i8b_##R##_##M(const float *x, ptrdiff_t ldx, const int8_t *w, const float *s, int K,  \
                                     float *y, ptrdiff_t ldy, const float *bias) {                          \
        __m512 acc[R][M];                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                                    \
        int K16 = K & ~15, k = 0;                                                                           \
        for (; k < K16; k += 16) {                                                                          \
            __m512 xv[M];                                                                                   \
            for (int m = 0; m < M; m++) xv[m] = _mm512_loadu_ps(x + m * ldx + k);                           \
            for (int r = 0; r < R; r++) {                                                                   \
                const int8_t *wr = w + (ptrdiff_t)r * K + k;                                                \
                if (!(k & 63)) _mm_prefetch((const char *)(wr + QPREFETCH), _MM_HINT_T0);                   \
                __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wr))); \
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);              \
            }                                                                                               \
        }                                                                                                   \
        if (k < K) {                                                                                        \
            __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);                                             \
            __m512 xv[M];                                                                                   \
            for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);               \
            for (int r = 0; r < R; r++) {                                                                   \
                int8_t tail[16] = {0};                                                                      \
                for (int j = 0; j < K - k; j++) tail[j] = w[(ptrdiff_t)r * K + k + j];                      \
                __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)tail))); \
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);              \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++)                                                                     \
                y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]) * s[r] + (bias ? bias[r] : 0.f);          \
    }
I8_512(4, 1) I8_512(4, 2) I8_512(4, 3) I8_512(2, 4) I8_512(2, 5) I8_512(2, 6) I8_512(2, 7) I8_512(2, 8)
I8_512(1, 1) I8_512(1, 2) I8_512(1, 3) I8_512(1, 4) I8_512(1, 5) I8_512(1, 6) I8_512(1, 7) I8_512(1, 8)

typedef void (*i8b_fn)(const float *, ptrdiff_t, const int8_t *, const float *, int, float *, ptrdiff_t, const float *);
static const i8b_fn i8b_wide[9] = {0, i8b_4_1, i8b_4_2, i8b_4_3, i8b_2_4, i8b_2_5, i8b_2_6, i8b_2_7, i8b_2_8};
static const i8b_fn i8b_one[9] = {0, i8b_1_1, i8b_1_2, i8b_1_3, i8b_1_4, i8b_1_5, i8b_1_6, i8b_1_7, i8b_1_8};
static int i8b_rows(int M) { return M <= 3 ? 4 : 2; }

typedef void (*i8s_fn)(const int16_t *, int, const float *, const int8_t *, const float *, int, float *, ptrdiff_t,
                       const float *);
static const i8s_fn i8s[9] = {0, i8s_1, i8s_2, i8s_3, i8s_4, i8s_5, i8s_6, i8s_7, i8s_8};

/* ------------------------------------------------------------------------------------------------ int4 */
/* Each group is dequantized in registers, w = scale * q + zero (one FMA per vector), then multiplied into
 * independent accumulators per input row (four 8-lane ones in AVX2, two 16-lane ones in AVX-512). */
static void int4_row_avx2(const float *x, ptrdiff_t ldx, int M, const uint8_t *w, const float *s, const float *z,
                          int G, float *y, ptrdiff_t ldy, const float *bias) {
    __m256 acc[8][4];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *gp = w + 16 * g;
        if (!(g & 3)) _mm_prefetch((const char *)(gp + QPREFETCH), _MM_HINT_T0);
        __m128i b = _mm_loadu_si128((const __m128i *)gp);
        __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m256 sv = _mm256_set1_ps(s[g]), zv = _mm256_set1_ps(z[g]);
        __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sv, zv);
        __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sv, zv);
        __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sv, zv);
        __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sv, zv);
        const int k = g * QGROUP;
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * ldx + k;
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc[m][3]);
        }
    }
    for (int m = 0; m < M; m++)
        y[m * ldy] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])))
                     + (bias ? bias[0] : 0.f);
}

static AVX512 void int4_row_512(const float *x, ptrdiff_t ldx, int M, const uint8_t *w, const float *s,
                                const float *z, int G, float *y, ptrdiff_t ldy, const float *bias) {
    __m512 acc[8][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *gp = w + 16 * g;
        if (!(g & 3)) _mm_prefetch((const char *)(gp + QPREFETCH), _MM_HINT_T0);
        __m128i b = _mm_loadu_si128((const __m128i *)gp);
        const __m512 sv = _mm512_set1_ps(s[g]), zv = _mm512_set1_ps(z[g]);
        __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), sv, zv);
        __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), sv, zv);
        const int k = g * QGROUP;
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * ldx + k;
            acc[m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + (bias ? bias[0] : 0.f);
}

/* ------------------------------------------------------------------------------------------------ entry point */
/* x (M, K) with row stride ldx, W (N, K) in the format of w->kind, y (M, N) with row stride ldy, bias (N) or NULL.
 * Any M >= 1 (groups of 8 input rows per weight-row read). Returns 0, -1 for an unknown kind or an int4 K that is
 * not a multiple of 32, -2 when the rounded inputs cannot be allocated. */
int selfspec_quant_gemm(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                        const float *bias) {
    const int isa = selfspec_gemm_isa(-1);
    const int groups = (M + 7) / 8;
    if (w->kind == 1) {
        const int8_t *q = (const int8_t *)w->q;
        const int ld = (K + 15) & ~15;
        int16_t *xq = (int16_t *)aligned_alloc(64, sizeof(int16_t) * (size_t)8 * ld); /* ld % 16 == 0: rows 32-byte aligned */
        float *xf = isa == 2 ? (float *)malloc(sizeof(float) * (size_t)8 * K) : NULL;
        if (!xq || (isa == 2 && !xf)) {
            free(xq);
            free(xf);
            return -2;
        }
        for (int g = 0; g < groups; g++) {
            const int Mg = g < groups - 1 ? 8 : M - 8 * g;
            float *yg = y + (ptrdiff_t)8 * g * ldy, sx[8];
            round_rows16(x + (ptrdiff_t)8 * g * ldx, ldx, Mg, K, xq, ld, sx);
            if (isa == 2) { /* the rounded inputs as floats, through the float blocks */
                for (int m = 0; m < Mg; m++)
                    for (int k = 0; k < K; k++) xf[(ptrdiff_t)m * K + k] = (float)xq[(ptrdiff_t)m * ld + k] * sx[m];
                const int R = i8b_rows(Mg), nb = N / R;
#pragma omp parallel for schedule(static)
                for (int b = 0; b < nb; b++) {
                    const int n = b * R;
                    i8b_wide[Mg](xf, K, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
                }
                for (int n = nb * R; n < N; n++)
                    i8b_one[Mg](xf, K, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
            } else {
                const i8s_fn fn = i8s[Mg];
#pragma omp parallel for schedule(static)
                for (int n = 0; n < N; n++)
                    fn(xq, ld, sx, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
            }
        }
        free(xq);
        free(xf);
        return 0;
    }
    if (w->kind != 2 || K % QGROUP) return -1;
    const int G = K / QGROUP;
    const uint8_t *q = (const uint8_t *)w->q;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int g = 0; g < groups; g++) {
            const int Mg = g < groups - 1 ? 8 : M - 8 * g;
            const float *xg = x + (ptrdiff_t)8 * g * ldx;
            float *yg = y + (ptrdiff_t)8 * g * ldy + n;
            const uint8_t *wr = q + (ptrdiff_t)n * (K / 2);
            const float *sr = w->scale + (ptrdiff_t)n * G, *zr = w->zero + (ptrdiff_t)n * G;
            if (isa == 2) int4_row_512(xg, ldx, Mg, wr, sr, zr, G, yg, ldy, bias ? bias + n : NULL);
            else int4_row_avx2(xg, ldx, Mg, wr, sr, zr, G, yg, ldy, bias ? bias + n : NULL);
        }
    return 0;
}
