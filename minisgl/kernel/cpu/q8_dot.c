/* The int8-activation dot (q8.h says its arithmetic): activations quantized a block of 32 at a time
 * (quant_rows_work), then the dot of GR weight rows with up to Q8_PASS quantized rows a call (q8_group: 512-bit
 * VNNI for four blocks a vector, 256-bit VNNI or AVX2 for two, scalar without AVX2) inside the stored GEMM's task
 * loop. Entry point: linear_stored_q8. */
#include "q8.h"
#include "stored_gemm.h"

/* Whether this build's int8 dot reads the type (the Python side asks). */
int q8_type_supported(int type) { return q8_type(type); }

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

void quant_rows_work(const float *x, int64_t ldx, int64_t M, int64_t K, xgroup *qx) {
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

/* Any M: a tile of GR weight rows by Q8_PASS rows of x a call, the rows in blocks of MB_DOT (dot_tasks_work);
 * with AVX-512 VNNI, from Q8_GEMM_MIN rows the GEMM of q8_gemm.c. */
void linear_q8_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes, const float *bias, float *y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K) {
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
