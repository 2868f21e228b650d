/* The matmuls of one decode step through a whole llama stack, timed in C (no Python between them): every format of
 * selfspec's kernels on the same shapes, passes interleaved so that drift hits them alike.
 *
 *   eval/kernels/step_gemms.sh [layers hidden qkv inter vocab rows repeats]   (SmolLM2-135M: 30 576 960 1536 49152)
 *   (SELFSPEC_GROUP_PATH=0|1|2|3 picks the _a8 kernels' path; SELFSPEC_BENCH_THP=1 advises huge pages)
 *
 * Weights hold random bytes (the timing does not depend on the values); each layer has its own, so a pass reads
 * every byte from memory as a draft step does. Prints the median ms per step and each format's share of float32. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

typedef struct {
    int kind;
    const void *q;
    const float *scale, *zero, *exact;
    int shortlist;
} QW;
int selfspec_small_gemm(const float *, long, int, const float *, int, int, float *, long, const float *);
int selfspec_quant_gemm(const float *, long, int, const QW *, int, int, float *, long, const float *);
int selfspec_gemm_isa(int);
int selfspec_group_gemm_path(int);
int selfspec_gemm_stream_rows(int);
int selfspec_gemm_prefetch_level(int);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void *big(size_t n) { /* SELFSPEC_BENCH_THP=1: 2 MB aligned and advised as huge pages */
    static int thp = -1;
    if (thp < 0) thp = getenv("SELFSPEC_BENCH_THP") && atoi(getenv("SELFSPEC_BENCH_THP"));
    if (!thp || n < (1u << 21)) return aligned_alloc(64, (n + 63) / 64 * 64);
    const size_t sz = (n + (1u << 21) - 1) & ~(size_t)((1u << 21) - 1);
    void *p = aligned_alloc(1u << 21, sz);
    madvise(p, sz, MADV_HUGEPAGE);
    return p;
}
static void *rnd(size_t n) {
    uint8_t *p = big(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rand() >> 7);
    return p;
}
static float *rndf(size_t n) {
    float *p = big(n * 4);
    for (size_t i = 0; i < n; i++) p[i] = (float)rand() / RAND_MAX - 0.5f;
    return p;
}
static QW make(int kind, int N, int K) {
    QW w = {kind, 0, 0, 0, 0, 0};
    const int G = (K + 31) / 32, nb = (N + 15) / 16;
    if (kind == 1) { w.q = rnd((size_t)N * K); w.scale = rndf(N); }
    if (kind == 2) { w.q = rnd((size_t)N * K / 2); w.scale = rndf((size_t)N * G); w.zero = rndf((size_t)N * G); }
    if (kind == 3) { w.q = rnd((size_t)nb * G * 512); w.scale = rndf(N); }
    if (kind == 4) { /* codes then float16 scales and zeros (random bytes are fine: the time does not depend on them) */
        uint8_t *q = rnd((size_t)nb * G * 320);
        for (size_t r = 0; r < (size_t)nb * G; r++) memset(q + r * 320 + 256, 0x3C, 64); /* 0x3C3C: a finite half */
        w.q = q;
    }
    return w;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    int L = 30, H = 576, QKV = 960, I = 1536, V = 49152, M = 1, R = 21;
    if (argc > 7) { L = atoi(argv[1]); H = atoi(argv[2]); QKV = atoi(argv[3]); I = atoi(argv[4]); V = atoi(argv[5]); M = atoi(argv[6]); R = atoi(argv[7]); }
    /* the float kernel's read order as gemm_tuning measured it on the AMD EPYC (rows read one by one up to 2
     * input rows, blocks prefetching into L2): SELFSPEC_GEMM_STREAM_ROWS / SELFSPEC_GEMM_PREFETCH override */
    selfspec_gemm_stream_rows(getenv("SELFSPEC_GEMM_STREAM_ROWS") ? atoi(getenv("SELFSPEC_GEMM_STREAM_ROWS")) : 2);
    selfspec_gemm_prefetch_level(getenv("SELFSPEC_GEMM_PREFETCH") ? atoi(getenv("SELFSPEC_GEMM_PREFETCH")) : 2);
    /* SELFSPEC_GROUP_PATH=0..3: the _a8 kernels' path (0 C, 1 AVX512-VNNI, 2 AVX2, 3 AVX-VNNI); default: this CPU's best */
    if (getenv("SELFSPEC_GROUP_PATH")) selfspec_group_gemm_path(atoi(getenv("SELFSPEC_GROUP_PATH")));
    const int shapes[4][2] = {{QKV, H}, {H, H}, {2 * I, H}, {H, I}};
    /* formats: 0 float32, then (name, kind for layers, kind for the LM head) */
    const char *names[] = {"float32", "int8 (int16 rows)", "int4_mlp (int16 rows)", "int4 (int16 rows)",
                           "int8 (int8 groups)", "int4_mlp (int8 groups)", "int4 (int8 groups)", "int4+int8 lm (groups)"};
    const int mlpk[] = {0, 1, 2, 2, 3, 4, 4, 4}, attk[] = {0, 1, 1, 2, 3, 3, 4, 4}, lmk[] = {0, 1, 1, 2, 3, 3, 4, 3};
    const int F = 8;
    float **fw = malloc(sizeof(float *) * L * 4);
    QW *qw = malloc(sizeof(QW) * L * 4 * 5); /* [layer][mat][kind] */
    for (int l = 0; l < L; l++)
        for (int j = 0; j < 4; j++) {
            fw[l * 4 + j] = rndf((size_t)shapes[j][0] * shapes[j][1]);
            for (int k = 1; k <= 4; k++) qw[(l * 4 + j) * 5 + k] = make(k, shapes[j][0], shapes[j][1]);
        }
    float *flm = rndf((size_t)V * H);
    QW lm[5];
    for (int k = 1; k <= 4; k++) lm[k] = make(k, V, H);
    float *x = rndf((size_t)16 * 2 * I), *y = rndf((size_t)16 * V);
    double *t = malloc(sizeof(double) * F * R);
    for (int rep = 0; rep < R + 2; rep++)
        for (int f = 0; f < F; f++) {
            const double t0 = now();
            for (int l = 0; l < L; l++)
                for (int j = 0; j < 4; j++) {
                    const int N = shapes[j][0], K = shapes[j][1], kind = j >= 2 ? mlpk[f] : attk[f];
                    if (!kind) selfspec_small_gemm(x, K, M, fw[l * 4 + j], N, K, y, N, NULL);
                    else selfspec_quant_gemm(x, K, M, &qw[(l * 4 + j) * 5 + kind], N, K, y, N, NULL);
                }
            if (!lmk[f]) selfspec_small_gemm(x, H, M, flm, V, H, y, V, NULL);
            else selfspec_quant_gemm(x, H, M, &lm[lmk[f]], V, H, y, V, NULL);
            if (rep >= 2) t[f * R + rep - 2] = now() - t0;
        }
    printf("%d layers, hidden %d, qkv %d, inter %d, vocab %d, %d input row(s), median of %d (isa %d, vnni path %d)\n",
           L, H, QKV, I, V, M, R, selfspec_gemm_isa(-1), selfspec_group_gemm_path(-1));
    double base = 0;
    for (int f = 0; f < F; f++) {
        qsort(t + f * R, R, sizeof(double), cmp);
        const double med = t[f * R + R / 2] * 1e3;
        if (!f) base = med;
        printf("  %-24s %7.3f ms  %.3f of float32\n", names[f], med, med / base);
    }
    return 0;
}
