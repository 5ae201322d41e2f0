/* CPU kernels that torch ops cannot express without extra copies; built on first use by kernel/cpu.py
 * (the system C compiler, OpenMP from the runtime torch already loaded) and called through ctypes.
 *
 * decode_attention_f32: one query token per request, attending over the request's keys through the
 * token-level page table (position -> KV slot), with no gather into a padded copy. Each OpenMP task is one
 * (request, KV head): it reads every K/V row of that head once, for all the query heads of its GQA group,
 * with an online softmax over chunks of positions.
 *
 * pack_weight_f32 / linear_packed_f32 (AVX2 builds only): y = x W^T (+ b) for float32, W packed once.
 *
 * rms_norm_f32, silu_and_mul_f32, rotary_neox_f32, store_kv_f32: the per-layer elementwise steps, one call
 * each instead of 5-20 small torch ops (at decode's batch sizes their dispatch cost exceeds their work). */

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 32

/* The online-softmax state of one (request, KV head): running max m and sum l per query head, and the
 * unnormalised output acc [G, D]. */
static void online_softmax_init(float *m, float *l, float *acc, int G, int D) {
    for (int g = 0; g < G; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    for (int i = 0; i < G * D; i++) acc[i] = 0.0f;
}

static void online_softmax_finish(const float *acc, const float *l, int G, int D, float *out) {
    for (int g = 0; g < G; g++) {
        float inv = 1.0f / l[g];
        for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

/* Portable version: any G and D. Advances the online-softmax state (m, l, acc) over keys slots[0..len). */
static void attend_group_scalar(const float *q, const float *k, const float *v, int64_t slot_stride,
                                const int32_t *slots, int64_t len, int G, int D, float scale, float *m, float *l,
                                float *acc) {
    float s[G * CHUNK];

    for (int64_t start = 0; start < len; start += CHUNK) {
        int n = (int)(len - start < CHUNK ? len - start : CHUNK);
        for (int t = 0; t < n; t++) {
            const float *kr = k + (int64_t)slots[start + t] * slot_stride;
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qg[d] * kr[d];
                s[g * CHUNK + t] = dot * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float *sg = s + g * CHUNK, new_m = m[g];
            for (int t = 0; t < n; t++) new_m = sg[t] > new_m ? sg[t] : new_m;
            float corr = expf(m[g] - new_m), sum = 0.0f;
            for (int t = 0; t < n; t++) {
                sg[t] = expf(sg[t] - new_m);
                sum += sg[t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = new_m;
            float *ag = acc + g * D;
            for (int d = 0; d < D; d++) ag[d] *= corr;
        }
        for (int t = 0; t < n; t++) {
            const float *vr = v + (int64_t)slots[start + t] * slot_stride;
            for (int g = 0; g < G; g++) {
                float p = s[g * CHUNK + t], *ag = acc + g * D;
                for (int d = 0; d < D; d++) ag[d] += p * vr[d];
            }
        }
    }
    }

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

/* Vector version for D % (4 VW) == 0: 8 key rows' dot products at a time, the V sum in blocks of 4 VW floats
 * held in registers across a chunk (the chunk's V rows stay in L1 while each query head reads them). */
static void attend_group_vec(const float *q, const float *k, const float *v, int64_t slot_stride,
                              const int32_t *slots, int64_t len, int G, int D, float scale, float *m, float *l,
                              float *acc) {
    float corr[G];
    float s[G * CHUNK] __attribute__((aligned(32)));

    for (int64_t start = 0; start < len; start += CHUNK) {
        int n = (int)(len - start < CHUNK ? len - start : CHUNK);
        const int32_t *cs = slots + start;
        int t = 0;
        for (; t + 8 <= n; t += 8) {  // 8 rows at once: 8 independent FMA chains per query head
            const float *kr[8];
            for (int r = 0; r < 8; r++) kr[r] = k + (int64_t)cs[t + r] * slot_stride;
            // The rows are scattered through the pool, out of the hardware prefetcher's sight: fetch the
            // next 8 K rows and these 8 V rows (read by the V pass below) while the dots run.
            for (int r = 0; r < 8; r++) {
                const float *kn = t + 8 + r < len - start ? k + (int64_t)cs[t + 8 + r] * slot_stride : kr[r];
                const float *vn = v + (int64_t)cs[t + r] * slot_stride;
                for (int d = 0; d < D; d += 16) {
                    __builtin_prefetch(kn + d);
                    __builtin_prefetch(vn + d);
                }
            }
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                vf a[8];
                __m256 h[8];
                for (int r = 0; r < 8; r++) a[r] = vf_zero();
                for (int d = 0; d < D; d += VW) {
                    vf qv = vf_load(qg + d);
                    for (int r = 0; r < 8; r++) a[r] = vf_fma(qv, vf_load(kr[r] + d), a[r]);
                }
                for (int r = 0; r < 8; r++) h[r] = vf_fold8(a[r]);
                _mm256_store_ps(s + g * CHUNK + t, _mm256_mul_ps(hsum8x8(h), _mm256_set1_ps(scale)));
            }
        }
        for (; t < n; t++) {
            const float *kr = k + (int64_t)cs[t] * slot_stride;
            for (int g = 0; g < G; g++) {
                vf a0 = vf_zero();
                for (int d = 0; d < D; d += VW) a0 = vf_fma(vf_load(q + g * D + d), vf_load(kr + d), a0);
                s[g * CHUNK + t] = vf_sum(a0) * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float *sg = s + g * CHUNK, new_m = m[g], sum = 0.0f;
            for (int t = 0; t < n; t++) new_m = sg[t] > new_m ? sg[t] : new_m;
            __m256 mv = _mm256_set1_ps(new_m);
            for (int t = 0; t < n; t += 8) _mm256_store_ps(sg + t, exp8(_mm256_sub_ps(_mm256_load_ps(sg + t), mv)));
            for (int t = 0; t < n; t++) sum += sg[t];
            corr[g] = expf(m[g] - new_m);
            l[g] = l[g] * corr[g] + sum;
            m[g] = new_m;
        }
        for (int g = 0; g < G; g++) {
            const float *pg = s + g * CHUNK;
            float *ag = acc + g * D;
            vf c = vf_set1(corr[g]);
            for (int d0 = 0; d0 < D; d0 += 4 * VW) {
                vf a[4];
                for (int i = 0; i < 4; i++) a[i] = vf_mul(vf_load(ag + d0 + VW * i), c);
                for (int t = 0; t < n; t++) {
                    const float *vr = v + (int64_t)cs[t] * slot_stride + d0;
                    vf p = vf_set1(pg[t]);
                    for (int i = 0; i < 4; i++) a[i] = vf_fma(p, vf_load(vr + VW * i), a[i]);
                }
                for (int i = 0; i < 4; i++) vf_store(ag + d0 + VW * i, a[i]);
            }
        }
    }
    }
#define NR 16
#if defined(__AVX512F__)
#define MR 12 /* one zmm a row of a panel slice: 12 accumulators, enough chains for both FMA ports */
#else
#define MR 6
#endif
#define MB 96
#define KC 192

/* ---- linear: y = x W^T (+ b) ----------------------------------------------------------------------------
 * W is packed once into panels of NR=16 rows stored k-major ([K][16]), so the inner loop reads 16 outputs'
 * weights for one k as two vectors and multiplies them by one broadcast x value per row: 6 rows x 16
 * outputs = 12 accumulators, no horizontal sums. Rows are taken MB at a time (x block stays in L2), panels
 * split across threads. Measured against oneDNN's packed linear with weights streamed from memory as in a
 * decode step: 1.1-1.4x faster at 1-64 rows, 2x at 1,024. */

/* W [N, K] row-major -> panels of NR rows, each [K][NR] (rows past N are zero). */
void pack_weight_f32(const float *w, float *wp, int64_t N, int64_t K, int num_threads) {
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * K * NR;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                dst[k * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
    }
}

#if defined(__AVX512F__)
/* y[0..R) x [0..nr) (+)= R rows of x times one panel slice: R accumulators of 16 lanes, each x value an
 * embedded broadcast of its FMA; R a compile-time constant (1..12) so they stay in registers. */
static inline __attribute__((always_inline)) void micro_rows(const int R, const float *x, int64_t ldx,
                                                             const float *wp, int64_t K, float *y, int64_t ldy,
                                                             int nr, const float *bias, const float *next,
                                                             int accumulate) {
    __m512 a[12];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (next) _mm_prefetch((const char *)(next + k * NR), _MM_HINT_T1);  // one line of the next panel per k
        __m512 w = _mm512_loadu_ps(wp + k * NR);
#pragma GCC unroll 12
        for (int i = 0; i < R; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w, a[i]);
    }
    const __mmask16 mask = (__mmask16)((1u << nr) - 1);
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        float *yr = y + i * ldy;
        __m512 base = accumulate ? _mm512_maskz_loadu_ps(mask, yr)
                      : bias     ? _mm512_maskz_loadu_ps(mask, bias)
                                 : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(a[i], base));
    }
}
#else
/* y[0..R) x [0..nr) (+)= R rows of x times one panel slice: 2R accumulators, R a compile-time constant
 * (1..6) so they stay in registers. */
static inline __attribute__((always_inline)) void micro_rows(const int R, const float *x, int64_t ldx,
                                                             const float *wp, int64_t K, float *y, int64_t ldy,
                                                             int nr, const float *bias, const float *next,
                                                             int accumulate) {
    __m256 a[6], b[6];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) a[i] = b[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (next) _mm_prefetch((const char *)(next + k * NR), _MM_HINT_T1);  // one line of the next panel per k
        __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
            a[i] = _mm256_fmadd_ps(xb, w0, a[i]);
            b[i] = _mm256_fmadd_ps(xb, w1, b[i]);
        }
    }
    float out[NR];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(out, a[i]);
        _mm256_storeu_ps(out + 8, b[i]);
        float *yr = y + i * ldy;
        for (int j = 0; j < nr; j++) yr[j] = out[j] + (accumulate ? yr[j] : bias ? bias[j] : 0.0f);
    }
}

#endif

#define MICRO(R)                                                                                            \
    static void micro_##R(const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy,    \
                          int nr, const float *bias, const float *next, int accumulate) {                    \
        micro_rows(R, x, ldx, wp, K, y, ldy, nr, bias, next, accumulate);                                   \
    }
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
#if MR > 6
MICRO(7) MICRO(8) MICRO(9) MICRO(10) MICRO(11) MICRO(12)
#endif
typedef void (*micro_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, const float *,
                         const float *, int);
static const micro_fn MICROS[MR + 1] = {0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6,
#if MR > 6
                                        micro_7, micro_8, micro_9, micro_10, micro_11, micro_12
#endif
};

/* Rows of x the next micro-kernel call takes when `left` remain: the calls of an MR-row block split it evenly
 * (16 rows as 8 + 8, not 12 + 4: a call of few rows has too few FMA chains to cover their latency). */
static inline int micro_rows_of(int64_t left) {
    const int64_t calls = (left + MR - 1) / MR;
    return (int)((left + calls - 1) / calls);
}

/* The work of linear_packed_f32 for the threads of an enclosing parallel region (alone: one thread); x and y
 * with row strides ldx and ldy. */
static void linear_packed_work(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                               int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        int64_t mend = m0 + MB < M ? m0 + MB : M;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int nr = (int)(N - p * NR < NR ? N - p * NR : NR);
            const float *b = bias ? bias + p * NR : 0;
            const float *panel = wp + p * K * NR, *next = p + 1 < panels ? panel + K * NR : 0;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {  // a KC-deep slice of the panel stays in L1 across rows
                int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t m = m0; m < mend; m += micro_rows_of(mend - m)) {
                    int mr = micro_rows_of(mend - m);
                    MICROS[mr](x + m * ldx + k0, ldx, panel + k0 * NR, kc, y + m * ldy + p * NR, ldy, nr, b,
                               m == m0 && next ? next + k0 * NR : 0, k0 > 0);
                }
            }
        }
    }
}

void linear_packed_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_packed_work(x, K, wp, bias, y, N, M, N, K);
}

#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* Advances (m, l, acc) over keys slots[0..len) for the G query heads q [G, D] of one KV head. */
static void attend_group(const float *q, const float *k, const float *v, int64_t slot_stride,
                         const int32_t *slots, int64_t len, int G, int D, float scale, float *m, float *l,
                         float *acc) {
#if HAVE_AVX2
    if (D % (4 * VW) == 0) {
        attend_group_vec(q, k, v, slot_stride, slots, len, G, D, scale, m, l, acc);
        return;
    }
#endif
    attend_group_scalar(q, k, v, slot_stride, slots, len, G, D, scale, m, l, acc);
}

#define SPLIT_MIN 64 /* keys per split at least */

/* q, out: [B, Hq, D], rows q_stride floats apart for q, contiguous for out. k, v: [slots, Hkv, D]
 * contiguous. page_table: [rows, table_stride] int32. rows[b]: request b's page-table row; lens[b]: its
 * number of keys (all positions up to and including the query's), of which a layer with a sliding window
 * (window > 0) attends the last `window`. Query head h reads KV head h / (Hq / Hkv).
 * For the threads of an enclosing parallel region. One task per (request, KV head); where there are fewer
 * than two a thread (a lone request), each task's keys are cut into splits whose softmax states are
 * merged after: with 3 KV heads on 2 threads one thread would otherwise attend twice as long. */
static void decode_attention_work(const float *q, int64_t q_stride, const float *k, const float *v,
                                  const int32_t *page_table, int64_t table_stride, const int64_t *rows,
                                  const int64_t *lens, float *out, int B, int Hq, int Hkv, int D, float scale,
                                  int64_t window) {
    const int G = Hq / Hkv, nt = omp_get_num_threads();
    const int64_t slot_stride = (int64_t)Hkv * D;
#define FIRST_KEY(b) (window > 0 && lens[b] > window ? lens[b] - window : 0)
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = lens[b] - FIRST_KEY(b) > longest ? lens[b] - FIRST_KEY(b) : longest;
    int S = B * Hkv < 2 * nt ? (2 * nt + B * Hkv - 1) / (B * Hkv) : 1;
    if (S > longest / SPLIT_MIN) S = longest / SPLIT_MIN > 1 ? (int)(longest / SPLIT_MIN) : 1;
    if (S == 1) {
#pragma omp for collapse(2) schedule(dynamic)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < Hkv; h++) {
                float m[G], l[G], acc[G * D];
                int64_t o_off = ((int64_t)b * Hq + (int64_t)h * G) * D;
                const int64_t first = FIRST_KEY(b);
                online_softmax_init(m, l, acc, G, D);
                attend_group(q + b * q_stride + (int64_t)h * G * D, k + (int64_t)h * D, v + (int64_t)h * D,
                             slot_stride, page_table + rows[b] * table_stride + first, lens[b] - first, G, D,
                             scale, m, l, acc);
                online_softmax_finish(acc, l, G, D, out + o_off);
            }
        }
        return;
    }
    float *part = 0;  // per (request, head, split): m [G], l [G], acc [G, D]
    const int64_t W = (int64_t)G * (D + 2);
#pragma omp single copyprivate(part)
    part = (float *)malloc(sizeof(float) * B * Hkv * S * W);
#pragma omp for collapse(3) schedule(dynamic)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hkv; h++)
            for (int sp = 0; sp < S; sp++) {
                float *pm = part + (((int64_t)b * Hkv + h) * S + sp) * W, *pl = pm + G, *pa = pl + G;
                const int64_t first = FIRST_KEY(b), n = lens[b] - first;
                int64_t per = (n + S - 1) / S, lo = first + sp * per, hi = lo + per < lens[b] ? lo + per : lens[b];
                online_softmax_init(pm, pl, pa, G, D);
                if (lo < hi)
                    attend_group(q + b * q_stride + (int64_t)h * G * D, k + (int64_t)h * D, v + (int64_t)h * D,
                                 slot_stride, page_table + rows[b] * table_stride + lo, hi - lo, G, D, scale, pm,
                                 pl, pa);
            }
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hkv; h++)
            for (int g = 0; g < G; g++) {
                const float *p0 = part + ((int64_t)b * Hkv + h) * S * W;
                float mx = -FLT_MAX, den = 0.0f, *o = out + ((int64_t)b * Hq + (int64_t)h * G + g) * D;
                for (int sp = 0; sp < S; sp++) mx = p0[sp * W + g] > mx ? p0[sp * W + g] : mx;
                for (int d = 0; d < D; d++) o[d] = 0.0f;
                for (int sp = 0; sp < S; sp++) {
                    const float *pm = p0 + sp * W;
                    float c = pm[g] == -FLT_MAX ? 0.0f : expf(pm[g] - mx);  // an empty split adds nothing
                    den += pm[G + g] * c;
                    for (int d = 0; d < D; d++) o[d] += pm[2 * G + g * D + d] * c;
                }
                for (int d = 0; d < D; d++) o[d] /= den;
            }
#pragma omp single
    free(part);
#undef FIRST_KEY
}

void decode_attention_f32(const float *q, const float *k, const float *v, const int32_t *page_table,
                          int64_t table_stride, const int64_t *rows, const int64_t *lens, float *out, int B,
                          int Hq, int Hkv, int D, float scale, int64_t window, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    decode_attention_work(q, (int64_t)Hq * D, k, v, page_table, table_stride, rows, lens, out, B, Hq, Hkv, D,
                          scale, window);
}

/* ---- elementwise ---------------------------------------------------------------------------------------- */

/* One row: out = x' / rms(x') * w with x' = x (+ residual); with a residual, x' is also written to
 * residual_out (which may be the residual itself). */
static void rms_row(const float *xr, const float *residual, float *residual_out, const float *w, float *o,
                    int64_t H, float eps) {
    float sum = 0.0f;
    if (residual) {
        for (int64_t i = 0; i < H; i++) {
            float r = xr[i] + residual[i];
            residual_out[i] = r;
            sum += r * r;
        }
        xr = residual_out;
    } else {
        for (int64_t i = 0; i < H; i++) sum += xr[i] * xr[i];
    }
    float inv = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xr[i] * inv);
}

/* rms_row over M rows; row strides are in floats (x_stride for x, H for the others). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *residual_out, const float *w,
                  float *out, int64_t M, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H > 16384)
    for (int64_t m = 0; m < M; m++)
        rms_row(x + m * x_stride, residual ? residual + m * H : 0, residual ? residual_out + m * H : 0, w,
                out + m * H, H, eps);
}

static inline float silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* One row: out [I] = silu(g) * u. */
static void silu_row(const float *g, const float *u, float *o, int64_t I) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) o[i] = silu_mul1(g[i], u[i]);
}

/* x = [gate | up] per row (row stride x_stride) -> out [M, I] = silu(gate) * up. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t M, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I > 16384)
    for (int64_t m = 0; m < M; m++) silu_row(x + m * x_stride, x + m * x_stride + I, out + m * I, I);
}

/* Neox-style rotary, in place, on the first `rot` dims of each of the H heads of x (contiguous, D apart);
 * cs: cos then sin of the position's rot/2 frequencies. */
static void rotary_heads(float *x, int H, int D, const float *cs, int rot) {
    int half = rot / 2;
    const float *sn = cs + half;
    for (int h = 0; h < H; h++, x += D)
        for (int i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cs[i] - x2 * sn[i];
            x[i + half] = x2 * cs[i] + x1 * sn[i];
        }
}

/* rotary_heads on every token of q [T, Hq, D] and k [T, Hk, D] (token strides in floats, heads
 * contiguous); cos_sin [max_pos, rot] holds cos then sin for the rot/2 frequencies. */
void rotary_neox_f32(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
                     const float *cos_sin, int64_t T, int Hq, int Hk, int D, int rot) {
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * rot;
        rotary_heads(q + t * q_stride, Hq, D, cs, rot);
        rotary_heads(k + t * k_stride, Hk, D, cs, rot);
    }
}

/* k_cache[loc[t]] = k[t], v_cache[loc[t]] = v[t]; a row is `row` floats, k/v token strides in floats. */
void store_kv_f32(float *k_cache, float *v_cache, const int64_t *loc, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + loc[t] * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + loc[t] * row, v + t * v_stride, row * sizeof(float));
    }
}

/* ---- GGUF weights as stored: block formats dequantized inside the kernels -------------------------------
 * A stored weight [N, K] is N rows of K/QK blocks (the file's bytes, row-major). Each block is dequantized
 * with the reference's arithmetic: every product of a scale and a quant is exact in float32 (an fp16
 * scale has 11 significant bits, the quants and sub-scales at most 13), so the one rounding per weight is
 * the final add of Q4_1/Q4_K's minimum and the dequantized values equal gguf.quants.dequantize bit for bit,
 * whatever the compiler contracts. The products with the activations then accumulate in float32: the
 * result is the float32 GEMM on the dequantized weights up to summation order. */

enum {
    GT_F32 = 0, GT_F16 = 1, GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8, GT_Q2_K = 10,
    GT_Q3_K = 11, GT_Q4_K = 12, GT_Q5_K = 13, GT_Q6_K = 14, GT_IQ4_NL = 20, GT_IQ4_XS = 23, GT_BF16 = 30
};

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000 | (man << 13);  // inf / nan
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int64_t qk_of(int type) {
    if (type == GT_F32 || type == GT_F16 || type == GT_BF16) return 1;
    return (type >= GT_Q2_K && type <= GT_Q6_K) || type == GT_IQ4_XS ? 256 : 32;
}

static int64_t block_bytes(int type) {
    switch (type) {
    case GT_F32: return 4;
    case GT_F16: case GT_BF16: return 2;
    case GT_Q4_0: return 18;
    case GT_Q4_1: return 20;
    case GT_Q5_0: return 22;
    case GT_Q5_1: return 24;
    case GT_Q8_0: return 34;
    case GT_Q2_K: return 84;
    case GT_Q3_K: return 110;
    case GT_Q4_K: return 144;
    case GT_Q5_K: return 176;
    case GT_Q6_K: return 210;
    case GT_IQ4_NL: return 18;
    case GT_IQ4_XS: return 136;
    default: return 0;
    }
}

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and minimum from Q4_K/Q5_K's 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *sc, int j, int *s, int *m) {
    if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *s = (sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

#if HAVE_AVX2
/* One block of 32 dequantized into 32 / VW vectors (Q4_0, Q4_1, Q8_0), the same arithmetic as deq_*. The
 * fp16 scale (and Q4_1's minimum) are converted as a broadcast word: no scalar round trip. */
#if VW == 16
static inline __attribute__((always_inline)) void deq32(const int type, const uint8_t *src, vf v[2]) {
    __m512 d, m = _mm512_setzero_ps();
    if (type == GT_Q4_1) {  // [d m d m ...] -> all d, all m
        __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(*(const int32_t *)src));
        d = _mm512_moveldup_ps(dm);
        m = _mm512_movehdup_ps(dm);
    } else {
        d = _mm512_cvtph_ps(_mm256_set1_epi16(*(const int16_t *)src));
    }
    if (type == GT_Q8_0) {
        for (int i = 0; i < 2; i++)
            v[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2 + 16 * i)))), d);
        return;
    }
    // the 16 values a nibble stands for, computed once a block (Q4_1: q * d is exact, so the fused
    // multiply-add rounds once like the reference's add), then looked up: vpermps reads an index's low 4
    // bits only, so the low nibbles need no mask (11% off the one-row dot against converting each nibble)
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = type == GT_Q4_1 ? _mm512_fmadd_ps(iota, d, m)
                                         : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), d);
    // the 16 bytes widened once: their low nibbles are elements 0..15, their high nibbles 16..31
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + (type == GT_Q4_1 ? 4 : 2))));
    v[0] = _mm512_permutexvar_ps(a, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), table);
}
#else
static inline __attribute__((always_inline)) void deq32(const int type, const uint8_t *src, __m256 v[4]) {
    __m256 d, m = _mm256_setzero_ps();
    if (type == GT_Q4_1) {  // [d m d m ...] -> all d, all m
        __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(*(const int32_t *)src));
        d = _mm256_moveldup_ps(dm);
        m = _mm256_movehdup_ps(dm);
    } else {
        d = _mm256_cvtph_ps(_mm_set1_epi16(*(const int16_t *)src));
    }
    // zero/sign-extending loads straight from memory: one shuffle per 8 quants
    if (type == GT_Q8_0) {
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 2 + 8 * i)))), d);
        return;
    }
    const uint8_t *qs = src + (type == GT_Q4_1 ? 4 : 2);
    const __m256i m4 = _mm256_set1_epi32(0x0f);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    __m256 f[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(a, m4)), _mm256_cvtepi32_ps(_mm256_and_si256(b, m4)),
                   _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
    if (type == GT_Q4_1) {  // q * d is exact: the fused multiply-add rounds once, like the reference's add
        for (int i = 0; i < 4; i++) v[i] = _mm256_fmadd_ps(f[i], d, m);
    } else {
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(_mm256_sub_ps(f[i], eight), d);
    }
}
#endif
#endif

#if HAVE_AVX2
/* Integer lanes beside vf: VW bytes zero-extended to 32 bits, shifts by a count known at run time. */
#if VW == 16
typedef __m512i vi;
#define vi_u8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define vi_set1 _mm512_set1_epi32
#define vi_srl(a, n) _mm512_srl_epi32(a, _mm_cvtsi32_si128(n))
#define vi_srlv _mm512_srlv_epi32
#define vi_sll(a, n) _mm512_sll_epi32(a, _mm_cvtsi32_si128(n))
#define vi_and _mm512_and_si512
#define vi_or _mm512_or_si512
#define vi_sub _mm512_sub_epi32
#define vi_iota _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define vi_ps _mm512_cvtepi32_ps
#else
typedef __m256i vi;
#define vi_u8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define vi_set1 _mm256_set1_epi32
#define vi_srl(a, n) _mm256_srl_epi32(a, _mm_cvtsi32_si128(n))
#define vi_srlv _mm256_srlv_epi32
#define vi_sll(a, n) _mm256_sll_epi32(a, _mm_cvtsi32_si128(n))
#define vi_and _mm256_and_si256
#define vi_or _mm256_or_si256
#define vi_sub _mm256_sub_epi32
#define vi_iota _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define vi_ps _mm256_cvtepi32_ps
#endif

static inline int is_kquant(int type) { return type >= GT_Q2_K && type <= GT_Q6_K; }

/* A K-quant block's scales, once a block: sub-block j's values are q dl[j] + nml[j] (Q4_K/Q5_K: 8
 * sub-blocks of 32; Q2_K/Q3_K/Q6_K: 16 of 16), each dl a product of an fp16 scale and a small integer,
 * exact in float32, as the reference's. */
static inline __attribute__((always_inline)) void kscales(const int type, const uint8_t *src, float dl[16],
                                                          float nml[16]) {
#define U8X4(p) _mm_cvtepu8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(p))) /* 4 bytes -> 4 int32 lanes */
    if (type == GT_Q4_K || type == GT_Q5_K) {  // get_scale_min_k4 for the 8 sub-blocks, four lanes at a time
        const __m128 d = _mm_set1_ps(fp16_to_f32(rd16(src))), ndmin = _mm_set1_ps(-fp16_to_f32(rd16(src + 2)));
        const __m128i b0 = U8X4(src + 4), b1 = U8X4(src + 8), b2 = U8X4(src + 12), m63 = _mm_set1_epi32(63);
        const __m128i s_lo = _mm_and_si128(b0, m63), m_lo = _mm_and_si128(b1, m63);
        const __m128i s_hi = _mm_or_si128(_mm_and_si128(b2, _mm_set1_epi32(15)), _mm_slli_epi32(_mm_srli_epi32(b0, 6), 4));
        const __m128i m_hi = _mm_or_si128(_mm_srli_epi32(b2, 4), _mm_slli_epi32(_mm_srli_epi32(b1, 6), 4));
        _mm_storeu_ps(dl, _mm_mul_ps(d, _mm_cvtepi32_ps(s_lo)));
        _mm_storeu_ps(dl + 4, _mm_mul_ps(d, _mm_cvtepi32_ps(s_hi)));
        // -(dmin m) as the reference's dmin m, negated: the same magnitude, rounded once
        _mm_storeu_ps(nml, _mm_mul_ps(ndmin, _mm_cvtepi32_ps(m_lo)));
        _mm_storeu_ps(nml + 4, _mm_mul_ps(ndmin, _mm_cvtepi32_ps(m_hi)));
    } else if (type == GT_Q6_K) {
        const __m128 d = _mm_set1_ps(fp16_to_f32(rd16(src + 208)));
        for (int j = 0; j < 16; j += 4)
            _mm_storeu_ps(dl + j, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(src + 192 + j))))));
    } else if (type == GT_Q2_K) {
        const __m128 d = _mm_set1_ps(fp16_to_f32(rd16(src + 80))), ndmin = _mm_set1_ps(-fp16_to_f32(rd16(src + 82)));
        for (int j = 0; j < 16; j += 4) {
            const __m128i b = U8X4(src + j);
            _mm_storeu_ps(dl + j, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_and_si128(b, _mm_set1_epi32(15)))));
            _mm_storeu_ps(nml + j, _mm_mul_ps(ndmin, _mm_cvtepi32_ps(_mm_srli_epi32(b, 4))));
        }
    } else if (type == GT_Q3_K) {  // scale j: low 4 bits from byte j % 8 (nibble j / 8), high 2 from 8 + j % 4
        const __m128 d = _mm_set1_ps(fp16_to_f32(rd16(src + 108)));
        const uint8_t *sc = src + 96;
        const __m128i hb = U8X4(sc + 8);
        for (int j = 0; j < 16; j += 4) {
            const __m128i lo = _mm_and_si128(_mm_srli_epi32(U8X4(sc + j % 8), 4 * (j / 8)), _mm_set1_epi32(15));
            const __m128i hi = _mm_and_si128(_mm_srli_epi32(hb, 2 * (j / 4)), _mm_set1_epi32(3));
            const __m128i q = _mm_sub_epi32(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi32(32));
            _mm_storeu_ps(dl + j, _mm_mul_ps(d, _mm_cvtepi32_ps(q)));
        }
    }
#undef U8X4
}

#if VW == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DEQ_TABLES 1 /* Q4_K/Q5_K values looked up in a table of the run's 16 (32) values */
#else
#define DEQ_TABLES 0
#endif

/* Run c (0..7) of 32 values of the K-quant block at src into 32 / VW vectors; dl/nml: its kscales. */
static inline __attribute__((always_inline)) void deq_krun(const int type, const uint8_t *src, const int c,
                                                           const float *dl, const float *nml, vf v[32 / VW]) {
    const int h = c / 4, s = c % 4;  // for the 2-, 3- and 6-bit types: half, quarter
    if (type == GT_Q4_K || type == GT_Q5_K) {  // run c is sub-block c: its nibbles (and fifth bits)
        const uint8_t *qs = src + (type == GT_Q5_K ? 48 : 16) + c / 2 * 32, *qh = src + 16;
#if DEQ_TABLES
        // the 16 values a nibble stands for, q dl + nml rounded once as the reference's, looked up by vpermps
        // (which reads an index's low 4 bits); Q5_K's fifth bit picks the upper table through a lane mask
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 dv = _mm512_set1_ps(dl[c]), mv = _mm512_set1_ps(nml[c]);
        const __m512 lo = _mm512_fmadd_ps(iota, dv, mv);
        for (int i = 0; i < 2; i++) {
            __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i)));
            if (c % 2) a = _mm512_srli_epi32(a, 4);
            v[i] = _mm512_permutexvar_ps(a, lo);
            if (type == GT_Q5_K) {
                const __m512 hi = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), dv, mv);
                const __mmask16 k = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(qh + 16 * i)),
                                                        _mm_set1_epi8((char)(1 << c)));
                v[i] = _mm512_mask_permutexvar_ps(v[i], k, a, hi);
            }
        }
#else
        const vf dv = vf_set1(dl[c]), mv = vf_set1(nml[c]);
        for (int i = 0; i < 32 / VW; i++) {
            vi q = vi_and(vi_srl(vi_u8(qs + i * VW), c % 2 * 4), vi_set1(0xf));
            if (type == GT_Q5_K) q = vi_or(q, vi_sll(vi_and(vi_srl(vi_u8(qh + i * VW), c), vi_set1(1)), 4));
            v[i] = vf_fma(vi_ps(q), dv, mv);
        }
#endif
        return;
    }
    const float *dlr = dl + 8 * h + 2 * s, *nmlr = nml + 8 * h + 2 * s;  // this run's two sub-blocks
    if (type == GT_Q6_K) {  // run c: quarter s of half h; its low 4 bits in ql, its high 2 in qh
        const uint8_t *ql = src + 64 * h + 32 * (s % 2), *qh = src + 128 + 32 * h;
#if VW == 16
        // the 32 quants built a byte each (16-bit shifts, masks clearing what crosses from the next byte),
        // widened 16 at a time
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)ql), s / 2 * 4),
                                     _mm256_set1_epi8(0x0f));
        __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), _mm_cvtsi32_si128(2 * s));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
        v[0] = _mm512_mul_ps(_mm512_set1_ps(dlr[0]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        v[1] = _mm512_mul_ps(_mm512_set1_ps(dlr[1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
#else
        for (int i = 0; i < 32 / VW; i++) {
            vi q = vi_and(vi_srl(vi_u8(ql + i * VW), s / 2 * 4), vi_set1(0xf));
            q = vi_or(q, vi_sll(vi_and(vi_srl(vi_u8(qh + i * VW), 2 * s), vi_set1(3)), 4));
            v[i] = vf_mul(vf_set1(dlr[i * VW / 16]), vi_ps(vi_sub(q, vi_set1(32))));
        }
#endif
        return;
    }
    if (type == GT_Q2_K) {  // run c: bits 2s of half h's 32 bytes
        const uint8_t *qs = src + 16 + 32 * h;
        for (int i = 0; i < 32 / VW; i++) {
            vi q = vi_and(vi_srl(vi_u8(qs + i * VW), 2 * s), vi_set1(3));
            v[i] = vf_fma(vi_ps(q), vf_set1(dlr[i * VW / 16]), vf_set1(nmlr[i * VW / 16]));
        }
        return;
    }
    if (type == GT_Q3_K) {  // as Q2_K's quants, minus 4 where bit 4h + s of hmask's byte is clear
        const uint8_t *hm = src, *qs = src + 32 + 32 * h;
        for (int i = 0; i < 32 / VW; i++) {
            vi q = vi_and(vi_srl(vi_u8(qs + i * VW), 2 * s), vi_set1(3));
            q = vi_or(q, vi_sll(vi_and(vi_srl(vi_u8(hm + i * VW), 4 * h + s), vi_set1(1)), 2));  // + 4 hbit
            v[i] = vf_mul(vf_set1(dlr[i * VW / 16]), vi_ps(vi_sub(q, vi_set1(4))));
        }
        return;
    }
}

#if VW == 16
/* Runs c = 4h + s and c + 2 (s 0 or 1) of a Q6_K block at once, into v[0..1] and v[2..3]: the two share
 * their ql bytes (low nibbles, high nibbles) and qh bytes (bits 2s..2s+1, 2s+4..2s+5), read once. dl: the
 * block's kscales. The same arithmetic as deq_krun's. */
static inline __attribute__((always_inline)) void deq_q6k_pair(const uint8_t *src, const int h, const int s,
                                                               const float *dl, vf v[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(src + 64 * h + 32 * s));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(src + 128 + 32 * h));
    // the two high bits of each run moved to bits 4-5 (16-bit shifts: what crosses bytes is masked off)
    const __m256i h0 = _mm256_and_si256(s ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4), m30);
    const __m256i h1 = _mm256_and_si256(s ? _mm256_srli_epi16(qh, 2) : qh, m30);
    const __m256i q0 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(ql, m4), h0), k32);
    const __m256i q1 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m4), h1), k32);
    const float *d0 = dl + 8 * h + 2 * s, *d1 = d0 + 4;  // runs c and c + 2: two 16-value scales each
    v[0] = _mm512_mul_ps(_mm512_set1_ps(d0[0]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q0))));
    v[1] = _mm512_mul_ps(_mm512_set1_ps(d0[1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q0, 1))));
    v[2] = _mm512_mul_ps(_mm512_set1_ps(d1[0]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q1))));
    v[3] = _mm512_mul_ps(_mm512_set1_ps(d1[1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q1, 1))));
}
#endif

/* Values [32 idx, 32 idx + 32) of a stored row dequantized into 32 / VW vectors, for every quantized type:
 * Q4_0/Q4_1/Q8_0 through deq32, the others here with the scalar routines' arithmetic (each product of a
 * scale and a quant exact, the fused multiply-add rounding once where the reference subtracts or adds). A
 * K-quant's idx names its block (idx / 8) and the run of 32 in it (idx % 8); dl/nml are that block's
 * kscales. */
static inline __attribute__((always_inline)) void deq_chunk(const int type, const uint8_t *row, int64_t idx,
                                                            const float *dl, const float *nml, vf v[32 / VW]) {
    if (type == GT_Q4_0 || type == GT_Q4_1 || type == GT_Q8_0) {
        deq32(type, row + idx * block_bytes(type), v);
        return;
    }
    if (type == GT_Q5_0 || type == GT_Q5_1) {  // values j and j + 16: byte j's nibbles; fifth bits in qh
        const uint8_t *src = row + idx * block_bytes(type);
        const int off = type == GT_Q5_1 ? 4 : 2;
        const vf d = vf_set1(fp16_to_f32(rd16(src)));
        const vf m = vf_set1(type == GT_Q5_1 ? fp16_to_f32(rd16(src + 2)) : 0.0f);
        uint32_t qh;
        memcpy(&qh, src + off, 4);
#if DEQ_TABLES
        // as Q5_K: the 16 values of the nibbles without, then with, the fifth bit; value e's bit is qh's bit e
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 lo = type == GT_Q5_1 ? _mm512_fmadd_ps(iota, d, m) : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(16.0f)), d);
        const __m512 hi = type == GT_Q5_1 ? _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d, m) : _mm512_mul_ps(iota, d);
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + off + 4)));
        v[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(a, lo), (__mmask16)qh, a, hi);
        const __m512i b = _mm512_srli_epi32(a, 4);
        v[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(b, lo), (__mmask16)(qh >> 16), b, hi);
        return;
#endif
        for (int i = 0; i < 32 / VW; i++) {
            const int e = i * VW;  // the first value of this vector
            vi q = vi_and(vi_srl(vi_u8(src + off + 4 + e % 16), e / 16 * 4), vi_set1(0xf));
            q = vi_or(q, vi_sll(vi_and(vi_srlv(vi_set1((int)(qh >> e)), vi_iota), vi_set1(1)), 4));
            v[i] = type == GT_Q5_1 ? vf_fma(vi_ps(q), d, m) : vf_mul(vi_ps(vi_sub(q, vi_set1(16))), d);
        }
        return;
    }
    deq_krun(type, row + idx / 8 * block_bytes(type), (int)(idx % 8), dl, nml, v);
}
#endif

/* Q4_0 / Q4_1 / Q8_0: n elements (a multiple of 32) of consecutive blocks, (q - 8) d, q d + m, q d. */
static void deq_q32(int type, const uint8_t *src, int64_t n, float *out) {
    const int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < n; b += 32, src += bb, out += 32) {
#if HAVE_AVX2
        vf v[32 / VW];
        if (type == GT_Q4_0) deq32(GT_Q4_0, src, v);
        else if (type == GT_Q4_1) deq32(GT_Q4_1, src, v);
        else deq32(GT_Q8_0, src, v);
        for (int i = 0; i < 32 / VW; i++) vf_store(out + VW * i, v[i]);
#else
        const float d = fp16_to_f32(rd16(src));
        if (type == GT_Q8_0) {
            for (int j = 0; j < 32; j++) out[j] = (float)((const int8_t *)src)[2 + j] * d;
            continue;
        }
        const float m = type == GT_Q4_1 ? fp16_to_f32(rd16(src + 2)) : 0.0f;
        const uint8_t *qs = src + (type == GT_Q4_1 ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            if (type == GT_Q4_1) {
                out[j] = (float)(qs[j] & 0xf) * d + m;
                out[j + 16] = (float)(qs[j] >> 4) * d + m;
            } else {
                out[j] = (float)((qs[j] & 0xf) - 8) * d;
                out[j + 16] = (float)((qs[j] >> 4) - 8) * d;
            }
        }
#endif
    }
}

#if !HAVE_AVX2 /* the scalar forms of deq_chunk (which AVX2 builds use instead) */
/* Q5_0 / Q5_1: Q4_0 / Q4_1 with a fifth bit a value, the 32 of a block in one little-endian word qh after
 * the scale (and minimum): (q - 16) d, q d + m. */
static void deq_q5(int type, const uint8_t *src, int64_t n, float *out) {
    const int64_t bb = block_bytes(type), off = type == GT_Q5_1 ? 4 : 2;
    for (int64_t b = 0; b < n; b += 32, src += bb, out += 32) {
        const float d = fp16_to_f32(rd16(src)), m = type == GT_Q5_1 ? fp16_to_f32(rd16(src + 2)) : 0.0f;
        uint32_t qh;
        memcpy(&qh, src + off, 4);
        const uint8_t *qs = src + off + 4;
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 0xf) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            if (type == GT_Q5_1) {
                out[j] = (float)lo * d + m;
                out[j + 16] = (float)hi * d + m;
            } else {
                out[j] = (float)(lo - 16) * d;
                out[j + 16] = (float)(hi - 16) * d;
            }
        }
    }
}

/* Q2_K: 16 sub-blocks of 16, each a byte of 4-bit scale | 4-bit minimum; 2-bit quants, four to a byte (byte
 * l of each half of 32 bytes holds values l, l + 32, l + 64, l + 96 of that half); then d, dmin. */
static void deq_q2_k(const uint8_t *src, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b += 256, src += 84, out += 256) {
        const uint8_t *sc = src, *qs = src + 16;
        const float d = fp16_to_f32(rd16(src + 80)), dmin = fp16_to_f32(rd16(src + 82));
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s = e / 32 % 4, l = e % 32, j = e / 16;
            const float dl = d * (float)(sc[j] & 0xf), ml = dmin * (float)(sc[j] >> 4);
            out[e] = dl * (float)((qs[32 * h + l] >> (2 * s)) & 3) - ml;
        }
    }
}

/* Q3_K: a high bit a value in hmask [32] (value e's in byte e % 32, bit e / 32; a clear bit subtracts 4),
 * 2-bit quants as Q2_K's, 16 six-bit signed scales packed in 12 bytes, then d. */
static void deq_q3_k(const uint8_t *src, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b += 256, src += 110, out += 256) {
        const uint8_t *hm = src, *qs = src + 32, *sc = src + 96;
        const float d = fp16_to_f32(rd16(src + 108));
        float dl[16];
        for (int j = 0; j < 16; j++) {
            const int lo = (sc[j % 8] >> (4 * (j / 8))) & 0xf, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
            dl[j] = d * (float)((lo | hi << 4) - 32);
        }
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s = e / 32 % 4, l = e % 32;
            const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hm[l] >> (e / 32)) & 1) ? 0 : 4);
            out[e] = dl[e / 16] * (float)q;
        }
    }
}

/* Q4_K: 8 sub-blocks of 32 with 6-bit scales and minimums packed in 12 bytes. Q5_K (q5 1): the same with
 * a fifth bit a value in qh [32] before the nibbles (sub-block j's in bit j). */
static void deq_q45_k(int q5, const uint8_t *src, int64_t n, float *out) {
    const int64_t bb = q5 ? 176 : 144;
    for (int64_t b = 0; b < n; b += 256, src += bb, out += 256) {
        const float d = fp16_to_f32(rd16(src)), dmin = fp16_to_f32(rd16(src + 2));
        const uint8_t *sc = src + 4, *qh = src + 16, *qs = src + (q5 ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int s, m;
            scale_min_k4(sc, j, &s, &m);
            const float dl = d * (float)s, ml = dmin * (float)m;
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            float *o = out + j * 32;
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 0xf) | (q5 ? ((qh[l] >> j) & 1) << 4 : 0);
                o[l] = dl * (float)v - ml;
            }
        }
    }
}

/* Q6_K: ql [128] low nibbles, qh [64] high 2 bits, 16 int8 scales of 16 values each, then d. */
static void deq_q6_k(const uint8_t *src, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b += 256, src += 210, out += 256) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *sc = (const int8_t *)(src + 192);
        const float d = fp16_to_f32(rd16(src + 208));
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8) {
            float *o = out + h * 128;
            float s[8];
            for (int i = 0; i < 8; i++) s[i] = d * (float)sc[i];
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                o[l] = s[is] * (float)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = s[is + 2] * (float)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = s[is + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = s[is + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}
#endif

/* IQ4_NL (a block of 32: d, 16 bytes of nibbles) and IQ4_XS (a block of 256: d, the high 2 bits of 8
 * six-bit scales in a little-endian word, their low 4 bits in 4 bytes' nibbles, 8 runs of 16 bytes): each
 * nibble indexes ggml's kvalues_iq4nl, times d (IQ4_NL) or the sub-block's d (scale - 32); the first 16
 * values of a run of 32 are its bytes' low nibbles, the next 16 their high nibbles. Every product exact,
 * as the reference's. */
static const float IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void deq_iq4(int type, const uint8_t *src, int64_t n, float *out) {
    const int64_t bb = block_bytes(type), runs = type == GT_IQ4_XS ? 8 : 1;
    for (int64_t b = 0; b < n; b += 32 * runs, src += bb) {
        const float d = fp16_to_f32(rd16(src));
        const uint8_t *qs = src + (type == GT_IQ4_XS ? 8 : 2);
        for (int64_t c = 0; c < runs; c++, out += 32, qs += 16) {
            float dl = d;
            if (type == GT_IQ4_XS) {
                const int lo = (src[4 + c / 2] >> (4 * (c % 2))) & 0xf, hi = (rd16(src + 2) >> (2 * c)) & 3;
                dl = d * (float)((lo | hi << 4) - 32);
            }
#if DEQ_TABLES
            const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(IQ4_VALUES), _mm512_set1_ps(dl));
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
            _mm512_storeu_ps(out, _mm512_permutexvar_ps(a, t));  // vpermps reads an index's low 4 bits
            _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), t));
#else
            for (int j = 0; j < 16; j++) {
                out[j] = dl * IQ4_VALUES[qs[j] & 0xf];
                out[j + 16] = dl * IQ4_VALUES[qs[j] >> 4];
            }
#endif
        }
    }
}

/* fp16 / bf16 (bf: 1) -> float32: exact widening. */
static void deq_half(const uint8_t *src, int64_t n, float *out, int bf) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m256 f = bf ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
        _mm256_storeu_ps(out + i, f);
    }
#endif
    for (; i < n; i++) out[i] = bf ? bf16_to_f32(rd16(src + 2 * i)) : fp16_to_f32(rd16(src + 2 * i));
}

/* Elements [k0, k0 + n) of one stored row, k0 and n multiples of the block size. */
static void dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, float *out) {
    const uint8_t *src = row + k0 / qk_of(type) * block_bytes(type);
#if HAVE_AVX2
    float dl[16], nml[16];
#endif
    switch (type) {
    case GT_F32: memcpy(out, src, n * sizeof(float)); break;
    case GT_F16: deq_half(src, n, out, 0); break;
    case GT_BF16: deq_half(src, n, out, 1); break;
    case GT_Q4_0:
    case GT_Q4_1:
    case GT_Q8_0: deq_q32(type, src, n, out); break;
    case GT_IQ4_NL:
    case GT_IQ4_XS: deq_iq4(type, src, n, out); break;
#if HAVE_AVX2
#define DEQ_RUNS(T)                                                                                          \
    for (int64_t i = 0; i < n / 32; i++) {                                                                   \
        vf v[32 / VW];                                                                                       \
        if (is_kquant(T) && (k0 / 32 + i) % 8 == 0) kscales(T, src + i / 8 * block_bytes(T), dl, nml);        \
        deq_chunk(T, row, k0 / 32 + i, dl, nml, v);                                                          \
        for (int j = 0; j < 32 / VW; j++) vf_store(out + 32 * i + VW * j, v[j]);                             \
    }
    case GT_Q5_0: DEQ_RUNS(GT_Q5_0); break;
    case GT_Q5_1: DEQ_RUNS(GT_Q5_1); break;
    case GT_Q2_K: DEQ_RUNS(GT_Q2_K); break;
    case GT_Q3_K: DEQ_RUNS(GT_Q3_K); break;
    case GT_Q4_K: DEQ_RUNS(GT_Q4_K); break;
    case GT_Q5_K: DEQ_RUNS(GT_Q5_K); break;
    case GT_Q6_K: DEQ_RUNS(GT_Q6_K); break;
#undef DEQ_RUNS
#else
    case GT_Q5_0:
    case GT_Q5_1: deq_q5(type, src, n, out); break;
    case GT_Q2_K: deq_q2_k(src, n, out); break;
    case GT_Q3_K: deq_q3_k(src, n, out); break;
    case GT_Q4_K: deq_q45_k(0, src, n, out); break;
    case GT_Q5_K: deq_q45_k(1, src, n, out); break;
    case GT_Q6_K: deq_q6_k(src, n, out); break;
#endif
    default: break;
    }
}

/* Whether this build knows the type (0: the caller refuses it). */
int stored_type_supported(int type) { return block_bytes(type) > 0; }

/* out[i] = row rows[i] of the stored [*, K] weight (rows NULL: rows 0..n-1): embedding lookups. */
void dequant_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *rows, int64_t n, int64_t K,
                  float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * K > 65536)
    for (int64_t i = 0; i < n; i++) dequant_span(type, w + (rows ? rows[i] : i) * row_bytes, 0, K, out + i * K);
}

#define QKC 256 /* K elements dequantized at a time: a multiple of every block size */
#define GR 4    /* weight rows per task on the dot path */
#define PF_AHEAD 8 /* groups ahead that the dot path prefetches */
#ifndef DOT_MAX
#define DOT_MAX 6 /* rows of x up to which the dot path beats the panel path (its dequantizing and transposes) */
#endif

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;  // vectorised by the compiler (-fassociative-math)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The dot path (one activation row, or any row count without AVX2): GR weight rows at a time, QKC of K
 * dequantized into L1 and reused by every activation row. */
static void linear_stored_dot_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                              const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t groups = (N + GR - 1) / GR;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        float buf[GR * QKC] __attribute__((aligned(32)));
        int nr = (int)(N - g * GR < GR ? N - g * GR : GR);
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < nr; r++) y[m * ldy + g * GR + r] = bias ? bias[g * GR + r] : 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += QKC) {
            int64_t kc = K - k0 < QKC ? K - k0 : QKC;
            for (int r = 0; r < nr; r++) dequant_span(type, w + (g * GR + r) * row_bytes, k0, kc, buf + r * QKC);
            for (int64_t m = 0; m < M; m++) {
                const float *xr = x + m * ldx + k0;
                float *yr = y + m * ldy + g * GR;
                for (int r = 0; r < nr; r++) yr[r] += dot_f32(buf + r * QKC, xr, kc);
            }
        }
    }
}

/* The dot paths' task loop (the exact one over float rows of x, the int8 one over quantized rows): GR weight
 * rows a task, `pass` rows of x a call of fn (as many as the registers hold; the group's blocks come from L1
 * after the first pass), the group PF_AHEAD groups on (its rows are contiguous) prefetched while this one
 * computes. Past MB_DOT rows of x the rows go in blocks of MB_DOT, each against every group, so a block's
 * rows stay in L2 while the weights stream through once a block. fn(type, rows, x, ld, p, K, pf, pf_len,
 * out) dots the rows; x's rows are ld elements of elem bytes apart. */
#define PASS_MAX 6 /* rows of x a call of a group_fn at most */
#define MB_DOT 128 /* rows of x a block of the dot paths */
typedef void (*group_fn)(int type, int M, const void *x, int64_t ld, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]);
static void dot_tasks_work(group_fn fn, int pass, const void *x, int64_t ld, size_t elem, const uint8_t *w,
                           int type, int64_t row_bytes, const float *bias, float *y, int64_t ldy, int64_t M,
                           int64_t N, int64_t K) {
    const int64_t groups = (N + GR - 1) / GR;
    for (int64_t mb = 0; mb < M; mb += MB_DOT) {
        const int64_t mend = M - mb < MB_DOT ? M : mb + MB_DOT;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p[GR];
            float out[GR][PASS_MAX];
            int nr = (int)(N - g * GR < GR ? N - g * GR : GR);
            for (int r = 0; r < GR; r++) p[r] = w + (g * GR + (r < nr ? r : 0)) * row_bytes;  // tail: row 0 again
            for (int64_t m0 = mb; m0 < mend; m0 += pass) {
                int mr = (int)(mend - m0 < pass ? mend - m0 : pass);
                fn(type, mr, (const char *)x + m0 * ld * (int64_t)elem, ld, p, K,
                   w + (g + PF_AHEAD) * GR * row_bytes, m0 > mb ? 0 : GR * row_bytes, out);
                for (int m = 0; m < mr; m++)
                    for (int r = 0; r < nr; r++)
                        y[(m0 + m) * ldy + g * GR + r] = out[r][m] + (bias ? bias[g * GR + r] : 0.0f);
            }
        }
    }
}

#if HAVE_AVX2
/* acc[m] += 32 weights v . x row m's 32 values at x (rows ldx apart), M (1..3) rows; one row of x keeps two
 * chains (acc[0][0], acc[0][1]) so the dependent adds stay short, more rows are chains enough. */
static inline __attribute__((always_inline)) void dot_rows(const int M, const vf v[32 / VW], const float *x,
                                                           int64_t ldx, vf acc[3][2]) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        if (M == 1) {
            for (int i = 0; i < 32 / VW; i++) acc[0][i % 2] = vf_fma(v[i], vf_load(xm + VW * i), acc[0][i % 2]);
        } else {
            vf a = acc[m][0];
            for (int i = 0; i < 32 / VW; i++) a = vf_fma(v[i], vf_load(xm + VW * i), a);
            acc[m][0] = a;
        }
    }
}

/* out[r][m] = row r of the GR weight rows p[] dotted with x row m, for M (1..3) rows of x: each block is
 * dequantized into registers once and multiplied into all M rows (for one row of x two accumulators a weight
 * row, so the chains of dependent adds stay short): deq_chunk for the quantized types. type 0 (half and float rows)
 * reads rows already dequantized into buf [GR][QKC] a chunk
 * at a time instead. pf [pf_len): memory the next groups read, prefetched a slice per chunk (a core's own
 * prefetchers keep too few rows in flight for this rate: measured 5 GB/s without, on the 2-core EPYC). */
static inline __attribute__((always_inline)) void dot_group(const int type, const int M, const float *x,
                                                            int64_t ldx, const uint8_t *const p[GR], int wtype,
                                                            int64_t K, const uint8_t *pf, int64_t pf_len,
                                                            float out[GR][PASS_MAX]) {
    vf acc[GR][3][2];
    float buf[GR * QKC] __attribute__((aligned(32)));
    float kdl[GR][16], knml[GR][16];  // a K-quant block's scales, each row's
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) acc[r][m][0] = acc[r][m][1] = vf_zero();  // [1]: M == 1 only
    const int64_t chunks = (K + QKC - 1) / QKC;
    const int64_t pf_step = (pf_len + chunks - 1) / chunks;
    for (int64_t k0 = 0, c = 0; k0 < K; k0 += QKC, c++) {
        int64_t kc = K - k0 < QKC ? K - k0 : QKC;
        for (int64_t line = c * pf_step; line < (c + 1) * pf_step && line < pf_len; line += 64)
            _mm_prefetch((const char *)(pf + line), _MM_HINT_T0);
        if (is_kquant(type)) {  // QKC is one block a row: its scales, then its 8 runs (their offsets constant)
            const uint8_t *blk[GR];
            for (int r = 0; r < GR; r++) {
                blk[r] = p[r] + k0 / 256 * block_bytes(type);
                kscales(type, blk[r], kdl[r], knml[r]);
            }
#if VW == 16
            if (type == GT_Q6_K) {  // runs in pairs that share their bytes
#pragma GCC unroll 4
                for (int pr = 0; pr < 4; pr++)
                    for (int r = 0; r < GR; r++) {
                        vf v[4];
                        const int c = 4 * (pr / 2) + pr % 2;
                        deq_q6k_pair(blk[r], pr / 2, pr % 2, kdl[r], v);
                        dot_rows(M, v, x + k0 + 32 * c, ldx, acc[r]);
                        dot_rows(M, v + 2, x + k0 + 32 * (c + 2), ldx, acc[r]);
                    }
                continue;
            }
#endif
#pragma GCC unroll 8
            for (int c8 = 0; c8 < 8; c8++)
                for (int r = 0; r < GR; r++) {
                    vf v[32 / VW];
                    deq_krun(type, blk[r], c8, kdl[r], knml[r], v);
                    dot_rows(M, v, x + k0 + 32 * c8, ldx, acc[r]);
                }
            continue;
        }
        if (!type)
            for (int r = 0; r < GR; r++) dequant_span(wtype, p[r], k0, kc, buf + r * QKC);
        for (int64_t k = 0; k < kc; k += 32) {
            for (int r = 0; r < GR; r++) {
                vf v[32 / VW];
                if (type) {
                    deq_chunk(type, p[r], (k0 + k) / 32, 0, 0, v);
                } else {
                    for (int i = 0; i < 32 / VW; i++) v[i] = vf_load(buf + r * QKC + k + VW * i);
                }
                dot_rows(M, v, x + k0 + k, ldx, acc[r]);
            }
        }
    }
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) out[r][m] = vf_sum(M == 1 ? vf_add(acc[r][m][0], acc[r][m][1]) : acc[r][m][0]);
}

#define DOT_CASE(T, MM) dot_group(T, MM, x, ldx, p, type, K, pf, pf_len, out)
static void dot_group_any(int type, int M, const float *x, int64_t ldx, const uint8_t *const p[GR], int64_t K,
                          const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
#define DOT_TYPE(T)                                                                                         \
    case T: M == 1 ? DOT_CASE(T, 1) : M == 2 ? DOT_CASE(T, 2) : DOT_CASE(T, 3); break;
    switch (type) {  // every quantized type dequantized into registers; half and float rows through buf
    DOT_TYPE(GT_Q4_0)
    DOT_TYPE(GT_Q4_1)
    DOT_TYPE(GT_Q5_0)
    DOT_TYPE(GT_Q5_1)
    DOT_TYPE(GT_Q8_0)
    DOT_TYPE(GT_Q2_K)
    DOT_TYPE(GT_Q3_K)
    DOT_TYPE(GT_Q4_K)
    DOT_TYPE(GT_Q5_K)
    DOT_TYPE(GT_Q6_K)
    default: M == 1 ? DOT_CASE(0, 1) : M == 2 ? DOT_CASE(0, 2) : DOT_CASE(0, 3); break;
    }
#undef DOT_TYPE
}

static void dot_group_fn(int type, int M, const void *x, int64_t ldx, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    dot_group_any(type, M, (const float *)x, ldx, p, K, pf, pf_len, out);
}

/* The dot path for 1..DOT_MAX rows of x. */
static void linear_stored_dot_avx2_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                                        const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                                        int64_t K) {
    dot_tasks_work(dot_group_fn, 3, x, ldx, sizeof(float), w, type, row_bytes, bias, y, ldy, M, N, K);
}

/* dst [8][ldd] = src [8][lds] transposed. */
static inline void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_store_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_store_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

/* The panel path (4 rows of x and more): NR weight rows x QKC dequantized once into the k-major panel
 * layout of linear_packed_f32 and run through its micro-kernels for every MR rows of x. */
static void linear_stored_panel_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                                const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                                int64_t K) {
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        int64_t mend = m0 + MB < M ? m0 + MB : M;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            float tmp[NR * QKC] __attribute__((aligned(32))), buf[QKC * NR] __attribute__((aligned(32)));
            int nr = (int)(N - p * NR < NR ? N - p * NR : NR);
            const float *b = bias ? bias + p * NR : 0;
            for (int64_t k0 = 0; k0 < K; k0 += QKC) {
                int64_t kc = K - k0 < QKC ? K - k0 : QKC;
                for (int j = 0; j < NR; j++)  // rows past N: row 0 again, its outputs never written
                    dequant_span(type, w + (p * NR + (j < nr ? j : 0)) * row_bytes, k0, kc, tmp + j * QKC);
                for (int64_t k = 0; k < kc; k += 8) {
                    transpose8(tmp + k, QKC, buf + k * NR, NR);
                    transpose8(tmp + 8 * QKC + k, QKC, buf + k * NR + 8, NR);
                }
                for (int64_t m = m0; m < mend; m += micro_rows_of(mend - m)) {
                    int mr = micro_rows_of(mend - m);
                    MICROS[mr](x + m * ldx + k0, ldx, buf, kc, y + m * ldy + p * NR, ldy, nr, b, 0, k0 > 0);
                }
            }
        }
    }
}
#endif

#if VW == 16
#ifndef XT_PF
#define XT_PF 1
#endif
#ifndef XT_HINT
#define XT_HINT _MM_HINT_T1
#endif
#define XT_MIN 16 /* rows of x from which the stored GEMM puts x's rows in the lanes (fewer: lanes idle) */
/* The panel path with x's rows in the 16 lanes instead of W's (AVX-512): x is transposed once into blocks of
 * 16 rows, [k][16 rows], so each panel of 16 weight rows is dequantized row by row as stored and read back
 * as broadcasts, with no transposes of W (which cost as much as the dequantizing at decode's row counts).
 * acc[n] holds output column n for the block's 16 rows; partial sums over K chunks wait in yacc. */
static void linear_stored_xt_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                                  const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t mblocks = (M + 15) / 16, panels = (N + 15) / 16;
    // x transposed, [mblocks][K][16] with rows past M zero, in a buffer the thread that fills it keeps across
    // calls (a fresh one each call came back as new pages, faulted in and zeroed by the kernel each time);
    // per thread, so regions started by different threads at once never share one
    static __thread float *xt_buf;
    static __thread size_t xt_cap;
    float *xt = 0;
#pragma omp single copyprivate(xt)
    {
        size_t need = (size_t)(mblocks * K * 16) * sizeof(float);
        if (need > xt_cap) {
            free(xt_buf);
            xt_buf = (float *)aligned_alloc(64, (need + 63) / 64 * 64);
            xt_cap = xt_buf ? need : 0;
        }
        xt = xt_buf;
    }
    if (!xt) abort();  // out of memory: nothing sensible to compute
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mblocks; mb++)
        for (int64_t k = 0; k < K; k++)
            for (int i = 0; i < 16; i++) {
                int64_t m = mb * 16 + i;
                xt[(mb * K + k) * 16 + i] = m < M ? x[m * ldx + k] : 0.0f;
            }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float tmp[16 * QKC] __attribute__((aligned(64)));
        float yacc[8 * 16 * 16] __attribute__((aligned(64)));  // up to 8 row blocks at a time
        int nr = (int)(N - p * 16 < 16 ? N - p * 16 : 16);
        for (int64_t mb0 = 0; mb0 < mblocks; mb0 += 8) {
            int64_t nmb = mblocks - mb0 < 8 ? mblocks - mb0 : 8;
            for (int64_t k0 = 0; k0 < K; k0 += QKC) {
                int64_t kc = K - k0 < QKC ? K - k0 : QKC;
                for (int j = 0; j < 16; j++)  // rows past N: row 0 again, its outputs never written
                    dequant_span(type, w + (p * 16 + (j < nr ? j : 0)) * row_bytes, k0, kc, tmp + j * QKC);
                if (XT_PF && p + XT_PF < panels) {  // the same chunk of a later panel's rows, into L2
                    const int64_t lo = k0 / 32 * 0, bytes = row_bytes * kc / K + 64;
                    (void)lo;
                    for (int j = 0; j < 16; j++) {
                        const char *r = (const char *)(w + ((p + XT_PF) * 16 + j) * row_bytes) + row_bytes * k0 / K;
                        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, XT_HINT);
                    }
                }
                for (int64_t b = 0; b < nmb; b++) {
                    __m512 acc[16];
                    float *ya = yacc + b * 256;
                    for (int n = 0; n < 16; n++) acc[n] = k0 ? _mm512_load_ps(ya + n * 16) : _mm512_setzero_ps();
                    const float *xb = xt + ((mb0 + b) * K + k0) * 16;
                    for (int64_t k = 0; k < kc; k++) {
                        __m512 xv = _mm512_load_ps(xb + k * 16);
#pragma GCC unroll 16
                        for (int n = 0; n < 16; n++) acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(tmp[n * QKC + k]), xv, acc[n]);
                    }
                    for (int n = 0; n < 16; n++) _mm512_store_ps(ya + n * 16, acc[n]);
                }
            }
            for (int64_t b = 0; b < nmb; b++)
                for (int i = 0; i < 16; i++) {
                    int64_t m = (mb0 + b) * 16 + i;
                    if (m >= M) break;
                    float *yr = y + m * ldy + p * 16;
                    for (int n = 0; n < nr; n++) yr[n] = yacc[b * 256 + n * 16 + i] + (bias ? bias[p * 16 + n] : 0.0f);
                }
        }
    }
}
#endif

/* linear_stored's work for the threads of an enclosing parallel region (alone: one thread). */
static void linear_stored_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                               const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
#if HAVE_AVX2
#if VW == 16
    if (M >= XT_MIN) {
        linear_stored_xt_work(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K);
        return;
    }
#endif
    if (M > DOT_MAX || (M > 3 && K % 32)) {
        linear_stored_panel_work(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K);
        return;
    }
    if (M >= 1 && K % 32 == 0) {
        linear_stored_dot_avx2_work(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K);
        return;
    }
#endif
    linear_stored_dot_work(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K);
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the stored W [N, K], transposed (+ bias). */
void linear_stored(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_stored_work(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K);
}

/* ---- the int8-activation dot (opt-in: --stored-dot int8) ------------------------------------------------
 * llama.cpp's arithmetic for Q4_0 / Q4_1 / Q8_0 weights: each block of 32 activations is quantized to int8
 * with one float32 scale d = max|x| / 127 (q = round(x / d), half away from zero) and s = d * sum(q); a
 * block's dot with a weight block is then an exact integer sum times d_w d_x (plus m_w s_x for Q4_1's
 * minimum), the terms summed in float32. Approximate (the activations lose bits, ~0.5% relative error a
 * GEMV on random data), and for Q4_1 about half the time a block of dequantizing it to float32. */

/* The integer block sums: VNNI's dpbusd (u8 x s8, four products into each int32 lane, no 16-bit
 * saturation) where the compiler targets it, 512 bits wide with AVX-512 (four blocks a vector) or 256
 * (AVX-VNNI: two); AVX2's maddubs/madd otherwise (two blocks); scalar without AVX2. All give the same
 * integer sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_VNNI512 1
#define HAVE_VNNI 1
#elif defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAVE_VNNI512 0
#define HAVE_VNNI 1
#if defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#else
#define HAVE_VNNI512 0
#define HAVE_VNNI 0
#endif
#define XB (HAVE_VNNI512 ? 4 : 2) /* blocks of 32 activations a group (one vector of the dot) */
/* rows of x a q8_group call: with VNNI's shorter sums the accumulators of 4 x 4 still fit the registers */
#ifndef Q8_PASS
#define Q8_PASS (HAVE_VNNI ? 4 : 3)
#endif

/* XB consecutive blocks of 32 quantized activations, laid out for the vector dot: lo holds elements 0..15
 * of each block in turn, hi their elements 16..31 (the low and high nibbles of a Q4 block, so XB weight
 * blocks' nibbles load as one vector); d and s4 hold each block's d and s / 4 (exact: a power of two)
 * four times each. n8 [l] is -8 times the quants that 32-bit lane l of the integer sum covers (lo and hi
 * bytes 4l..4l+3): the VNNI dot multiplies unsigned weights (Q4 nibbles as stored, Q8_0's plus 128) and
 * takes that offset's share off exactly; n8b [h] is block h's whole share (the panel GEMM's). A row of K
 * has (K / 32 + XB - 1) / XB groups; blocks past K are zero (d = 0). 84 XB bytes (21 XB floats) a group. */
typedef struct {
    float d[4 * XB], s4[4 * XB];
    int32_t n8[4 * XB], n8b[XB];
    int8_t lo[16 * XB], hi[16 * XB];
} xgroup;

/* Block x [32] quantized into block h of group p (the scalar and AVX2 versions give the same bytes). */
static inline void quant_block(const float *x, xgroup *p, int h) {
    float d;
    int sum;
#if HAVE_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 idv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4], qsum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        // roundf: truncate, then step away from zero where the (exact) remainder is at least one half
        __m256 t = _mm256_mul_ps(v[i], idv), r = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(t, r)), half, _CMP_GE_OQ);
        r = _mm256_add_ps(r, _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(t, sign), one)));
        q[i] = _mm256_cvtps_epi32(r);
        qsum = _mm256_add_epi32(qsum, q[i]);
    }
    // int32 -> int8 in element order (the packs interleave the 128-bit lanes; the permute undoes it)
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)(p->lo + 16 * h), _mm256_castsi256_si128(b));
    _mm_storeu_si128((__m128i *)(p->hi + 16 * h), _mm256_extracti128_si256(b, 1));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    sum = _mm_cvtsi128_si32(t4);
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    sum = 0;
    for (int j = 0; j < 32; j++) {
        int q = (int)roundf(x[j] * id);
        (j < 16 ? p->lo : p->hi)[16 * h + j % 16] = (int8_t)q;
        sum += q;
    }
#endif
    const float s4 = d * (float)sum * 0.25f;
    for (int i = 0; i < 4; i++) {
        const int8_t *lo = p->lo + 16 * h + 4 * i, *hi = p->hi + 16 * h + 4 * i;
        p->d[4 * h + i] = d, p->s4[4 * h + i] = s4;
        p->n8[4 * h + i] = -8 * (lo[0] + lo[1] + lo[2] + lo[3] + hi[0] + hi[1] + hi[2] + hi[3]);
    }
    p->n8b[h] = -8 * sum;
}

/* qx [M][(K / 32 + XB - 1) / XB] = the rows of x quantized, shared by the threads of an enclosing region
 * (the loop's end is their barrier). */
static void quant_rows_work(const float *x, int64_t ldx, int64_t M, int64_t K, xgroup *qx) {
    const int64_t nb = K / 32, ng = (nb + XB - 1) / XB;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * ng; i++) {
        const float *xr = x + i / ng * ldx + i % ng * 32 * XB;
        for (int h = 0; h < XB; h++) {
            if (i % ng * XB + h < nb) {
                quant_block(xr + 32 * h, qx + i, h);
            } else {  // past the last block: zero quants (d = 0) that add nothing
                memset(qx[i].lo + 16 * h, 0, 16), memset(qx[i].hi + 16 * h, 0, 16);
                for (int j = 4 * h; j < 4 * h + 4; j++) qx[i].d[j] = qx[i].s4[j] = 0.0f, qx[i].n8[j] = 0;
                qx[i].n8b[h] = 0;
            }
        }
    }
}

/* Q4_K / Q5_K / Q6_K: AVX-512 VNNI builds only (their sub-blocks of 32 / 16 map onto its quads of blocks;
 * the other builds keep the exact dot for them) */
static inline int q8_kquant(int type) {
    return HAVE_VNNI512 && (type == GT_Q4_K || type == GT_Q5_K || type == GT_Q6_K);
}
static inline int q8_type(int type) {
    return type == GT_Q4_0 || type == GT_Q4_1 || type == GT_Q8_0 || q8_kquant(type);
}

#ifndef Q8_K_ROWS
#define Q8_K_ROWS 32 /* rows of x from which the K-quants' exact GEMM (panels of dequantized weights) is faster:
                        Q4_K at 1B-Llama shapes, 24 rows 100 against 80 G weight-rows/s, 32 rows 93 against 106 */
#endif
/* Whether a linear of M rows of x multiplies this type by the int8 dot. */
static inline int q8_takes(int type, int64_t M) { return q8_type(type) && !(q8_kquant(type) && M >= Q8_K_ROWS); }
/* Whether this build's int8 dot reads the type (the Python side asks). */
int q8_type_supported(int type) { return q8_type(type); }

#if HAVE_VNNI512
/* Four weight blocks (at s + o[0..3]) as the 512-bit dot reads them: their quants, unsigned (Q4 nibbles as
 * stored, Q8_0's plus 128: the xgroup's n8 takes the offset off), as [elements 0..15 of each | ...] in wl
 * and [16..31 of each] in wh, and their fp16 scales d (and Q4_1's m) as floats, each block's in four lanes. */
static inline __attribute__((always_inline)) void q8_wquad(const int type, const uint8_t *s, const int64_t o[4],
                                                           __m512i *wl, __m512i *wh, __m512 *dw, __m512 *mw) {
#define LD(i, off) _mm_loadu_si128((const __m128i *)(s + o[i] + (off)))
#define LOAD4(off)                                                                                          \
    _mm512_inserti32x4(                                                                                     \
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(LD(0, off)), LD(1, off), 1), LD(2, off), 2), \
        LD(3, off), 3)
    if (type == GT_Q8_0) {
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        *wl = _mm512_xor_si512(LOAD4(2), bias);
        *wh = _mm512_xor_si512(LOAD4(18), bias);
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        __m512i v = LOAD4(type == GT_Q4_1 ? 4 : 2);
        *wl = _mm512_and_si512(v, m4);
        *wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
#undef LOAD4
#undef LD
    if (type == GT_Q4_1) {  // [d0 m0 d1 m1 ...] -> d0 x4 d1 x4 ..., m0 x4 m1 x4 ...
        __m128i h = _mm_setr_epi32(*(const int32_t *)(s + o[0]), *(const int32_t *)(s + o[1]),
                                   *(const int32_t *)(s + o[2]), *(const int32_t *)(s + o[3]));
        __m512 f = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
        *dw = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), f);
        *mw = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), f);
    } else {  // [d0 d1 d2 d3] -> d0 x4 d1 x4 ...
        __m128i h = _mm_setr_epi16((short)rd16(s + o[0]), (short)rd16(s + o[1]), (short)rd16(s + o[2]),
                                   (short)rd16(s + o[3]), 0, 0, 0, 0);
        __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(h));
        *dw = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), f);
    }
}

/* A Q4_K / Q5_K / Q6_K super-block's scales as one vector: Q4_K/Q5_K's d sc of its 8 sub-blocks then -dmin m;
 * Q6_K's d sc of its 16 (kscales' values, built in registers: no stores for the loads to wait on). */
static inline __attribute__((always_inline)) __m512 q8_kscales(const int type, const uint8_t *s) {
    if (type == GT_Q6_K)
        return _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(rd16(s + 208))),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 192)))));
    const __m128i b0 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(s + 4)));
    const __m128i b1 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(s + 8)));
    const __m128i b2 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(s + 12))), m63 = _mm_set1_epi32(63);
    const __m128i s_hi = _mm_or_si128(_mm_and_si128(b2, _mm_set1_epi32(15)), _mm_slli_epi32(_mm_srli_epi32(b0, 6), 4));
    const __m128i m_hi = _mm_or_si128(_mm_srli_epi32(b2, 4), _mm_slli_epi32(_mm_srli_epi32(b1, 6), 4));
    __m512i v = _mm512_castsi128_si512(_mm_and_si128(b0, m63));
    v = _mm512_inserti32x4(_mm512_inserti32x4(v, s_hi, 1), _mm_and_si128(b1, m63), 2);
    const __m256 d = _mm256_set1_ps(fp16_to_f32(rd16(s))), nd = _mm256_set1_ps(-fp16_to_f32(rd16(s + 2)));
    return _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(d), nd, 1),
                         _mm512_cvtepi32_ps(_mm512_inserti32x4(v, m_hi, 3)));
}

/* Quad h (0 or 1: elements 128 h .. 128 h + 127) of a Q4_K, Q5_K or Q6_K super-block at s, as q8_wquad
 * gives a quad of blocks of 32: unsigned quants (Q4_K's nibbles, Q5_K's five-bit values; Q6_K's six-bit
 * values, the offset of 32 taken off by the caller) in wl / wh, and per lane the scale of the sub-block
 * its quants belong to (from sc, the block's q8_kscales): Q4_K/Q5_K's d sc of the block's sub-block of 32
 * in dlo and -dmin m in mw; Q6_K's d sc of
 * the sub-block of 16 of the block's elements 0..15 (wl) in dlo and of 16..31 (wh) in mw. */
static inline __attribute__((always_inline)) void q8_wquad_k(const int type, const uint8_t *s, const int h,
                                                             const __m512 sc, __m512i *wl, __m512i *wh,
                                                             __m512 *dlo, __m512 *mw) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
#define LD(p) _mm_loadu_si128((const __m128i *)(p))
#define QUAD(a, b) _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(a), a, 1), b, 2), b, 3)
    if (type == GT_Q4_K || type == GT_Q5_K) {  // sub-blocks 4h, 4h+1 in the low / high nibbles of qs[64h..],
                                                // 4h+2, 4h+3 of qs[64h+32..]; Q5_K's fifth bits: bit 4h+b of qh
        const uint8_t *qs = s + (type == GT_Q5_K ? 48 : 16) + 64 * h;
        const __m512i sh = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);  // low, high, low, high nibbles
        *wl = _mm512_and_si512(_mm512_srlv_epi64(QUAD(LD(qs), LD(qs + 32)), sh), m4);
        *wh = _mm512_and_si512(_mm512_srlv_epi64(QUAD(LD(qs + 16), LD(qs + 48)), sh), m4);
        if (type == GT_Q5_K) {
            const __m512i bit = _mm512_add_epi64(_mm512_set1_epi64(4 * h), _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3));
            const __m512i one = _mm512_set1_epi8(1);
#define Q5H(off) _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i32x4(LD(s + 16 + (off))), bit), one), 4)
            *wl = _mm512_or_si512(*wl, Q5H(0));
            *wh = _mm512_or_si512(*wh, Q5H(16));
#undef Q5H
        }
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * h),
                                             _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
        *dlo = _mm512_permutexvar_ps(idx, sc);
        *mw = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), sc);  // times s / 4, 4 lanes
    } else {  // Q6_K: block b of the quad is elements 32 b.. of the half, ql and qh as the reference reads them
        const uint8_t *ql = s + 64 * h, *qh = s + 128 + 32 * h;
        const __m512i shl = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4), shh = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6);
        const __m512i m2 = _mm512_set1_epi8(0x03);
        // blocks 0..3 read ql [0, 32, 0, 32] (low, low, high, high nibbles) and qh's bit pairs 0..3
#define Q6(off)                                                                                              \
    _mm512_or_si512(                                                                                         \
        _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(_mm256_set_m128i(LD(ql + 32 + (off)), LD(ql + (off)))), shl), m4), \
        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i32x4(LD(qh + (off))), shh), m2), 4))
        *wl = Q6(0);
        *wh = Q6(16);
#undef Q6
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(8 * h),
                                             _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6));
        *dlo = _mm512_permutexvar_ps(idx, sc);
        *mw = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(1)), sc);
    }
#undef QUAD
#undef LD
}

/* out[r][m] = row r of the GR weight rows p[] dotted with quantized x row m (1..Q8_PASS rows, ldq groups
 * apart), four blocks a vector: each weight quad unpacked once (q8_wquad) for all M rows, its integer sums
 * by two dpbusd (started from the offset's share), times [d_w d_x of each block] into a float accumulator
 * (Q4_1's m_w s_x too, a quarter in each of its block's lanes). pf: as in dot_group. */
static inline __attribute__((always_inline)) void q8_group(const int type, const int M, const xgroup *qx,
                                                           int64_t ldq, const uint8_t *const p[GR], int64_t K,
                                                           const uint8_t *pf, int64_t pf_len,
                                                           float out[GR][PASS_MAX]) {
    __m512 acc[GR][Q8_PASS], ksc[GR];  // ksc: the K-quant super-block's scales (q8_kscales), both its quads
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t bb = block_bytes(type), nb = K / 32, ng = (nb + 3) / 4, chunks = (ng + 1) / 2;
    const int64_t pf_step = (pf_len + chunks - 1) / chunks;
    for (int64_t j = 0; j < ng; j++) {
        if (j % 2 == 0)  // a slice of the prefetch every 2 quads (dot_group's chunk of 256)
            for (int64_t line = j / 2 * pf_step; line < (j / 2 + 1) * pf_step && line < pf_len; line += 64)
                _mm_prefetch((const char *)(pf + line), _MM_HINT_T0);
        int64_t o[4];  // past the last block: the last again (its activations are zero)
        for (int i = 0; i < 4; i++) o[i] = (4 * j + i < nb ? 4 * j + i : nb - 1) * bb;
        __m512i off_lo[Q8_PASS], off_hi[Q8_PASS];  // Q6_K: 32 times each lane's activations, its offset's share
        if (type == GT_Q6_K)
            for (int m = 0; m < M; m++) {
                const xgroup *xq = qx + m * ldq + j;
                const __m512i c32 = _mm512_set1_epi8(32), z = _mm512_setzero_si512();
                off_lo[m] = _mm512_dpbusd_epi32(z, c32, _mm512_loadu_si512(xq->lo));
                off_hi[m] = _mm512_dpbusd_epi32(z, c32, _mm512_loadu_si512(xq->hi));
            }
#pragma GCC unroll 4
        for (int r = 0; r < GR; r++) {
            __m512i wl, wh;
            __m512 dw, mw = _mm512_setzero_ps();
            if (type == GT_Q4_K || type == GT_Q5_K || type == GT_Q6_K) {  // quad j: half j % 2 of super-block j / 2
                if (j % 2 == 0) ksc[r] = q8_kscales(type, p[r] + j / 2 * bb);
                q8_wquad_k(type, p[r] + j / 2 * bb, (int)(j % 2), ksc[r], &wl, &wh, &dw, &mw);
            } else {
                q8_wquad(type, p[r], o, &wl, &wh, &dw, &mw);
            }
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                const xgroup *xq = qx + m * ldq + j;
                if (type == GT_Q6_K) {  // the two sub-blocks of 16 of each block scaled apart
                    const __m512i z = _mm512_setzero_si512();
                    __m512i sl = _mm512_sub_epi32(_mm512_dpbusd_epi32(z, wl, _mm512_loadu_si512(xq->lo)), off_lo[m]);
                    __m512i sh = _mm512_sub_epi32(_mm512_dpbusd_epi32(z, wh, _mm512_loadu_si512(xq->hi)), off_hi[m]);
                    const __m512 xd = _mm512_loadu_ps(xq->d);
                    __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(dw, xd), _mm512_cvtepi32_ps(sl), acc[r][m]);
                    acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(mw, xd), _mm512_cvtepi32_ps(sh), a);
                    continue;
                }
                __m512i s = _mm512_setzero_si512();
                if (type == GT_Q4_0) s = _mm512_loadu_si512(xq->n8);
                if (type == GT_Q8_0) s = _mm512_slli_epi32(_mm512_loadu_si512(xq->n8), 4);
                s = _mm512_dpbusd_epi32(s, wl, _mm512_loadu_si512(xq->lo));
                s = _mm512_dpbusd_epi32(s, wh, _mm512_loadu_si512(xq->hi));
                __m512 dd = _mm512_mul_ps(dw, _mm512_loadu_ps(xq->d));
                __m512 a = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc[r][m]);
                if (type == GT_Q4_1 || type == GT_Q4_K || type == GT_Q5_K)
                    a = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xq->s4), a);
                acc[r][m] = a;
            }
        }
    }
    for (int m = 0; m < M; m++) {  // the four rows' sums at once (a transpose as it adds; GR is 4)
        __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(acc[0][m], acc[1][m]), _mm512_unpackhi_ps(acc[0][m], acc[1][m]));
        __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(acc[2][m], acc[3][m]), _mm512_unpackhi_ps(acc[2][m], acc[3][m]));
        __m512 u = _mm512_add_ps(_mm512_shuffle_ps(s, t, 0x44), _mm512_shuffle_ps(s, t, 0xee));  // [r0 r1 r2 r3] x4
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1));
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), hi);
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        float v[4];
        _mm_storeu_ps(v, q);
        for (int r = 0; r < GR; r++) out[r][m] = v[r];
    }
}

/* ---- the int8 GEMM (many rows of x, AVX-512 VNNI): a weight panel repacked, rows of x broadcast --------
 * q8_group spends three float operations (convert, scale, add) on every pair of dpbusd, for each weight row
 * and row of x. Here one int32 lane is one weight row: QP rows' quants are repacked once per block of rows
 * of x so that vector k of a block holds each row's elements 4k..4k+3 (unsigned, as q8_wquad makes them),
 * and each row of x broadcasts its matching four quants: eight dpbusd give QP rows' whole block sums, then
 * one convert and two multiply-adds scale them, 16 rows at a time. */
#define QP 16                 /* weight rows a panel (one int32 lane each) */
#define Q8_MR 8               /* rows of x a micro-kernel call (its accumulators: 2 Q8_MR vectors) */
#define QPB (8 * 64 + 2 * 64) /* bytes a block of a panel: eight vectors of quants, d and 4 m (Q4_1) */
#ifndef Q8_GEMM_MIN
#define Q8_GEMM_MIN 10 /* rows of x from which the GEMM beats q8_group (its repacking pays): one thread, Q4_1,
                          the stored_dot shapes: 8 rows 13.5 against 15.1 ms, 12 rows 19.8 against 17.4 */
#endif
#define MB_GEMM 256 /* rows of x a block (their quantized rows stay in L2: 84 bytes a block of 32) */

/* The panel of weight rows p[0..QP) (all K / 32 blocks) into buf (nb QPB-byte blocks). */
static void q8_repack(const int type, const uint8_t *const p[QP], int64_t nb, uint8_t *buf) {
    const __m512i idx = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    const int64_t bb = block_bytes(type), qo = type == GT_Q4_1 ? 4 : 2;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t t[QP][32] __attribute__((aligned(64)));  // each row's 32 quants in element order
        float *dw = (float *)(buf + b * QPB + 512), *mw = dw + 16;
        for (int r = 0; r < QP; r++) {
            const uint8_t *src = p[r] + b * bb;
            if (type == GT_Q8_0) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 2));
                _mm256_store_si256((__m256i *)t[r], _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
            } else {
                const __m128i v = _mm_loadu_si128((const __m128i *)(src + qo)), m4 = _mm_set1_epi8(0x0f);
                _mm_store_si128((__m128i *)t[r], _mm_and_si128(v, m4));
                _mm_store_si128((__m128i *)(t[r] + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            }
            dw[r] = fp16_to_f32(rd16(src));
            mw[r] = type == GT_Q4_1 ? fp16_to_f32(rd16(src + 2)) * 4.0f : 0.0f;  // x holds s / 4
        }
        for (int k = 0; k < 8; k++)  // vector k: dword k of each row
            _mm512_store_si512(buf + b * QPB + 64 * k,
                               _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(k)), t, 4));
    }
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* y [M, nr] (+ bias) = M (1..Q8_MR) quantized rows of x, ldq groups apart, times the repacked panel (nb
 * blocks): per block the rows' integer sums start from the offset's share (Q4_0: n8b, Q8_0: 16 n8b) and
 * are scaled by d_w d_x (and Q4_1's m_w s_x added) into one float vector a row of x. */
static inline __attribute__((always_inline)) void q8_panel(const int type, const int M, const xgroup *qx,
                                                           int64_t ldq, const uint8_t *buf, int64_t nb,
                                                           const float *bias, float *y, int64_t ldy, int nr) {
    __m512 acc[Q8_MR];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = buf + b * QPB;
        const int64_t g = b / XB, h = b % XB;
        __m512i s[Q8_MR];
        for (int m = 0; m < M; m++) {
            const int32_t n = qx[m * ldq + g].n8b[h];
            s[m] = _mm512_set1_epi32(type == GT_Q4_0 ? n : type == GT_Q8_0 ? 16 * n : 0);
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i w = _mm512_load_si512(pb + 64 * k);
            const int64_t off = (k < 4 ? 0 : 16 * XB) + 16 * h + 4 * (k % 4);  // lo, then hi
            for (int m = 0; m < M; m++) s[m] = _mm512_dpbusd_epi32(s[m], w, bcast4(qx[m * ldq + g].lo + off));
        }
        const __m512 dw = _mm512_load_ps(pb + 512), mw = _mm512_load_ps(pb + 576);
        for (int m = 0; m < M; m++) {
            const xgroup *xq = qx + m * ldq + g;
            const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(xq->d[4 * h]));
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), dd, acc[m]);
            if (type == GT_Q4_1) a = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq->s4[4 * h]), a);
            acc[m] = a;
        }
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * ldy, k, _mm512_add_ps(acc[m], bv));
}

#define Q8P_CASE(T, MM) q8_panel(T, MM, qx, ldq, buf, nb, bias, y, ldy, nr)
#define Q8P_CASES(T, base)                                                                                  \
    case base + 1: Q8P_CASE(T, 1); break;                                                                   \
    case base + 2: Q8P_CASE(T, 2); break;                                                                   \
    case base + 3: Q8P_CASE(T, 3); break;                                                                   \
    case base + 4: Q8P_CASE(T, 4); break;                                                                   \
    case base + 5: Q8P_CASE(T, 5); break;                                                                   \
    case base + 6: Q8P_CASE(T, 6); break;                                                                   \
    case base + 7: Q8P_CASE(T, 7); break;                                                                   \
    case base + 8: Q8P_CASE(T, 8); break;
static void q8_panel_any(int type, int M, const xgroup *qx, int64_t ldq, const uint8_t *buf, int64_t nb,
                         const float *bias, float *y, int64_t ldy, int nr) {
    switch ((type == GT_Q4_0 ? 0 : type == GT_Q4_1 ? 1 : 2) * 16 + M) {
        Q8P_CASES(GT_Q4_0, 0)
        Q8P_CASES(GT_Q4_1, 16)
        Q8P_CASES(GT_Q8_0, 32)
    }
}

/* linear_q8_work for many rows: rows of x in blocks of MB_GEMM; each thread repacks a panel of QP weight
 * rows into its own buffer (nb QPB bytes) once per block and runs every Q8_MR rows of the block through it. */
static void linear_q8_gemm_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes,
                                const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / 32, ldq = (nb + XB - 1) / XB, panels = (N + QP - 1) / QP;
    uint8_t *buf = aligned_alloc(64, (size_t)(nb * QPB));
    if (!buf) abort();  // nb * 640 bytes (30 KB at K 1536): no result rather than a wrong one
    for (int64_t mb = 0; mb < M; mb += MB_GEMM) {
        const int64_t mend = M - mb < MB_GEMM ? M : mb + MB_GEMM;
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            const uint8_t *p[QP];
            const int nr = (int)(N - pn * QP < QP ? N - pn * QP : QP);
            for (int r = 0; r < QP; r++) p[r] = w + (pn * QP + (r < nr ? r : 0)) * row_bytes;  // tail: row 0 again
            q8_repack(type, p, nb, buf);
            for (int64_t m0 = mb; m0 < mend; m0 += Q8_MR) {
                int mr = (int)(mend - m0 < Q8_MR ? mend - m0 : Q8_MR);
                q8_panel_any(type, mr, qx + m0 * ldq, ldq, buf, nb, bias ? bias + pn * QP : 0, y + m0 * ldy + pn * QP,
                             ldy, nr);
            }
        }
    }
    free(buf);
}
#elif HAVE_AVX2
static inline __m256i load2x128(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* Two weight blocks (s0, s1) as the dot reads them: their quants as [elements 0..15 of both | 16..31 of both]
 * in wl / wh (one load for two Q4 blocks' nibbles), and their fp16 scales d (and Q4_1's m) as floats, each
 * block's in four lanes. The quants are unsigned for VNNI (Q4 nibbles as stored, Q8_0's plus 128: the
 * xgroup's n8 removes the offset), signed for AVX2 (Q4_0's nibbles minus 8). */
static inline __attribute__((always_inline)) void q8_wpair(const int type, const uint8_t *s0, const uint8_t *s1,
                                                           __m256i *wl, __m256i *wh, __m256 *dw, __m256 *mw) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == GT_Q8_0) {
        *wl = load2x128(s0 + 2, s1 + 2);
        *wh = load2x128(s0 + 18, s1 + 18);
        if (HAVE_VNNI) {
            const __m256i bias = _mm256_set1_epi8((char)0x80);
            *wl = _mm256_xor_si256(*wl, bias), *wh = _mm256_xor_si256(*wh, bias);
        }
    } else {
        __m256i v = load2x128(s0 + (type == GT_Q4_1 ? 4 : 2), s1 + (type == GT_Q4_1 ? 4 : 2));
        *wl = _mm256_and_si256(v, m4);
        *wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (type == GT_Q4_0 && !HAVE_VNNI) {
            const __m256i eight = _mm256_set1_epi8(8);
            *wl = _mm256_sub_epi8(*wl, eight), *wh = _mm256_sub_epi8(*wh, eight);
        }
    }
    if (type == GT_Q4_1) {  // [d0 m0 d1 m1] -> d0 x4 d1 x4, m0 x4 m1 x4
        __m128i h = _mm_insert_epi32(_mm_cvtsi32_si128(*(const int32_t *)s0), *(const int32_t *)s1, 1);
        __m256 f = _mm256_castps128_ps256(_mm_cvtph_ps(h));
        *dw = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        *mw = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
    } else {  // [d0 d1] -> d0 x4 d1 x4
        __m128i h = _mm_insert_epi16(_mm_cvtsi32_si128(rd16(s0)), rd16(s1), 1);
        __m256 f = _mm256_castps128_ps256(_mm_cvtph_ps(h));
        *dw = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    }
}

/* The integer sums of two blocks (lanes 0-3 the first's, 4-7 the second's) of the weight quants wl / wh
 * (q8_wpair; al / ah their absolute values on AVX2) with the quantized x pair xp. */
static inline __attribute__((always_inline)) __m256i q8_isum(const int type, __m256i wl, __m256i wh, __m256i al,
                                                             __m256i ah, const xgroup *xp) {
    __m256i xl = _mm256_loadu_si256((const __m256i *)xp->lo);
    __m256i xh = _mm256_loadu_si256((const __m256i *)xp->hi);
#if HAVE_VNNI
    (void)al, (void)ah;
    __m256i s = _mm256_setzero_si256();  // the offset's share: 8 (Q4_0) or 128 (Q8_0) times x's quants
    if (type == GT_Q4_0) s = _mm256_loadu_si256((const __m256i *)xp->n8);
    if (type == GT_Q8_0) s = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)xp->n8), 4);
    return DPBUSD(DPBUSD(s, wl, xl), wh, xh);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (type != GT_Q4_1) xl = _mm256_sign_epi8(xl, wl), xh = _mm256_sign_epi8(xh, wh);
    if (type == GT_Q8_0)  // pairs of 128 x 127: no room to add two in 16 bits
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(al, xl), ones),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(ah, xh), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(al, xl), _mm256_maddubs_epi16(ah, xh)), ones);
#endif
}

/* out[r][m] = row r of the GR weight rows p[] dotted with quantized x row m (1..Q8_PASS rows, ldq pairs
 * apart), two blocks at a time (q8_wpair: each weight pair unpacked once for all M rows): the integer sums
 * (q8_isum; on AVX2 the signed weights through the sign trick) times [d_w d_x of each] into a float
 * accumulator. pf: as in dot_group. */
static inline __attribute__((always_inline)) void q8_group(const int type, const int M, const xgroup *qx,
                                                           int64_t ldq, const uint8_t *const p[GR], int64_t K,
                                                           const uint8_t *pf, int64_t pf_len,
                                                           float out[GR][PASS_MAX]) {
    __m256 acc[GR][Q8_PASS];
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(type), nb = K / 32, np = (nb + 1) / 2, chunks = (np + 3) / 4;
    const int64_t pf_step = (pf_len + chunks - 1) / chunks;
    for (int64_t j = 0; j < np; j++) {
        if (j % 4 == 0)  // a slice of the prefetch every 4 pairs (dot_group's chunk of 256)
            for (int64_t line = j / 4 * pf_step; line < (j / 4 + 1) * pf_step && line < pf_len; line += 64)
                _mm_prefetch((const char *)(pf + line), _MM_HINT_T0);
        const int64_t o0 = 2 * j * bb, o1 = (2 * j + 1 < nb ? 2 * j + 1 : 2 * j) * bb;  // odd tail: again
#pragma GCC unroll 4
        for (int r = 0; r < GR; r++) {
            __m256i wl, wh;
            __m256 dw, mw = _mm256_setzero_ps();
            q8_wpair(type, p[r] + o0, p[r] + o1, &wl, &wh, &dw, &mw);
            __m256i al = wl, ah = wh;
            if (!HAVE_VNNI && type != GT_Q4_1) al = _mm256_sign_epi8(wl, wl), ah = _mm256_sign_epi8(wh, wh);
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                const xgroup *xp = qx + m * ldq + j;
                __m256i s = q8_isum(type, wl, wh, al, ah, xp);
                __m256 dd = _mm256_mul_ps(dw, _mm256_loadu_ps(xp->d));
                __m256 a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[r][m]);
                // Q4_1's m_w s_x, a quarter in each of its block's four lanes: the lanes' sum adds it once
                if (type == GT_Q4_1) a = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xp->s4), a);
                acc[r][m] = a;
            }
        }
    }
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) out[r][m] = hsum8(acc[r][m]);
}

#endif

#if HAVE_AVX2
#define Q8_CASE(T, MM) q8_group(T, MM, qx, ldq, p, K, pf, pf_len, out)
#define Q8_CASES(T, base)                                                                                   \
    case base + 1: Q8_CASE(T, 1); break;                                                                    \
    case base + 2: Q8_CASE(T, 2); break;                                                                    \
    case base + 3: Q8_CASE(T, 3); break;                                                                    \
    case base + 4: Q8_CASE(T, Q8_PASS < 4 ? Q8_PASS : 4); break;                                           \
    case base + 5: Q8_CASE(T, Q8_PASS < 5 ? Q8_PASS : 5); break;                                           \
    case base + 6: Q8_CASE(T, Q8_PASS < 6 ? Q8_PASS : 6); break;
static void q8_group_any(int type, int M, const xgroup *qx, int64_t ldq, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    const int t = type == GT_Q4_0 ? 0 : type == GT_Q4_1 ? 1 : type == GT_Q8_0 ? 2 : type == GT_Q4_K ? 3 : type == GT_Q5_K ? 4 : 5;
    switch (t * 8 + M) {
        Q8_CASES(GT_Q4_0, 0)
        Q8_CASES(GT_Q4_1, 8)
        Q8_CASES(GT_Q8_0, 16)
#if HAVE_VNNI512
        Q8_CASES(GT_Q4_K, 24)
        Q8_CASES(GT_Q5_K, 32)
        Q8_CASES(GT_Q6_K, 40)
#endif
    }
}
#else
/* The scalar q8_group: the same integer sums and float terms, summed in block order. */
static void q8_group_any(int type, int M, const xgroup *qx, int64_t ldq, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    (void)pf, (void)pf_len;
    const int64_t bb = block_bytes(type);
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < K / 32; b++) {
                const uint8_t *src = p[r] + b * bb;
                const xgroup *xp = qx + m * ldq + b / XB;
                const int h = (int)(b % XB);
                int s = 0;
                for (int j = 0; j < 32; j++) {
                    int w = type == GT_Q8_0 ? ((const int8_t *)src)[2 + j]
                            : (src[(type == GT_Q4_1 ? 4 : 2) + j % 16] >> (j / 16 * 4)) & 0xf;
                    s += (type == GT_Q4_0 ? w - 8 : w) * (j < 16 ? xp->lo : xp->hi)[16 * h + j % 16];
                }
                acc += fp16_to_f32(rd16(src)) * xp->d[4 * h] * (float)s;
                if (type == GT_Q4_1) acc += fp16_to_f32(rd16(src + 2)) * (xp->s4[4 * h] * 4.0f);
            }
            out[r][m] = acc;
        }
}
#endif

static void q8_group_fn(int type, int M, const void *qx, int64_t ldq, const uint8_t *const p[GR], int64_t K,
                        const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    q8_group_any(type, M, (const xgroup *)qx, ldq, p, K, pf, pf_len, out);
}

/* y [M, N] = the quantized x (quant_rows_work) times the stored W [N, K] (Q4_0/Q4_1/Q8_0), transposed
 * (+ bias); for the threads of an enclosing region. Any M: a tile of GR weight rows by Q8_PASS rows of x
 * a call, the rows in blocks of MB_DOT (dot_tasks_work). */
static void linear_q8_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes, const float *bias,
                           float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
#if HAVE_VNNI512
    if (M >= Q8_GEMM_MIN && !q8_kquant(type)) {  // the K-quants' sub-block scales: the dot path at any M
        linear_q8_gemm_work(qx, w, type, row_bytes, bias, y, ldy, M, N, K);
        return;
    }
#endif
    dot_tasks_work(q8_group_fn, Q8_PASS, qx, (K / 32 + XB - 1) / XB, sizeof(xgroup), w, type, row_bytes, bias, y, ldy,
                   M, N, K);
}

/* linear_stored with x quantized to int8 blocks first (llama.cpp's arithmetic, approximate): for Q4_0, Q4_1
 * and Q8_0 weights (and Q4_K / Q5_K / Q6_K with AVX-512 VNNI, below Q8_K_ROWS rows of x; the exact kernels from
 * there) and K a multiple of 32 (returns -1 otherwise, computing nothing). */
int linear_stored_q8(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                     const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (!q8_type(type) || K % 32) return -1;
    if (!q8_takes(type, M)) {  // a K-quant at many rows: the exact kernels
        linear_stored(x, ldx, w, type, row_bytes, bias, y, ldy, M, N, K, num_threads);
        return 0;
    }
    xgroup *qx = malloc((size_t)(M * ((K / 32 + XB - 1) / XB) + 1) * sizeof(xgroup));
    if (!qx) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        quant_rows_work(x, ldx, M, K, qx);
        linear_q8_work(qx, w, type, row_bytes, bias, y, ldy, M, N, K);
    }
    free(qx);
    return 0;
}

/* ---- a sparse layer's experts as stored -------------------------------------------------------------------
 * out [T, H] = sum over token t's k choices j of w[t][j] down_e(silu(gate_e(x[t])) * up_e(x[t])), e =
 * ids[t][j] (-1: none): the (token, choice) pairs are grouped by expert, each expert's rows gathered and
 * multiplied by its three stored weights at once (the exact stored GEMM, any rows), and each token's results
 * added in expert order, the reference's (kernel/reference.py fused_moe). experts: E x 9 int64, per expert
 * (type, data, row bytes) of gate [I, H], up [I, H], down [H, I]. scratch: T k (2 H + 3 I) floats, order:
 * T k + E + 1 int64. For the threads of an enclosing parallel region (one groups the pairs). */
static void moe_stored_work(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I, int64_t k,
                            const int32_t *ids, const float *w, const int64_t *experts, int64_t E, float *out,
                            float *scratch, int64_t *order, xgroup *qx) {
    const int64_t P = T * k;
    int64_t *start = order + P;  // [E + 1]: expert e's pairs are order[start[e] .. start[e + 1])
    float *xs = scratch, *gu = xs + P * H, *act = gu + P * 2 * I, *ys = act + P * I;
#pragma omp single
    {
        for (int64_t e = 0; e <= E; e++) start[e] = 0;
        for (int64_t p = 0; p < P; p++)
            if (ids[p] >= 0 && ids[p] < E) start[ids[p] + 1]++;
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        for (int64_t e = 0; e < E; e++)  // pairs in token order within each expert
            for (int64_t p = 0, n = start[e]; p < P; p++)
                if (ids[p] == e) order[n++] = p;
    }
    const int64_t used = start[E], gH = (H / 32 + XB - 1) / XB, gI = (I / 32 + XB - 1) / XB;
    const int q8 = qx && H % 32 == 0 && I % 32 == 0;  // int8 mode: each expert's rows quantized once
#pragma omp for schedule(static)
    for (int64_t i = 0; i < used; i++) memcpy(xs + i * H, x + order[i] / k * ldx, H * sizeof(float));
    if (q8) quant_rows_work(xs, H, used, H, qx);
#define MOE_LIN(part, xin, ldin, gq, y, ldy, N, K)                                                             \
    if (q8 && q8_takes((int)d[3 * (part)], n))                                                               \
        linear_q8_work(qx + start[e] * (gq), (const uint8_t *)d[3 * (part) + 1], (int)d[3 * (part)],          \
                       d[3 * (part) + 2], 0, y, ldy, n, N, K);                                               \
    else                                                                                                     \
        linear_stored_work(xin, ldin, (const uint8_t *)d[3 * (part) + 1], (int)d[3 * (part)], d[3 * (part) + 2], \
                           0, y, ldy, n, N, K);
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e], *d = experts + 9 * e;
        if (!n) continue;
        const float *xe = xs + start[e] * H;
        float *g = gu + start[e] * 2 * I;
        MOE_LIN(0, xe, H, gH, g, 2 * I, I, H)
        MOE_LIN(1, xe, H, gH, g + I, 2 * I, I, H)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) silu_row(g + i * 2 * I, g + i * 2 * I + I, act + (start[e] + i) * I, I);
    }
    if (q8) quant_rows_work(act, I, used, I, qx);
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e], *d = experts + 9 * e;
        if (!n) continue;
        MOE_LIN(2, act + start[e] * I, I, gI, ys + start[e] * H, H, H, I)
    }
#undef MOE_LIN
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {  // each token's choices in expert order, float32 as the reference
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t i = 0; i < used; i++) {
            if (order[i] / k != t) continue;
            const float c = w[order[i]], *y = ys + i * H;
            for (int64_t h = 0; h < H; h++) o[h] += y[h] * c;
        }
    }
}

/* qx: NULL for the exact dot, else room for T k rows of max(H, I) quantized (the int8 dot, where q8_takes). */
void moe_stored_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int32_t *ids,
                    const float *w, const int64_t *experts, int64_t E, float *out, float *scratch, int64_t *order,
                    void *qx, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    moe_stored_work(x, H, T, H, I, k, ids, w, experts, E, out, scratch, order, (xgroup *)qx);
}

#if HAVE_AVX2
/* Mixture-of-experts routing as kernel/reference.py moe_route, for T rows of logits [T, E] (one thread):
 * softmax in float32, the top k (the larger first; the lower index first among equals), divided by their
 * sum when renormalize. */
static void moe_route_rows(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, int32_t *ids,
                           float *w) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float mx = -INFINITY, sum = 0.0f, p[E];
        for (int64_t e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(l[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        float tot = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            ids[t * k + j] = (int32_t)best, w[t * k + j] = p[best], tot += p[best];
            p[best] = -1.0f;
        }
        if (renormalize)
            for (int64_t j = 0; j < k; j++) w[t * k + j] /= tot;
    }
}
#endif


#if HAVE_AVX2
/* ---- the decode step: every layer of a dense Llama-family model in one call ------------------------------
 * One parallel region for the whole step instead of a dozen Python-dispatched calls per layer (their
 * dispatch cost a small model's decode step as much as its GEMVs); the threads meet at a barrier after each
 * phase. Each phase runs the same code as the per-op kernels above, so the step computes what the layers do.
 *
 * A linear layer is LIN_WORDS int64: [parts, bias, then (kind, ggml type, data, row bytes, rows) per part]
 * with kind 0 float32 panels (pack_weight_f32) and kind 1 stored rows; parts stack along the output. */
#define LIN_WORDS 17
/* norms (input, post, q, k), k/v cache, qkv, o, gate|up, down, the attention window (0: full), then a sparse
 * layer's MOE_WORDS (its experts' address 0 for a dense layer): the router (a linear), experts E, top k,
 * renormalize, the experts' descriptor (moe_stored_work), their intermediate size */
#define MOE_WORDS (LIN_WORDS + 5)
#define LAYER_WORDS (7 + 4 * LIN_WORDS + MOE_WORDS)
#define MODEL_WORDS 18
/* qx (not NULL: int8 mode, room for M quantized rows of K): with K a multiple of 32, x is quantized once
 * and the parts q8_takes take the int8 dot; the rest (and every part without qx) the exact kernels. */
static void lin_run(const int64_t *d, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M,
                    int64_t K, xgroup *qx) {
    const float *bias = (const float *)d[1];
    int q8 = 0;
    for (int i = 0; i < d[0]; i++) q8 |= d[2 + 5 * i] == 1 && q8_takes((int)d[3 + 5 * i], M);
    q8 = q8 && qx && K % 32 == 0;
    if (q8) quant_rows_work(x, ldx, M, K, qx);
    int64_t off = 0;
    for (int i = 0; i < d[0]; i++) {
        const int64_t *p = d + 2 + 5 * i;
        const float *b = bias ? bias + off : 0;
        if (p[0] == 0)
            linear_packed_work(x, ldx, (const float *)p[2], b, y + off, ldy, M, p[4], K);
        else if (q8 && q8_takes((int)p[1], M))
            linear_q8_work(qx, (const uint8_t *)p[2], (int)p[1], p[3], b, y + off, ldy, M, p[4], K);
        else
            linear_stored_work(x, ldx, (const uint8_t *)p[2], (int)p[1], p[3], b, y + off, ldy, M, p[4], K);
        off += p[4];
    }
}

/* One token's q [Hq, D] and k [Hk, D]: Qwen3's RMSNorm over each head (qn/kn not NULL), then rotary. */
static void qk_prepare(float *q, float *k, int Hq, int Hk, int D, const float *qn, const float *kn, float eps,
                       const float *cs, int rot) {
    if (qn) {
        for (int h = 0; h < Hq; h++) rms_row(q + h * D, 0, 0, qn, q + h * D, D, eps);
        for (int h = 0; h < Hk; h++) rms_row(k + h * D, 0, 0, kn, k + h * D, D, eps);
    }
    rotary_heads(q, Hq, D, cs, rot);
    rotary_heads(k, Hk, D, cs, rot);
}

/* The model (MODEL_WORDS int64): layers, hidden, q heads, kv heads, head dim, intermediate, rotary dims,
 * cos|sin table, final norm, page table, its row stride, embedding kind (1 stored, 2 float32 rows), type,
 * data, row bytes, int8 mode (1: the int8-activation dot for Q4_0/Q4_1/Q8_0 parts, see lin_run), and for
 * sparse layers their scratch: floats (B x (E + 2 k + k (2 H + 3 I_moe))) and int64 (B k + E + 1). For B
 * decode tokens: ids, positions, KV slots, page-table rows and key counts (int64); scratch holds
 * B x (3 H + qkv + Hq D + 3 I) floats, then in int8 mode B x ceil(max(H, Hq D, I) / 128) x 84 floats
 * (room for the quantized rows: xgroup); out [B, H] gets the final norm's output. */
void decode_step_f32(const int64_t *m, const int64_t *layers, const int64_t *ids, const int64_t *pos,
                     const int64_t *loc, const int64_t *rows, const int64_t *lens, int64_t B, float *scratch,
                     float *out, float eps, float scale, int num_threads) {
    const int64_t L = m[0], H = m[1], Hq = m[2], Hkv = m[3], D = m[4], I = m[5], rot = m[6];
    const float *cos_sin = (const float *)m[7], *final_norm = (const float *)m[8];
    const int32_t *pt = (const int32_t *)m[9];
    const int64_t QKV = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    float *x = scratch, *res = x + B * H, *nrm = res + B * H, *qkv = nrm + B * H, *att = qkv + B * QKV;
    float *gu = att + B * Hq * D, *act = gu + B * 2 * I;
    xgroup *qx = m[15] ? (xgroup *)(act + B * I) : 0;  // int8 mode: the quantized rows after act
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *row = (const uint8_t *)m[13] + ids[b] * m[14];
            if (m[11] == 1)
                dequant_span((int)m[12], row, 0, H, x + b * H);
            else
                memcpy(x + b * H, row, H * sizeof(float));
        }
        for (int64_t l = 0; l < L; l++) {
            const int64_t *ly = layers + l * LAYER_WORDS;
            const float *qn = (const float *)ly[2], *kn = (const float *)ly[3];
            float *kc = (float *)ly[4], *vc = (float *)ly[5];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {  // the first layer's stream is x alone
                if (l == 0) memcpy(res + b * H, x + b * H, H * sizeof(float));
                rms_row(x + b * H, l ? res + b * H : 0, res + b * H, (const float *)ly[0], nrm + b * H, H, eps);
            }
            lin_run(ly + 6, nrm, H, qkv, QKV, B, H, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                float *q = qkv + b * QKV, *k = q + Hq * D, *v = k + kv_row;
                qk_prepare(q, k, (int)Hq, (int)Hkv, (int)D, qn, kn, eps, cos_sin + pos[b] * rot, (int)rot);
                memcpy(kc + loc[b] * kv_row, k, kv_row * sizeof(float));
                memcpy(vc + loc[b] * kv_row, v, kv_row * sizeof(float));
            }
            decode_attention_work(qkv, QKV, kc, vc, pt, m[10], rows, lens, att, (int)B, (int)Hq, (int)Hkv, (int)D,
                                  scale, ly[6 + 4 * LIN_WORDS]);
            lin_run(ly + 6 + LIN_WORDS, att, Hq * D, x, H, B, Hq * D, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++)
                rms_row(x + b * H, res + b * H, res + b * H, (const float *)ly[1], nrm + b * H, H, eps);
            const int64_t *mo = ly + 7 + 4 * LIN_WORDS;
            if (mo[LIN_WORDS + 3]) {  // a sparse layer: route, then its stored experts
                const int64_t E = mo[LIN_WORDS], k = mo[LIN_WORDS + 1];
                float *logits = (float *)m[16], *wts = logits + B * E;
                int32_t *eids = (int32_t *)(wts + B * k);
                lin_run(mo, nrm, H, logits, E, B, H, 0);
#pragma omp single
                moe_route_rows(logits, B, E, k, (int)mo[LIN_WORDS + 2], eids, wts);
                float *ms = (float *)(eids + B * k);  // then the experts' rows, and in int8 mode their quants
                const int64_t Im = mo[LIN_WORDS + 4];
                moe_stored_work(nrm, H, B, H, Im, k, eids, wts, (const int64_t *)mo[LIN_WORDS + 3], E, x, ms,
                                (int64_t *)m[17], m[15] ? (xgroup *)(ms + B * k * (2 * H + 3 * Im)) : 0);
                continue;
            }
            lin_run(ly + 6 + 2 * LIN_WORDS, nrm, H, gu, 2 * I, B, H, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) silu_row(gu + b * 2 * I, gu + b * 2 * I + I, act + b * I, I);
            lin_run(ly + 6 + 3 * LIN_WORDS, act, I, x, H, B, I, qx);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) rms_row(x + b * H, res + b * H, res + b * H, final_norm, out + b * H, H, eps);
    }
}
#endif
