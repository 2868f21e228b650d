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
 * Threads split the weight rows (OpenMP, as selfspec_small_gemm). int8 multiplies in integers under both ISAs, with
 * the same bits: in AVX2 each weight row is read front to back once and multiplied with every input row (I8_SEQ
 * below); in AVX-512 R weight rows at a time are multiplied while they sit in L1.
 * int4 multiplies in integers under AVX-512 and dequantizes to float under AVX2. AVX-512 where the CPU has it (the ISA chosen by selfspec_gemm_isa), else
 * AVX2. */
#include <immintrin.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QGROUP 32
#ifndef QPREFETCH
#define QPREFETCH 8192 /* bytes ahead (the float kernel prefetches 16 KB = 4096 floats; here a quarter of the bytes/row) */
#endif
/* The AVX-512 int8 blocks prefetch into L2 only (T2): the R rows a block reads side by side are read once, and
 * pulling them into L1 ahead of time only evicted the inputs. */
#ifndef QPREFETCH_HINT
#define QPREFETCH_HINT _MM_HINT_T2
#endif

int selfspec_gemm_isa(int want);

/* Mirrors the ctypes Structure QuantWeightC in selfspec/model/cpu_kernels.py. */
typedef struct {
    int kind;           /* 1 = int8 per row, 2 = int4 in groups of 32 */
    const void *q;      /* int8 (N, K) or uint8 (N, K/2) */
    const float *scale; /* (N) or (N, K/32) */
    const float *zero;  /* int4: (N, K/32); else NULL */
    const float *exact; /* kind 4 only, or NULL: the float32 weight (N, K) that rescores each row's shortlist */
    int shortlist;      /* how many of each row's largest outputs `exact` recomputes (group_gemm.c) */
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
/* The same integer sums as the AVX2 rows above, 32 weights per instruction: the weights are widened to int16 and
 * multiplied with the rounded inputs by vpmaddwd + vpaddd (AVX512BW; VNNI's vpdpwssd, which fuses the two, read no
 * faster in a bare loop on a Xeon: the rows are bound by memory). R weight rows are multiplied with M input rows
 * while they sit in L1.
 * The chunks, the K % 16 tail and the final scaling are the AVX2 rows' own, and integer sums do not depend on their
 * order, so both ISAs give the same bits. (The earlier AVX-512 path converted the weights to float, three
 * instructions per 16 weights: on a 2-vCPU Xeon it read 14 G weights/s where a bare read of the same bytes ran at
 * 55 from L3; this one reads at the speed of the bare read.) */
#define AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))
#define I8_512(R, M)                                                                                        \
    static AVX512BW void i8bw_##R##_##M(const int16_t *xq, int ld, const float *sx, const int8_t *w,       \
                                         const float *s, int K, float *y, ptrdiff_t ldy, const float *bias) { \
        const int K16 = K & ~15;                                                                            \
        float f[R][M];                                                                                      \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++) f[r][m] = 0.f;                                                      \
        for (int c = 0; c < K16; c += X16_CHUNK) {                                                          \
            const int end = c + X16_CHUNK < K16 ? c + X16_CHUNK : K16;                                      \
            __m512i acc[R][M], xv[M];                                                                       \
            for (int r = 0; r < R; r++)                                                                     \
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_si512();                             \
            int k = c;                                                                                      \
            for (; k + 32 <= end; k += 32) {                                                                \
                for (int m = 0; m < M; m++) xv[m] = _mm512_loadu_si512(xq + (ptrdiff_t)m * ld + k);         \
                for (int r = 0; r < R; r++) {                                                               \
                    const int8_t *wr = w + (ptrdiff_t)r * K + k;                                            \
                    if (!(k & 63)) _mm_prefetch((const char *)(wr + QPREFETCH), QPREFETCH_HINT);            \
                    __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)wr));             \
                    for (int m = 0; m < M; m++)                                                             \
                        acc[r][m] = _mm512_add_epi32(acc[r][m], _mm512_madd_epi16(wv, xv[m]));              \
                }                                                                                           \
            }                                                                                               \
            if (k < end) { /* 16 left: the upper half of the weights is zero, the inputs are not read there */ \
                for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_epi16(0xFFFFu, xq + (ptrdiff_t)m * ld + k); \
                for (int r = 0; r < R; r++) {                                                               \
                    __m512i wv = _mm512_cvtepi8_epi16(                                                      \
                        _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(w + (ptrdiff_t)r * K + k)))); \
                    for (int m = 0; m < M; m++)                                                             \
                        acc[r][m] = _mm512_add_epi32(acc[r][m], _mm512_madd_epi16(wv, xv[m]));              \
                }                                                                                           \
            }                                                                                               \
            for (int r = 0; r < R; r++)                                                                     \
                for (int m = 0; m < M; m++) f[r][m] += (float)_mm512_reduce_add_epi32(acc[r][m]);           \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++) {                                                                   \
                int t = 0;                                                                                  \
                for (int kk = K16; kk < K; kk++) t += (int)w[(ptrdiff_t)r * K + kk] * xq[(ptrdiff_t)m * ld + kk]; \
                y[m * ldy + r] = (f[r][m] + (float)t) * sx[m] * s[r] + (bias ? bias[r] : 0.f);              \
            }                                                                                               \
    }
I8_512(4, 1) I8_512(4, 2) I8_512(4, 3) I8_512(2, 4) I8_512(2, 5) I8_512(2, 6) I8_512(2, 7) I8_512(2, 8)
I8_512(1, 1) I8_512(1, 2) I8_512(1, 3) I8_512(1, 4) I8_512(1, 5) I8_512(1, 6) I8_512(1, 7) I8_512(1, 8)

typedef void (*i8s_fn)(const int16_t *, int, const float *, const int8_t *, const float *, int, float *, ptrdiff_t,
                       const float *);
static const i8s_fn i8s[9] = {0, i8s_1, i8s_2, i8s_3, i8s_4, i8s_5, i8s_6, i8s_7, i8s_8};
/* [wide = R rows, else 1][M] */
static const i8s_fn i8b[2][9] = {{0, i8bw_1_1, i8bw_1_2, i8bw_1_3, i8bw_1_4, i8bw_1_5, i8bw_1_6, i8bw_1_7, i8bw_1_8},
                                 {0, i8bw_4_1, i8bw_4_2, i8bw_4_3, i8bw_2_4, i8bw_2_5, i8bw_2_6, i8bw_2_7, i8bw_2_8}};
static int i8b_rows(int M) { return M <= 3 ? 4 : 2; }

/* Whether the integer AVX-512 blocks run here (AVX512BW and VL); else the AVX2 rows. */
static int has_512bw(void) {
    static int bw = -1;
    if (bw < 0) {
        __builtin_cpu_init();
        bw = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    }
    return bw;
}

/* ------------------------------------------------------------------------------------------------ int4 */
/* AVX2: each group is dequantized in registers, w = scale * q + zero (one FMA per vector), then multiplied into four
 * independent 8-lane accumulators per input row (float inputs: int4's bits differ between the two ISAs). */
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

/* AVX-512 multiplies int4 in integers too: the 32 codes of a group are widened to int16 (low nibbles, then high)
 * and vpmaddwd multiplies them with the rounded inputs (16 int32 lanes, exact), which are converted and scaled by
 * the group's scale into float accumulators; the zeros come in once per row as sum_g zero_g * (sum of the group's
 * inputs). y = (sum_g scale_g (q_g . xq_g) + sum_g zero_g xsum_g) * sx + bias: the dequantized weights times the
 * rounded inputs (quant.int8_reference's math), about 9 instructions per 32 weights where the float path took 11
 * per 16 plus the conversions. R weight rows x M input rows per block, as the int8 blocks. */
static AVX512BW float dot_f512(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

#define I4_512(R, M)                                                                                        \
    static AVX512BW void i4b_##R##_##M(const int16_t *xq, int ld, const float *sx, const float *xsum,       \
                                       const uint8_t *w, const float *s, const float *z, int K, float *y,   \
                                       ptrdiff_t ldy, const float *bias) {                                  \
        const int G = K / QGROUP;                                                                           \
        const __m128i nib = _mm_set1_epi8(0x0F);                                                            \
        __m512 acc[R][M];                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                                    \
        for (int g = 0; g < G; g++) {                                                                       \
            __m512i xv[M];                                                                                  \
            for (int m = 0; m < M; m++) xv[m] = _mm512_loadu_si512(xq + (ptrdiff_t)m * ld + QGROUP * g);    \
            for (int r = 0; r < R; r++) {                                                                   \
                const uint8_t *gp = w + (ptrdiff_t)r * (K / 2) + 16 * g;                                    \
                if (!(g & 3)) _mm_prefetch((const char *)(gp + QPREFETCH), _MM_HINT_T0);                    \
                const __m128i b = _mm_loadu_si128((const __m128i *)gp);                                     \
                const __m512i wv = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(                            \
                    _mm256_castsi128_si256(_mm_and_si128(b, nib)), _mm_and_si128(_mm_srli_epi16(b, 4), nib), 1)); \
                const __m512 sv = _mm512_set1_ps(s[(ptrdiff_t)r * G + g]);                                  \
                for (int m = 0; m < M; m++)                                                                 \
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv, xv[m])), sv, acc[r][m]); \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int m = 0; m < M; m++)                                                                     \
                y[m * ldy + r] = (_mm512_reduce_add_ps(acc[r][m]) + dot_f512(z + (ptrdiff_t)r * G, xsum + (ptrdiff_t)m * G, G)) \
                                 * sx[m] + (bias ? bias[r] : 0.f);                                          \
    }
I4_512(4, 1) I4_512(4, 2) I4_512(4, 3) I4_512(2, 4) I4_512(2, 5) I4_512(2, 6) I4_512(2, 7) I4_512(2, 8)
I4_512(1, 1) I4_512(1, 2) I4_512(1, 3) I4_512(1, 4) I4_512(1, 5) I4_512(1, 6) I4_512(1, 7) I4_512(1, 8)

typedef void (*i4b_fn)(const int16_t *, int, const float *, const float *, const uint8_t *, const float *, const float *,
                       int, float *, ptrdiff_t, const float *);
static const i4b_fn i4b[2][9] = {{0, i4b_1_1, i4b_1_2, i4b_1_3, i4b_1_4, i4b_1_5, i4b_1_6, i4b_1_7, i4b_1_8},
                                 {0, i4b_4_1, i4b_4_2, i4b_4_3, i4b_2_4, i4b_2_5, i4b_2_6, i4b_2_7, i4b_2_8}};

/* int4 under AVX-512: x (M, K) rounded per group of 8 rows, each group's input sums, then the blocks. */
static int int4_gemm_512(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                         const float *bias) {
    const int G = K / QGROUP, groups = (M + 7) / 8;
    int16_t *xq = (int16_t *)aligned_alloc(64, sizeof(int16_t) * (size_t)8 * K); /* K % 32 == 0: rows 64-byte aligned */
    float *xsum = (float *)malloc(sizeof(float) * (size_t)8 * G);
    if (!xq || !xsum) {
        free(xq);
        free(xsum);
        return -2;
    }
    const uint8_t *q = (const uint8_t *)w->q;
    for (int gr = 0; gr < groups; gr++) {
        const int Mg = gr < groups - 1 ? 8 : M - 8 * gr;
        float *yg = y + (ptrdiff_t)8 * gr * ldy, sx[8];
        round_rows16(x + (ptrdiff_t)8 * gr * ldx, ldx, Mg, K, xq, K, sx);
        for (int m = 0; m < Mg; m++)
            for (int g = 0; g < G; g++) {
                int t = 0;
                for (int k = 0; k < QGROUP; k++) t += xq[(ptrdiff_t)m * K + QGROUP * g + k];
                xsum[m * G + g] = (float)t;
            }
        const i4b_fn wide = i4b[1][Mg], one = i4b[0][Mg];
        const int R = i8b_rows(Mg), nb = N / R;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nb; b++) {
            const int n = b * R;
            wide(xq, K, sx, xsum, q + (ptrdiff_t)n * (K / 2), w->scale + (ptrdiff_t)n * G, w->zero + (ptrdiff_t)n * G, K,
                 yg + n, ldy, bias ? bias + n : NULL);
        }
        for (int n = nb * R; n < N; n++)
            one(xq, K, sx, xsum, q + (ptrdiff_t)n * (K / 2), w->scale + (ptrdiff_t)n * G, w->zero + (ptrdiff_t)n * G, K,
                yg + n, ldy, bias ? bias + n : NULL);
    }
    free(xq);
    free(xsum);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ entry point */
/* x (M, K) with row stride ldx, W (N, K) in the format of w->kind, y (M, N) with row stride ldy, bias (N) or NULL.
 * Any M >= 1 (groups of 8 input rows per weight-row read). Returns 0, -1 for an unknown kind or an int4 K that is
 * not a multiple of 32, -2 when the rounded inputs cannot be allocated. */
int selfspec_group_gemm(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                        const float *bias);

int selfspec_quant_gemm(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                        const float *bias) {
    if (w->kind == 3 || w->kind == 4) return selfspec_group_gemm(x, ldx, M, w, N, K, y, ldy, bias);
    const int isa = selfspec_gemm_isa(-1);
    const int groups = (M + 7) / 8;
    if (w->kind == 1) {
        const int8_t *q = (const int8_t *)w->q;
        const int ld = (K + 15) & ~15, wide512 = isa == 2 && has_512bw();
        int16_t *xq = (int16_t *)aligned_alloc(64, sizeof(int16_t) * (size_t)8 * ld); /* ld % 16 == 0: rows 32-byte aligned */
        if (!xq) return -2;
        for (int g = 0; g < groups; g++) {
            const int Mg = g < groups - 1 ? 8 : M - 8 * g;
            float *yg = y + (ptrdiff_t)8 * g * ldy, sx[8];
            round_rows16(x + (ptrdiff_t)8 * g * ldx, ldx, Mg, K, xq, ld, sx);
            if (wide512) {
                const i8s_fn wide = i8b[1][Mg], one = i8b[0][Mg];
                const int R = i8b_rows(Mg), nb = N / R;
#pragma omp parallel for schedule(static)
                for (int b = 0; b < nb; b++) {
                    const int n = b * R;
                    wide(xq, ld, sx, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
                }
                for (int n = nb * R; n < N; n++)
                    one(xq, ld, sx, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
            } else {
                const i8s_fn fn = i8s[Mg];
#pragma omp parallel for schedule(static)
                for (int n = 0; n < N; n++)
                    fn(xq, ld, sx, q + (ptrdiff_t)n * K, w->scale + n, K, yg + n, ldy, bias ? bias + n : NULL);
            }
        }
        free(xq);
        return 0;
    }
    if (w->kind != 2 || K % QGROUP) return -1;
    if (isa == 2 && has_512bw()) return int4_gemm_512(x, ldx, M, w, N, K, y, ldy, bias);
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
            int4_row_avx2(xg, ldx, Mg, wr, sr, zr, G, yg, ldy, bias ? bias + n : NULL);
        }
    return 0;
}
