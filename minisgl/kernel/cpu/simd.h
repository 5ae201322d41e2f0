/* What every file of the CPU kernels shares: the C library headers, the visibility of functions one file
 * defines for another, and the SIMD helpers (horizontal sums, a vectorised exp, the float vector `vf` of VW
 * lanes: 16 where AVX-512 is, else 8). HAVE_AVX2 says whether the vector forms are compiled at all (an older
 * CPU's build keeps the scalar forms only). */
#ifndef MINISGL_CPU_SIMD_H
#define MINISGL_CPU_SIMD_H

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A function one file of the library defines for another: not exported from the shared library (only the
 * entry points kernel/cpu/__init__.py binds are). */
#define HIDDEN __attribute__((visibility("hidden")))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The float vector the exact stored-weight dot works in: 16 lanes where AVX-512 is (one zmm holds half a
 * block of 32, twice the work an instruction of the AVX2 form), else 8. */
#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
#define vf_zero _mm512_setzero_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_mul _mm512_mul_ps
#define vf_set1 _mm512_set1_ps
/* the 16 lanes folded to 8 (lane i + lane i + 8): what hsum8x8 takes */
#define vf_fold8(a) _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))
#define vf_fma _mm512_fmadd_ps
#define vf_add _mm512_add_ps
#define vf_sum _mm512_reduce_add_ps
#else
typedef __m256 vf;
#define VW 8
#define vf_zero _mm256_setzero_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_mul _mm256_mul_ps
#define vf_set1 _mm256_set1_ps
#define vf_fold8(a) (a)
#define vf_fma _mm256_fmadd_ps
#define vf_add _mm256_add_ps
#define vf_sum hsum8
#endif

/* The 8 horizontal sums of a[0..7], as one vector. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* e^x, x clamped to [-87, 88]: x = n ln2 + r, e^x = 2^n p(r), p the Cephes expf polynomial (~1 ulp). */
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

#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#endif
