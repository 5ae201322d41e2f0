/* Paged attention: each query row attends over its request's keys through the token-level page table
 * (position -> KV slot), with no gather into a padded copy: decode rows, a verify step's rows, a prefill's
 * rows. Each OpenMP task is one (request, KV head): it reads every K/V row of that head once, for all the
 * query heads of its GQA group (and for the consecutive rows of one request together), with an online
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

#define SPLIT_MIN 64    /* keys per split at least */
#define RUN_FLOATS 8192 /* a run's queries at most, in floats (they and their accumulators are on the stack) */

/* Where the runs of rows begin (start[u], and start[nruns] = B); returns nruns. A run: consecutive rows of
 * one request that attend the same keys plus one more each (a verify step's rows: the same page-table row,
 * lens one apart, no window cutting their first keys apart), at most rmax rows. */
static int find_runs(const int64_t *rows, const int64_t *lens, int B, int rmax, int64_t window, int *start) {
    int n = 0;
    for (int b = 0; b < B; n++) {
        start[n] = b++;
        while (b < B && b - start[n] < rmax && rows[b] == rows[b - 1] && lens[b] == lens[b - 1] + 1 &&
               (window <= 0 || lens[b] <= window))
            b++;
    }
    start[n] = B;
    return n;
}

/* ops.h says what decode_attention_work computes. The tasks are (run, KV head, split): a run's R rows
 * attend their common keys together, as R G query heads of the one KV head, so each K/V row is read once
 * for all of them; each row then attends its own last keys alone. The common part ends at a multiple of
 * CHUNK keys from the first, so every row's keys fall in the chunks they would fall in attending alone. */
void decode_attention_work(const float *q, int64_t q_stride, const float *k, const float *v,
                           const int32_t *page_table, int64_t table_stride, const int64_t *rows,
                           const int64_t *lens, float *out, int B, int Hq, int Hkv, int D, float scale,
                           int64_t window) {
    const int G = Hq / Hkv, nt = omp_get_num_threads();
    const int64_t slot_stride = (int64_t)Hkv * D;
    int *start = (int *)malloc(sizeof(int) * (B + 1));  // each thread's own (a prefill has many rows)
    const int rmax = RUN_FLOATS / (G * D) > 1 ? RUN_FLOATS / (G * D) : 1;
    const int U = find_runs(rows, lens, B, rmax, window, start);  // every thread finds the same runs
#define FIRST_KEY(b) (window > 0 && lens[b] > window ? lens[b] - window : 0)
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = lens[b] - FIRST_KEY(b) > longest ? lens[b] - FIRST_KEY(b) : longest;
    int S = U * Hkv < 2 * nt ? (2 * nt + U * Hkv - 1) / (U * Hkv) : 1;
    if (S > longest / SPLIT_MIN) S = longest / SPLIT_MIN > 1 ? (int)(longest / SPLIT_MIN) : 1;
    float *part = 0;  // with splits: per (row, head, split): m [G], l [G], acc [G, D]
    const int64_t W = (int64_t)G * (D + 2);
    if (S > 1) {
#pragma omp single copyprivate(part)
        part = (float *)malloc(sizeof(float) * B * Hkv * S * W);
    }
#pragma omp for collapse(3) schedule(dynamic)
    for (int u = 0; u < U; u++)
        for (int h = 0; h < Hkv; h++)
            for (int sp = 0; sp < S; sp++) {
                const int b0 = start[u], R = start[u + 1] - b0, GR = G * R;
                float qr[R > 1 ? GR * D : 1], m[GR], l[GR], acc[GR * D];
                const float *qs = q + b0 * q_stride + (int64_t)h * G * D;  // the run's queries, side by side
                if (R > 1) {
                    for (int r = 0; r < R; r++) memcpy(qr + r * G * D, qs + r * q_stride, sizeof(float) * G * D);
                    qs = qr;
                }
                const int32_t *slots = page_table + rows[b0] * table_stride;
                const float *kh = k + (int64_t)h * D, *vh = v + (int64_t)h * D;
                const int64_t first = FIRST_KEY(b0);
                const int64_t common = R > 1 ? first + (lens[b0] - first) / CHUNK * CHUNK : lens[b0];
                const int64_t per = (common - first + S - 1) / S, lo = first + sp * per;
                const int64_t hi = lo + per < common ? lo + per : common;
                online_softmax_init(m, l, acc, GR, D);
                if (lo < hi) attend_group(qs, kh, vh, slot_stride, slots + lo, hi - lo, GR, D, scale, m, l, acc);
                if (sp == S - 1)  // each row's own last keys (all of them past the common part)
                    for (int r = 0; r < R; r++)
                        if (lens[b0 + r] > common)
                            attend_group(qs + r * G * D, kh, vh, slot_stride, slots + common, lens[b0 + r] - common,
                                         G, D, scale, m + r * G, l + r * G, acc + r * G * D);
                for (int r = 0; r < R; r++) {
                    const int64_t b = b0 + r;
                    if (S == 1) {
                        online_softmax_finish(acc + r * G * D, l + r * G, G, D, out + (b * Hq + (int64_t)h * G) * D);
                        continue;
                    }
                    float *pm = part + ((b * Hkv + h) * S + sp) * W;
                    memcpy(pm, m + r * G, sizeof(float) * G);
                    memcpy(pm + G, l + r * G, sizeof(float) * G);
                    memcpy(pm + 2 * G, acc + r * G * D, sizeof(float) * G * D);
                }
            }
    free(start);
    if (S == 1) return;
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
