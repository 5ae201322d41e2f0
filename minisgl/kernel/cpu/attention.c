/* Decode attention: one query token per request, attending over the request's keys through the token-level
 * page table (position -> KV slot), with no gather into a padded copy. Each OpenMP task is one (request, KV
 * head): it reads every K/V row of that head once, for all the query heads of its GQA group, with an online
 * softmax over chunks of positions. Entry point: decode_attention_f32; decode_attention_work (ops.h) is the
 * same for the threads of the decode step's parallel region. */
#include "ops.h"

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

#if HAVE_AVX2
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

/* ops.h says what decode_attention_work computes. */
void decode_attention_work(const float *q, int64_t q_stride, const float *k, const float *v,
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
