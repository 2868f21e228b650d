/* How fast this machine reads memory: a 512 MB buffer summed in 64-byte loads by every OpenMP thread, each thread
 * its own contiguous part, read as 1, 2, 4 or 8 interleaved streams; the best of 5 passes. The ceiling a
 * weight-streaming draft step is held against (BENCHMARKS.md, "Integer activations").
 *
 *   cc -O3 -fopenmp -o /tmp/read_bandwidth eval/kernels/read_bandwidth.c && OMP_NUM_THREADS=2 /tmp/read_bandwidth */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((target("avx2"))) static long long sum(const char *p, size_t n, int streams) {
    __m256i acc = _mm256_setzero_si256();
    const size_t per = n / streams;
    for (size_t i = 0; i < per; i += 64)
        for (int s = 0; s < streams; s++) {
            const char *q = p + s * per + i;
            acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_load_si256((const __m256i *)q),
                                                         _mm256_load_si256((const __m256i *)(q + 32))));
        }
    long long out[4];
    _mm256_storeu_si256((__m256i *)out, acc);
    return out[0] + out[1] + out[2] + out[3];
}

int main(void) {
    const size_t n = (size_t)512 << 20;
    char *p = aligned_alloc(4096, n);
    memset(p, 1, n);
    const int streams[] = {1, 2, 4, 8};
    for (int k = 0; k < 4; k++) {
        double best = 1e9;
        long long total = 0;
        for (int r = 0; r < 5; r++) {
            const double t0 = now();
#pragma omp parallel reduction(+ : total)
            {
                const int t = omp_get_thread_num(), T = omp_get_num_threads();
                const size_t part = n / T / 4096 * 4096;
                total += sum(p + t * part, part, streams[k]);
            }
            const double dt = now() - t0;
            if (dt < best) best = dt;
        }
        printf("%d thread(s), %d stream(s) each: %.1f GB/s (checksum %lld)\n", omp_get_max_threads(), streams[k],
               n / best / 1e9, total);
    }
    return 0;
}
