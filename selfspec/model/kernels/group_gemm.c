/* y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias[N]) with the inputs quantized to int8 per group of 32 and the
 * products summed in integers by AVX512-VNNI (vpdpbusd: 64 byte products per instruction, 4 per 32-bit lane).
 *
 * Why: the weight-only kernels of quant_gemm.c widen every weight to int16 (int8) or unpack and widen it (int4)
 * before multiplying: 3-10 vector instructions per 32 weights. On a 2-vCPU AMD EPYC (Zen 4, both vCPUs on one core)
 * that made int8 and int4 draft steps compute-bound, well short of what their bytes allow (issue 55). Here the
 * weights are laid out so that one 64-byte load holds 4 consecutive weights of each of 16 output rows: one vpdpbusd
 * with 4 input bytes broadcast to every lane adds 64 products into 16 row sums, so the row sums never need a
 * horizontal add, and the input rows (quantized once per call) are read as broadcasts from L1.
 *
 * Inputs (as llama.cpp's Q8 blocks): per row m and group g of 32 inputs, sx = max |x| / 127 (1 for an all-zero
 * group), xq = round(x / sx) (nearest even, float32 division) in [-127, 127]; K is padded with zeros to a multiple
 * of 32 (G groups).
 * Formats (quant.py's pack_group makes them from a QuantWeight; N is padded to a multiple of 16, nb blocks):
 *   kind 3, int8:  q uint8 (nb, G, 8, 16, 4): [b, g, v, r, j] = q8[16b + r, 32g + 4v + j] + 128 (offset binary:
 *                  vpdpbusd multiplies unsigned by signed bytes; padding holds 128 = weight 0); scale float (16 nb),
 *                  per row. Row n: y = scale[n] * sum_g sx_g (sum_k (q + 128) xq - 128 sum_k xq) + bias.
 *   kind 4, int4:  q uint8 (nb, G, 384): per block and group 256 bytes of codes [v (4), r (16), j (4)], low nibble
 *                  = code[16b + r, 32g + 8v + j], high nibble = code[.., 32g + 8v + 4 + j], then the 16 rows'
 *                  float32 scales, then their zeros (w = scale * code + zero).
 *                  Row n: y = sum_g ((sum_k code xq) (scale_g sx_g) + zero_g (sx_g sum_k xq)) + bias.
 * Shortlist (an int4 LM head: quant.py's RESCORE): with `exact` set, each input row's `shortlist` largest outputs
 * (ties: the lower index) are computed again from the float32 weight, x . exact[n] (+ bias), from the input row
 * itself: int4 picks the candidates, float32 ranks them. An int4 LM head alone agreed with the model on 91% of
 * tokens where int8 agreed on 98% (SmolLM2, Spec-Bench), and its top 8 held the model's token 99.9% of the time.
 * The float operations, in this order per row (fused multiply-adds as written), are the same in the AVX-512 path
 * and in the plain C one that stands in for it on CPUs without VNNI, so both give the same bits. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GG 32  /* inputs per activation group (and per int4 weight group) */
#define GB 16  /* output rows per block */
#define I4_REC (256 + 2 * GB * 2) /* bytes per int4 block and group: codes, float16 scales, float16 zeros */

typedef struct {
    int kind;
    const void *q;
    const float *scale;
    const float *zero;
    const float *exact; /* NULL, or (kind 4) the float32 weight (N, K): see "Shortlist" below */
    int shortlist;
} QuantWeightC;

/* Paths (selfspec_group_gemm_path): 0 plain C; 1 AVX512-VNNI (16 rows per instruction); 2 AVX2 (vpmaddubsw +
 * vpmaddwd in place of vpdpbusd, 8 rows per instruction); 3 AVX-VNNI (vpdpbusd on 8 rows). Every path gives the same
 * bits (the integer sums are exact; the float steps are the same per row). Path 3 runs the VEX AVX-VNNI build on CPUs
 * that have it (Intel since Alder Lake, AMD since Zen 5); elsewhere, when asked for, its EVEX twin (AVX512-VNNI at 256
 * bits), which stands in for it in the tests. Chosen once: AVX512-VNNI, else AVX-VNNI, else AVX2, else C. */
static int path = -1;

#define cpu_has(f) __builtin_cpu_supports(f)
static int cpu_512vnni(void) {
    __builtin_cpu_init();
    return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") && cpu_has("avx512vnni");
}
static int cpu_avxvnni(void) {
    __builtin_cpu_init();
    return cpu_has("avxvnni") && cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
}
static int cpu_avx2(void) {
    __builtin_cpu_init();
    return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
}
static int runs_here(int p) {
    return p == 0 || (p == 1 && cpu_512vnni()) || (p == 2 && cpu_avx2()) || (p == 3 && (cpu_avxvnni() || cpu_512vnni()));
}

int selfspec_group_gemm_path(int want) {
    if (path < 0) path = cpu_512vnni() ? 1 : cpu_avxvnni() ? 3 : cpu_avx2() ? 2 : 0;
    if (want >= 0 && want <= 3 && runs_here(want)) path = want;
    return path;
}

/* ---------------------------------------------------------------------------------------- input quantization */
/* Row of K floats -> xq (G * 32 int8, zero padded), sx (G), xs (G) = the group's sum of xq. */
static void quant_row_c(const float *x, int K, int G, int8_t *xq, float *sx, int32_t *xs) {
    for (int g = 0; g < G; g++) {
        const int k0 = g * GG, n = K - k0 < GG ? K - k0 : GG;
        float mx = 0.f;
        for (int k = 0; k < n; k++) mx = fmaxf(mx, fabsf(x[k0 + k]));
        const float s = mx > 0.f ? mx / 127.f : 1.f;
        int32_t t = 0;
        for (int k = 0; k < GG; k++) {
            const int v = k < n ? (int)lrintf(x[k0 + k] / s) : 0;
            xq[k0 + k] = (int8_t)v;
            t += v;
        }
        sx[g] = s;
        xs[g] = t;
    }
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static VNNI void quant_row_512(const float *x, int K, int G, int8_t *xq, float *sx, int32_t *xs) {
    for (int g = 0; g < G; g++) {
        const int k0 = g * GG, n = K - k0 < GG ? K - k0 : GG;
        const __mmask16 m0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
        const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
        const __m512 a = _mm512_maskz_loadu_ps(m0, x + k0), b = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float s = mx > 0.f ? mx / 127.f : 1.f;
        const __m512 sv = _mm512_set1_ps(s);
        /* cvtps rounds to nearest even (the default MXCSR mode), as lrintf */
        const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, sv));
        _mm_storeu_si128((__m128i *)(xq + k0), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + k0 + 16), _mm512_cvtsepi32_epi8(qb));
        sx[g] = s;
        xs[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* ---------------------------------------------------------------------------------------- plain C */
static float half_to_float(uint16_t h) { /* exact, as vcvtph2ps */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24: zero or a subnormal, exact in float32 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* One block of 16 output rows (nv of them real) against M input rows. */
static void i8_block_c(const int8_t *xq, int ldq, const float *sx, const int32_t *xs, int G, int M, const uint8_t *w,
                       const float *s, float *y, ptrdiff_t ldy, const float *bias, int nv) {
    for (int m = 0; m < M; m++)
        for (int r = 0; r < nv; r++) {
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                int32_t t = 0;
                for (int v = 0; v < 8; v++)
                    for (int j = 0; j < 4; j++)
                        t += (int32_t)w[(((ptrdiff_t)g * 8 + v) * GB + r) * 4 + j] * xq[(ptrdiff_t)m * ldq + GG * g + 4 * v + j];
                acc = fmaf((float)(t - 128 * xs[m * G + g]), sx[m * G + g], acc);
            }
            y[m * ldy + r] = bias ? fmaf(acc, s[r], bias[r]) : acc * s[r];
        }
}

static void i4_block_c(const int8_t *xq, int ldq, const float *sx, const float *zx, int G, int M, const uint8_t *w,
                       float *y, ptrdiff_t ldy, const float *bias, int nv) {
    for (int m = 0; m < M; m++)
        for (int r = 0; r < nv; r++) {
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                const uint8_t *rec = w + (ptrdiff_t)g * I4_REC;
                uint16_t sc[GB], zr[GB];
                memcpy(sc, rec + 256, sizeof sc);
                memcpy(zr, rec + 256 + sizeof sc, sizeof zr);
                const int8_t *xr = xq + (ptrdiff_t)m * ldq + GG * g;
                int32_t t = 0;
                for (int v = 0; v < 4; v++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t b = rec[(v * GB + r) * 4 + j];
                        t += (int32_t)(b & 15) * xr[8 * v + j] + (int32_t)(b >> 4) * xr[8 * v + 4 + j];
                    }
                const float f = half_to_float(sc[r]) * sx[m * G + g];
                acc = fmaf((float)t, f, acc);
                acc = fmaf(half_to_float(zr[r]), zx[m * G + g], acc);
            }
            y[m * ldy + r] = bias ? acc + bias[r] : acc;
        }
}

/* ---------------------------------------------------------------------------------------- AVX512-VNNI */
static inline VNNI __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline VNNI void store_rows(float *y, __m512 v, int nv) {
    if (nv == GB) _mm512_storeu_ps(y, v);
    else _mm512_mask_storeu_ps(y, (__mmask16)((1u << nv) - 1u), v);
}

/* One block of 16 output rows against M input rows. A thread reads its blocks front to back, one stream (blocks
 * read in pairs side by side made two streams that each jump a block every 9 KB, and streamed 10-20% slower from
 * memory on the EPYC); two integer sum chains per input row keep vpdpbusd's latency hidden. */
#define I8V(M)                                                                                               \
    static VNNI void i8v_##M(const int8_t *xq, int ldq, const float *sx, const int32_t *xs, int G,              \
                             const uint8_t *w, const float *s, float *y, ptrdiff_t ldy, const float *bias, int nv) { \
        __m512 acc[M];                                                                                       \
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            __m512i t[M], u[M]; /* even and odd v */                                                         \
            for (int m = 0; m < M; m++) t[m] = u[m] = _mm512_setzero_si512();                                \
            const uint8_t *wg = w + (ptrdiff_t)g * 8 * GB * 4;                                               \
            for (int v = 0; v < 8; v += 2) {                                                                 \
                const __m512i w0 = _mm512_loadu_si512(wg + v * GB * 4), w1 = _mm512_loadu_si512(wg + (v + 1) * GB * 4); \
                for (int m = 0; m < M; m++) {                                                                \
                    const int8_t *xr = xq + (ptrdiff_t)m * ldq + GG * g + 4 * v;                             \
                    t[m] = _mm512_dpbusd_epi32(t[m], w0, bcast4(xr));                                        \
                    u[m] = _mm512_dpbusd_epi32(u[m], w1, bcast4(xr + 4));                                    \
                }                                                                                            \
            }                                                                                                \
            for (int m = 0; m < M; m++) {                                                                    \
                const __m512i c = _mm512_set1_epi32(128 * xs[m * G + g]);                                    \
                const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(t[m], u[m]), c);                         \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sx[m * G + g]), acc[m]);      \
            }                                                                                                \
        }                                                                                                    \
        const __mmask16 mk = nv >= GB ? 0xFFFF : (__mmask16)((1u << nv) - 1u);                               \
        const __m512 sv = _mm512_maskz_loadu_ps(mk, s);                                                      \
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias) : _mm512_setzero_ps();                      \
        for (int m = 0; m < M; m++)                                                                          \
            store_rows(y + m * ldy, bias ? _mm512_fmadd_ps(acc[m], sv, bv) : _mm512_mul_ps(acc[m], sv), nv); \
    }
I8V(1) I8V(2) I8V(3) I8V(4) I8V(5) I8V(6) I8V(7) I8V(8)

#define I4V(M)                                                                                               \
    static VNNI void i4v_##M(const int8_t *xq, int ldq, const float *sx, const float *zx, int G,                \
                             const uint8_t *w, float *y, ptrdiff_t ldy, const float *bias, int nv) {         \
        const __m512i nib = _mm512_set1_epi8(0x0F);                                                          \
        __m512 acc[M];                                                                                       \
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            __m512i t[M], u[M]; /* low and high nibbles */                                                   \
            for (int m = 0; m < M; m++) t[m] = u[m] = _mm512_setzero_si512();                                \
            const uint8_t *rec = w + (ptrdiff_t)g * I4_REC;                                                  \
            for (int v = 0; v < 4; v++) {                                                                    \
                const __m512i wv = _mm512_loadu_si512(rec + 64 * v);                                         \
                const __m512i lo = _mm512_and_si512(wv, nib), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib); \
                for (int m = 0; m < M; m++) {                                                                \
                    const int8_t *xr = xq + (ptrdiff_t)m * ldq + GG * g + 8 * v;                             \
                    t[m] = _mm512_dpbusd_epi32(t[m], lo, bcast4(xr));                                        \
                    u[m] = _mm512_dpbusd_epi32(u[m], hi, bcast4(xr + 4));                                    \
                }                                                                                            \
            }                                                                                                \
            const __m512 scv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));            \
            const __m512 zv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256 + 2 * GB)));    \
            for (int m = 0; m < M; m++) {                                                                    \
                const __m512 f = _mm512_mul_ps(scv, _mm512_set1_ps(sx[m * G + g]));                          \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t[m], u[m])), f, acc[m]);       \
                acc[m] = _mm512_fmadd_ps(zv, _mm512_set1_ps(zx[m * G + g]), acc[m]);                         \
            }                                                                                                \
        }                                                                                                    \
        const __mmask16 mk = nv >= GB ? 0xFFFF : (__mmask16)((1u << nv) - 1u);                               \
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias) : _mm512_setzero_ps();                      \
        for (int m = 0; m < M; m++) store_rows(y + m * ldy, bias ? _mm512_add_ps(acc[m], bv) : acc[m], nv);  \
    }
I4V(1) I4V(2) I4V(3) I4V(4) I4V(5) I4V(6) I4V(7) I4V(8)

/* ---------------------------------------------------------------------------------------- 256 bits */
/* The same blocks as 8-row halves. DOT(t, w, x): t += the 4-byte dot products of unsigned w and signed x per lane.
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies and adds byte pairs into int16 (exact here: int4 codes are at most 15,
 * and int8 weights go in as |q| with x carrying q's sign, so no pair exceeds 2 * 127 * 127), vpmaddwd by ones adds
 * the pairs into int32. Its int8 sums are those of the signed codes (no offset to take off). */
#define DOT_AVX2(t, w, x) _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define DOT_VNNI_VEX(t, w, x) _mm256_dpbusd_avx_epi32(t, w, x)
#define DOT_VNNI_EVEX(t, w, x) _mm256_dpbusd_epi32(t, w, x)

static inline __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline void store8(float *y, __m256 v, int nv) { /* rows [0, nv) of 8 */
    if (nv >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < nv; i++) y[i] = t[i];
}

static inline __m256 load8(const float *p, int nv) {
    if (nv >= 8) return _mm256_loadu_ps(p);
    float t[8] = {0};
    for (int i = 0; i < nv; i++) t[i] = p[i];
    return _mm256_loadu_ps(t);
}

/* SIGNED: the int8 weights are made signed and |q| x sign(x, q) multiplied (AVX2); else offset binary, minus 128 xs. */
#define I8H(NAME, ATTR, DOT, SIGNED)                                                                         \
    static ATTR void NAME(const int8_t *xq, int ldq, const float *sx, const int32_t *xs, int G, int M,       \
                          const uint8_t *w, const float *s, float *y, ptrdiff_t ldy, const float *bias, int nv) { \
        for (int m = 0; m < M; m++)                                                                          \
            for (int h = 0; h < 2; h++) {                                                                    \
                const int n = nv - 8 * h < 8 ? nv - 8 * h : 8;                                               \
                if (n <= 0) break;                                                                           \
                __m256 acc = _mm256_setzero_ps();                                                            \
                for (int g = 0; g < G; g++) {                                                                \
                    __m256i t = _mm256_setzero_si256(), u = _mm256_setzero_si256();                          \
                    const uint8_t *wg = w + (ptrdiff_t)g * 8 * GB * 4 + 32 * h;                              \
                    const int8_t *xr = xq + (ptrdiff_t)m * ldq + GG * g;                                     \
                    for (int v = 0; v < 8; v += 2) {                                                         \
                        __m256i w0 = _mm256_loadu_si256((const __m256i *)(wg + v * GB * 4));                 \
                        __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + (v + 1) * GB * 4));           \
                        __m256i x0 = bcast4_256(xr + 4 * v), x1 = bcast4_256(xr + 4 * v + 4);                 \
                        if (SIGNED) {                                                                        \
                            const __m256i f = _mm256_set1_epi8((char)0x80);                                  \
                            w0 = _mm256_xor_si256(w0, f);                                                    \
                            w1 = _mm256_xor_si256(w1, f);                                                    \
                            x0 = _mm256_sign_epi8(x0, w0);                                                   \
                            x1 = _mm256_sign_epi8(x1, w1);                                                   \
                            w0 = _mm256_abs_epi8(w0);                                                        \
                            w1 = _mm256_abs_epi8(w1);                                                        \
                        }                                                                                    \
                        t = DOT(t, w0, x0);                                                                  \
                        u = DOT(u, w1, x1);                                                                  \
                    }                                                                                        \
                    __m256i d = _mm256_add_epi32(t, u);                                                      \
                    if (!(SIGNED)) d = _mm256_sub_epi32(d, _mm256_set1_epi32(128 * xs[m * G + g]));          \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sx[m * G + g]), acc);        \
                }                                                                                            \
                const __m256 sv = load8(s + 8 * h, n);                                                       \
                store8(y + m * ldy + 8 * h,                                                                  \
                       bias ? _mm256_fmadd_ps(acc, sv, load8(bias + 8 * h, n)) : _mm256_mul_ps(acc, sv), n);  \
            }                                                                                                \
    }

#define I4H(NAME, ATTR, DOT)                                                                                 \
    static ATTR void NAME(const int8_t *xq, int ldq, const float *sx, const float *zx, int G, int M,         \
                          const uint8_t *w, float *y, ptrdiff_t ldy, const float *bias, int nv) {            \
        const __m256i nib = _mm256_set1_epi8(0x0F);                                                          \
        for (int m = 0; m < M; m++)                                                                          \
            for (int h = 0; h < 2; h++) {                                                                    \
                const int n = nv - 8 * h < 8 ? nv - 8 * h : 8;                                               \
                if (n <= 0) break;                                                                           \
                __m256 acc = _mm256_setzero_ps();                                                            \
                for (int g = 0; g < G; g++) {                                                                \
                    __m256i t = _mm256_setzero_si256(), u = _mm256_setzero_si256();                          \
                    const uint8_t *rec = w + (ptrdiff_t)g * I4_REC;                                          \
                    const int8_t *xr = xq + (ptrdiff_t)m * ldq + GG * g;                                     \
                    for (int v = 0; v < 4; v++) {                                                            \
                        const __m256i wv = _mm256_loadu_si256((const __m256i *)(rec + 64 * v + 32 * h));     \
                        t = DOT(t, _mm256_and_si256(wv, nib), bcast4_256(xr + 8 * v));                       \
                        u = DOT(u, _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib), bcast4_256(xr + 8 * v + 4)); \
                    }                                                                                        \
                    const __m256 scv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));  \
                    const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));   \
                    const __m256 f = _mm256_mul_ps(scv, _mm256_set1_ps(sx[m * G + g]));                      \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(t, u)), f, acc);               \
                    acc = _mm256_fmadd_ps(zv, _mm256_set1_ps(zx[m * G + g]), acc);                           \
                }                                                                                            \
                store8(y + m * ldy + 8 * h, bias ? _mm256_add_ps(acc, load8(bias + 8 * h, n)) : acc, n);     \
            }                                                                                                \
    }

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VNNI256 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
I8H(i8_avx2, AVX2, DOT_AVX2, 1)
I8H(i8_avxvnni, AVXVNNI, DOT_VNNI_VEX, 0)
I8H(i8_vnni256, VNNI256, DOT_VNNI_EVEX, 0)
I4H(i4_avx2, AVX2, DOT_AVX2)
I4H(i4_avxvnni, AVXVNNI, DOT_VNNI_VEX)
I4H(i4_vnni256, VNNI256, DOT_VNNI_EVEX)

typedef void (*i8v_fn)(const int8_t *, int, const float *, const int32_t *, int, const uint8_t *, const float *,
                       float *, ptrdiff_t, const float *, int);
typedef void (*i4v_fn)(const int8_t *, int, const float *, const float *, int, const uint8_t *, float *, ptrdiff_t,
                       const float *, int);
static const i8v_fn i8v[9] = {0, i8v_1, i8v_2, i8v_3, i8v_4, i8v_5, i8v_6, i8v_7, i8v_8};
static const i4v_fn i4v[9] = {0, i4v_1, i4v_2, i4v_3, i4v_4, i4v_5, i4v_6, i4v_7, i4v_8};

/* ---------------------------------------------------------------------------------------- shortlist */
#define MAX_SHORTLIST 64

/* x . w over K floats: 16 lanes (lane l sums k = l mod 16 in order, fused), then the lanes in a fixed order. */
static float dot_c(const float *x, const float *w, int K) {
    float lane[16] = {0};
    for (int k = 0; k < K; k++) lane[k & 15] = fmaf(x[k], w[k], lane[k & 15]);
    float s = 0.f;
    for (int l = 0; l < 16; l++) s += lane[l];
    return s;
}

static VNNI float dot_512(const float *x, const float *w, int K) {
    __m512 acc = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc);
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), acc);
    }
    float lane[16], s = 0.f;
    _mm512_storeu_ps(lane, acc);
    for (int l = 0; l < 16; l++) s += lane[l];
    return s;
}

/* The S largest of y[0..N) (ties: lower index first) -> idx[0..S), S <= N, kept sorted largest first: the first S
 * by insertion, then a value enters when it beats the smallest kept one. The AVX-512 scan skips 16 values at a
 * time where none does (the same set, in the same order). */
static inline void keep(float v, int i, int n, int *idx, float *val) { /* insert into val[0..n), dropping val[n-1] */
    int j = n - 1;
    while (j > 0 && v > val[j - 1]) {
        val[j] = val[j - 1];
        idx[j] = idx[j - 1];
        j--;
    }
    val[j] = v;
    idx[j] = i;
}

static void shortlist_first(const float *y, int S, int *idx, float *val) {
    for (int i = 0; i < S; i++) keep(y[i], i, i + 1, idx, val);
}

static void shortlist(const float *y, int N, int S, int *idx, float *val) {
    shortlist_first(y, S, idx, val);
    for (int i = S; i < N; i++)
        if (y[i] > val[S - 1]) keep(y[i], i, S, idx, val);
}

static VNNI void shortlist_512(const float *y, int N, int S, int *idx, float *val) {
    shortlist_first(y, S, idx, val);
    int i = S;
    for (; i + 16 <= N; i += 16)
        if (_mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), _mm512_set1_ps(val[S - 1]), _CMP_GT_OQ))
            for (int t = i; t < i + 16; t++)
                if (y[t] > val[S - 1]) keep(y[t], t, S, idx, val);
    for (; i < N; i++)
        if (y[i] > val[S - 1]) keep(y[i], i, S, idx, val);
}

static void rescore(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                    const float *bias, int vnni) {
    const int S = w->shortlist < N ? w->shortlist : N;
    int idx[MAX_SHORTLIST];
    float val[MAX_SHORTLIST];
    for (int m = 0; m < M; m++) {
        float *yr = y + (ptrdiff_t)m * ldy;
        const float *xr = x + (ptrdiff_t)m * ldx;
        if (vnni) shortlist_512(yr, N, S, idx, val);
        else shortlist(yr, N, S, idx, val);
        for (int i = 0; i < S; i++) {
            const float *wr = w->exact + (ptrdiff_t)idx[i] * K;
            const float d = vnni ? dot_512(xr, wr, K) : dot_c(xr, wr, K);
            yr[idx[i]] = bias ? d + bias[idx[i]] : d;
        }
    }
}

/* ---------------------------------------------------------------------------------------- entry point */
/* kind 3 or 4 (above); any M >= 1 (input rows in groups of 8); N, K as the weight's unpadded shape. Returns 0, -1
 * for another kind, -2 when the quantized inputs cannot be allocated. */
int selfspec_group_gemm(const float *x, long ldx, int M, const QuantWeightC *w, int N, int K, float *y, long ldy,
                        const float *bias) {
    if (w->kind != 3 && w->kind != 4) return -1;
    if (w->exact && (w->kind != 4 || w->shortlist < 1 || w->shortlist > MAX_SHORTLIST)) return -1;
    const int pth = selfspec_group_gemm_path(-1), vnni = pth == 1;
    const int G = (K + GG - 1) / GG, ldq = G * GG, nb = (N + GB - 1) / GB;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)8 * ldq);
    float *sx = (float *)malloc(sizeof(float) * (size_t)8 * G * 2);
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)8 * G);
    if (!xq || !sx || !xs) {
        free(xq);
        free(sx);
        free(xs);
        return -2;
    }
    float *zx = sx + (size_t)8 * G; /* int4: sx * xs per group */
    const uint8_t *q = (const uint8_t *)w->q;
    const ptrdiff_t bbytes = w->kind == 3 ? (ptrdiff_t)G * 8 * GB * 4 : (ptrdiff_t)G * I4_REC;
    for (int m0 = 0; m0 < M; m0 += 8) {
        const int Mg = M - m0 < 8 ? M - m0 : 8;
        for (int m = 0; m < Mg; m++) {
            const float *xr = x + (ptrdiff_t)(m0 + m) * ldx;
            if (vnni) quant_row_512(xr, K, G, xq + (ptrdiff_t)m * ldq, sx + m * G, xs + m * G);
            else quant_row_c(xr, K, G, xq + (ptrdiff_t)m * ldq, sx + m * G, xs + m * G);
            for (int g = 0; g < G; g++) zx[m * G + g] = sx[m * G + g] * (float)xs[m * G + g];
        }
        float *yg = y + (ptrdiff_t)m0 * ldy;
        if (pth != 1) {
            typedef void (*h8_fn)(const int8_t *, int, const float *, const int32_t *, int, int, const uint8_t *,
                                  const float *, float *, ptrdiff_t, const float *, int);
            typedef void (*h4_fn)(const int8_t *, int, const float *, const float *, int, int, const uint8_t *,
                                  float *, ptrdiff_t, const float *, int);
            const h8_fn f8 = pth == 2 ? i8_avx2 : pth == 3 ? (cpu_avxvnni() ? i8_avxvnni : i8_vnni256) : i8_block_c;
            const h4_fn f4 = pth == 2 ? i4_avx2 : pth == 3 ? (cpu_avxvnni() ? i4_avxvnni : i4_vnni256) : i4_block_c;
#pragma omp parallel for schedule(static)
            for (int b = 0; b < nb; b++) {
                const int nv = N - GB * b < GB ? N - GB * b : GB;
                if (w->kind == 3)
                    f8(xq, ldq, sx, xs, G, Mg, q + b * bbytes, w->scale + GB * b, yg + GB * b, ldy,
                       bias ? bias + GB * b : NULL, nv);
                else
                    f4(xq, ldq, sx, zx, G, Mg, q + b * bbytes, yg + GB * b, ldy, bias ? bias + GB * b : NULL, nv);
            }
            continue;
        }
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nb; b++) {
            const int nv = N - GB * b < GB ? N - GB * b : GB;
            if (w->kind == 3)
                i8v[Mg](xq, ldq, sx, xs, G, q + b * bbytes, w->scale + GB * b, yg + GB * b, ldy, bias ? bias + GB * b : NULL, nv);
            else
                i4v[Mg](xq, ldq, sx, zx, G, q + b * bbytes, yg + GB * b, ldy, bias ? bias + GB * b : NULL, nv);
        }
    }
    free(xq);
    free(sx);
    free(xs);
    if (w->exact) rescore(x, ldx, M, w, N, K, y, ldy, bias, vnni);
    return 0;
}
