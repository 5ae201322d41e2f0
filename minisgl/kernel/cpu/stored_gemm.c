/* The GEMM on GGUF weights as stored, y = x W^T (+ b), the blocks dequantized inside the kernel
 * (linear_stored): by row count of x, the dot path (GR weight rows a task, each block dequantized into
 * registers once for all of up to DOT_MAX rows of x: dot_group for one row, dot_group_wide from two), the
 * panel path (NR weight rows dequantized into gemm.c's panel layout, run through its micro-kernels), or with
 * AVX-512 from XT_MIN rows the transposed-x path (x's rows in the lanes). Both dots sum a row's products in
 * one order (the same chains, the same lane pairs: lane_sums), so a row of x gets the same bits alone as
 * with up to DOT_MAX - 1 others: a verify step's rows agree with the decode steps they stand for.
 * dot_tasks_work is the dot paths' task loop, shared with the int8 dot (q8_dot.c). */
#include "gemm.h"
#include "quants.h"
#include "stored_gemm.h"

#define QKC 256 /* K elements dequantized at a time: a multiple of every block size */
#define PF_AHEAD 8 /* groups ahead that the dot path prefetches */
#define DOT_MAX 9 /* rows of x up to which the dot path beats the panel path (its dequantizing and transposes) */
#ifndef WIDE_MIN
#define WIDE_MIN 2 /* rows of x from which the dot takes one weight row at a time (dot_group_wide) */
#endif
_Static_assert(DOT_MAX <= PASS_MAX && DOT_MAX == 9, "dot_group_any's cases run up to 9 rows of x in one call");

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;  // vectorised by the compiler (-fassociative-math)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#if HAVE_AVX2
/* out[j] = the sum of a[j]'s VW lanes, j < n. With 16 lanes, 16 sums at a time (15 adds and 30 shuffles, where
 * one at a time takes 4 adds and 4 shuffles each), the lanes paired as _mm512_reduce_add_ps pairs them (lane i
 * with i + 8, then + 4, + 2, + 1): a sum does not depend on the others taken with it, so a row of x gets the
 * same bits whichever path and whatever row count computed it. */
static inline __attribute__((always_inline)) void lane_sums(const vf *a, const int n, float *out) {
#if VW == 16
    if (n <= 4) {  // a vector's sums in each 128-bit lane after two levels, the last two within the lanes
        const vf z = vf_zero(), a0 = a[0], a1 = n > 1 ? a[1] : z, a2 = n > 2 ? a[2] : z, a3 = n > 3 ? a[3] : z;
        const vf s0 = vf_add(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
        const vf s1 = vf_add(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
        const vf t = vf_add(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xdd));
        const vf u = vf_add(t, _mm512_permute_ps(t, 0x4e));        // lanes 0, 1: + 2
        const vf r = vf_add(u, _mm512_permute_ps(u, 0xb1));        // lane 0: + 1
        out[0] = _mm512_cvtss_f32(r);  // lane 4j: vector j's sum (not through memory: a reload would stall)
        if (n > 1) out[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(r, 1));
        if (n > 2) out[2] = _mm_cvtss_f32(_mm512_extractf32x4_ps(r, 2));
        if (n > 3) out[3] = _mm_cvtss_f32(_mm512_extractf32x4_ps(r, 3));
        return;
    }
    for (int j0 = 0; j0 < n; j0 += 16) {
        vf b[16], s[8], t[4], u[2];
        for (int i = 0; i < 16; i++) b[i] = j0 + i < n ? a[j0 + i] : vf_zero();
        for (int i = 0; i < 8; i++)  // lanes 0-7 of a vector + lanes 8-15: two vectors' 8 sums in one
            s[i] = vf_add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xee));
        for (int i = 0; i < 4; i++)  // + 4: four vectors' 4 sums
            t[i] = vf_add(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88), _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xdd));
        for (int i = 0; i < 2; i++)  // + 2, within each 128-bit lane
            u[i] = vf_add(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
        const vf r = vf_add(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xdd));
        // r's lane 4q + e holds vector 4e + q's sum: transposed back
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        float sums[16] __attribute__((aligned(64)));  // whole: a masked store stalls the loads after it
        _mm512_store_ps(sums, _mm512_permutexvar_ps(order, r));
        for (int j = 0; j < 16 && j0 + j < n; j++) out[j0 + j] = sums[j];
    }
#else
    for (int j = 0; j < n; j++) out[j] = vf_sum(a[j]);
#endif
}
#endif

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

void dot_tasks_work(group_fn fn, int pass, const void *x, int64_t ld, size_t elem, const uint8_t *w, int type,
                    int64_t row_bytes, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
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
    vf sums[GR * 3];
    float flat[GR * 3];
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) sums[r * M + m] = M == 1 ? vf_add(acc[r][m][0], acc[r][m][1]) : acc[r][m][0];
    lane_sums(sums, GR * M, flat);
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) out[r][m] = flat[r * M + m];
}

/* acc[m][i % C] += 32 weights v . x row m's 32 values at x (rows ldx apart), for M rows, C chains a row. */
static inline __attribute__((always_inline)) void dot_rows_wide(const int M, const int C, const vf v[32 / VW],
                                                                const float *x, int64_t ldx, vf acc[DOT_MAX][2]) {
    for (int i = 0; i < 32 / VW; i++)
        for (int m = 0; m < M; m++) acc[m][i % C] = vf_fma(v[i], vf_load(x + m * ldx + VW * i), acc[m][i % C]);
}

/* Bytes of x's rows (M rows, a span of K) that the wide dot reads against each weight row in turn: a span
 * stays in L2 while the group's rows pass over it. */
#define WIDE_X_BYTES (192 * 1024)
/* Q6_K's runs of 32 in the order dot_group takes them (pairs that share their bytes): the wide dot sums them
 * in the same order, so a row's bits agree. */
static const uint8_t Q6K_RUN_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};

/* dot_group for WIDE_MIN..DOT_MAX rows of x: the GR weight rows one at a time, so the registers hold all M rows'
 * accumulators beside the block being dequantized, every block dequantized once for all of them and
 * interleaved with their FMAs (dot_group holds GR rows' accumulators for up to 3 rows of x and dequantizes
 * again for every 3 more). Q4_0 / Q4_1 / Q8_0 (type != 0) are dequantized into registers and a weight row
 * runs over all of K at once (over spans of x short enough to stay in L2 where K is long); the other types
 * (type 0) a chunk of QKC at a time into buf, which a chunk of x's rows in L1 meets for each weight row.
 * Partial sums wait in part between spans or chunks; the GR x M sums are taken together at the end. */
static inline __attribute__((always_inline)) void dot_group_wide(const int type, const int M, const float *x,
                                                                 int64_t ldx, const uint8_t *const p[GR],
                                                                 int wtype, int64_t K, const uint8_t *pf,
                                                                 int64_t pf_len, float out[GR][PASS_MAX]) {
    const int C = 2;  // chains a row of x, as dot_group's one row (8 lanes: at most 5 rows a call, for the registers)
    vf part[GR][DOT_MAX][2];
    const int64_t span_x = WIDE_X_BYTES / (M * (int64_t)sizeof(float)) / QKC * QKC;
    const int64_t span = type ? (K < span_x ? K : span_x) : QKC;
    const int64_t spans = (K + span - 1) / span;
    const int64_t pf_step = (pf_len + spans * GR - 1) / (spans * GR);  // a slice each weight row of each span
    for (int64_t k0 = 0, c = 0; k0 < K; k0 += span, c++) {
        const int64_t kc = K - k0 < span ? K - k0 : span;
        float buf[GR * QKC] __attribute__((aligned(32)));
        if (!type)
            for (int r = 0; r < GR; r++) dequant_span(wtype, p[r], k0, kc, buf + r * QKC);
        for (int r = 0; r < GR; r++) {
            const int64_t pf0 = (c * GR + r) * pf_step;
            for (int64_t line = pf0; line < pf0 + pf_step && line < pf_len; line += 64)
                _mm_prefetch((const char *)(pf + line), _MM_HINT_T0);
            vf acc[DOT_MAX][2];
            for (int m = 0; m < M; m++)
                for (int j = 0; j < C; j++) acc[m][j] = k0 ? part[r][m][j] : vf_zero();
            for (int64_t k = 0; k < kc; k += 32) {
                vf v[32 / VW];
                const int64_t kk = VW == 16 && wtype == GT_Q6_K ? 32 * Q6K_RUN_ORDER[k / 32] : k;  // kc: one block
                if (type) {
                    deq32(type, p[r] + (k0 + k) / 32 * block_bytes(type), v);
                } else {
                    for (int i = 0; i < 32 / VW; i++) v[i] = vf_load(buf + r * QKC + kk + VW * i);
                }
                dot_rows_wide(M, C, v, x + k0 + kk, ldx, acc);
            }
            for (int m = 0; m < M; m++)
                for (int j = 0; j < C; j++) part[r][m][j] = acc[m][j];
        }
    }
    vf sums[GR * DOT_MAX];
    float flat[GR * DOT_MAX];
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) sums[r * M + m] = vf_add(part[r][m][0], part[r][m][1]);
    lane_sums(sums, GR * M, flat);
    for (int r = 0; r < GR; r++)
        for (int m = 0; m < M; m++) out[r][m] = flat[r * M + m];
}

#define WIDE_CASE(T, MM) dot_group_wide(T, MM, x, ldx, p, type, K, pf, pf_len, out)
/* dot_group_wide for M rows of x (WIDE_MIN..DOT_MAX), weight type T */
#define WIDE_ROWS(T)                                                                                        \
    switch (M) { /* M >= WIDE_MIN */                                                                        \
    case 2: WIDE_CASE(T, 2); break;                                                                         \
    case 3: WIDE_CASE(T, 3); break;                                                                         \
    case 4: WIDE_CASE(T, 4); break;                                                                         \
    case 5: WIDE_CASE(T, 5); break;                                                                         \
    case 6: WIDE_CASE(T, 6); break;                                                                         \
    case 7: WIDE_CASE(T, 7); break;                                                                         \
    case 8: WIDE_CASE(T, 8); break;                                                                         \
    default: WIDE_CASE(T, 9); break;                                                                        \
    }
#define DOT_CASE(T, MM) dot_group(T, MM, x, ldx, p, type, K, pf, pf_len, out)
static void dot_group_any(int type, int M, const float *x, int64_t ldx, const uint8_t *const p[GR], int64_t K,
                          const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    if (M >= WIDE_MIN) {  // Q4_0 / Q4_1 / Q8_0 dequantized into registers, the other types a chunk at a time into buf
        switch (type) {
        case GT_Q4_0: WIDE_ROWS(GT_Q4_0); break;
        case GT_Q4_1: WIDE_ROWS(GT_Q4_1); break;
        case GT_Q8_0: WIDE_ROWS(GT_Q8_0); break;
        default: WIDE_ROWS(0); break;
        }
        return;
    }
#define DOT_ROWS(T) (WIDE_MIN <= 2 || M == 1 ? DOT_CASE(T, 1) : M == 2 ? DOT_CASE(T, 2) : DOT_CASE(T, 3))
#define DOT_TYPE(T)                                                                                         \
    case T: DOT_ROWS(T); break;
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
    default: DOT_ROWS(0); break;
    }
#undef DOT_TYPE
#undef DOT_ROWS
}

static void dot_group_fn(int type, int M, const void *x, int64_t ldx, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]) {
    dot_group_any(type, M, (const float *)x, ldx, p, K, pf, pf_len, out);
}

/* The dot path for 1..DOT_MAX rows of x. */
static void linear_stored_dot_avx2_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                                        const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                                        int64_t K) {
    // 8 lanes: at most 5 rows of x a pass, the most whose two chains a row the 16 registers hold (one chain
    // would sum in another order than one row alone does), in passes as even as they go
    const int64_t passes = (M + 4) / 5, pass = VW == 16 ? DOT_MAX : (M + passes - 1) / passes;
    dot_tasks_work(dot_group_fn, (int)pass, x, ldx, sizeof(float), w, type, row_bytes, bias, y, ldy, M, N, K);
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
#define XT_MIN 16 /* rows of x from which the stored GEMM puts x's rows in the lanes (fewer: lanes idle) */
#define XT_GROUP_BYTES (512 * 1024) /* x's transposed rows that every panel of W meets in turn */

/* ya [B][16 columns][16 rows] (+)= the B blocks of 16 rows of x at xb ([k][16], blocks ldb floats apart) times
 * the 16 dequantized weight rows in w ([16][QKC]) over kc: 8 columns at a time, so each broadcast weight
 * meets B rows' vectors (B = 3: 24 accumulators, 11 loads for 24 FMAs, where one block a pass loads 17). */
static inline __attribute__((always_inline)) void xt_micro(const int B, const float *xb, int64_t ldb, const float *w,
                                                           int64_t kc, float *ya, int accumulate) {
    for (int h = 0; h < 16; h += 8) {
        __m512 acc[3][8];
        for (int b = 0; b < B; b++)
            for (int n = 0; n < 8; n++)
                acc[b][n] = accumulate ? _mm512_load_ps(ya + b * 256 + (h + n) * 16) : _mm512_setzero_ps();
        for (int64_t k = 0; k < kc; k++) {
            __m512 xv[3];
            for (int b = 0; b < B; b++) xv[b] = _mm512_load_ps(xb + b * ldb + k * 16);
#pragma GCC unroll 8
            for (int n = 0; n < 8; n++) {
                const __m512 wv = _mm512_set1_ps(w[(h + n) * QKC + k]);
                for (int b = 0; b < B; b++) acc[b][n] = _mm512_fmadd_ps(wv, xv[b], acc[b][n]);
            }
        }
        for (int b = 0; b < B; b++)
            for (int n = 0; n < 8; n++) _mm512_store_ps(ya + b * 256 + (h + n) * 16, acc[b][n]);
    }
}

/* The panel path with x's rows in the 16 lanes instead of W's (AVX-512): x is transposed once into blocks of
 * 16 rows, [k][16 rows], so each panel of 16 weight rows is dequantized row by row as stored and read back
 * as broadcasts, with no transposes of W (which cost as much as the dequantizing at decode's row counts).
 * xt_micro keeps the output columns of a group's row blocks; partial sums over K chunks wait in yacc. */
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
    // x's row blocks in groups whose transposed rows stay in L2 while every panel of W passes over them (each
    // panel dequantized once a group, as before a group of 8): the panels outside read all of x from L3
    const int64_t group = XT_GROUP_BYTES / (K * 16 * (int64_t)sizeof(float)), gmb = group < 1 ? 1 : group > 8 ? 8 : group;
    for (int64_t mb0 = 0; mb0 < mblocks; mb0 += gmb) {
        const int64_t nmb = mblocks - mb0 < gmb ? mblocks - mb0 : gmb;
#pragma omp for schedule(dynamic) nowait  // a panel at a time: a thread that started late takes fewer
        for (int64_t p = 0; p < panels; p++) {
            float tmp[16 * QKC] __attribute__((aligned(64)));
            float yacc[8 * 16 * 16] __attribute__((aligned(64)));  // up to 8 row blocks at a time
            int nr = (int)(N - p * 16 < 16 ? N - p * 16 : 16);
            for (int64_t k0 = 0; k0 < K; k0 += QKC) {
                int64_t kc = K - k0 < QKC ? K - k0 : QKC;
                for (int j = 0; j < 16; j++)  // rows past N: row 0 again, its outputs never written
                    dequant_span(type, w + (p * 16 + (j < nr ? j : 0)) * row_bytes, k0, kc, tmp + j * QKC);
                const float *xb = xt + (mb0 * K + k0) * 16;
                int64_t b = 0;
                for (; b + 3 <= nmb; b += 3) xt_micro(3, xb + b * K * 16, K * 16, tmp, kc, yacc + b * 256, k0 > 0);
                for (; b + 2 <= nmb; b += 2) xt_micro(2, xb + b * K * 16, K * 16, tmp, kc, yacc + b * 256, k0 > 0);
                for (; b < nmb; b++) xt_micro(1, xb + b * K * 16, K * 16, tmp, kc, yacc + b * 256, k0 > 0);
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
#pragma omp barrier
}
#endif

void linear_stored_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
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
