/* The int8 GEMM (many rows of x, AVX-512 VNNI builds only): a weight panel repacked, rows of x broadcast.
 * q8_group spends three float operations (convert, scale, add) on every pair of dpbusd, for each weight row
 * and row of x. Here one int32 lane is one weight row: QP rows' quants are repacked once per block of rows
 * of x so that vector k of a block holds each row's elements 4k..4k+3 (unsigned, as q8_wquad makes them),
 * and each row of x broadcasts its matching four quants: eight dpbusd give QP rows' whole block sums, then
 * one convert and two multiply-adds scale them, 16 rows at a time. */
#include "q8.h"

#if HAVE_VNNI512
#define QP 16                 /* weight rows a panel (one int32 lane each) */
#define Q8_MR 8               /* rows of x a micro-kernel call (its accumulators: 2 Q8_MR vectors) */
#define QPB (8 * 64 + 2 * 64) /* bytes a block of a panel: eight vectors of quants, d and 4 m (Q4_1) */
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
void linear_q8_gemm_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes, const float *bias,
                         float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
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
#endif
