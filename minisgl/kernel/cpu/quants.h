/* GGUF weights as stored: the block formats (GGML type ids, block sizes, fp16/bf16 words) and the inline
 * dequantizers the stored GEMM and the row dequantizer (dequant.c) expand in their loops: a block of 32 or a
 * K-quant run of 32 into vectors of VW floats (AVX2 builds).
 * A stored weight [N, K] is N rows of K/QK blocks (the file's bytes, row-major). Each block is dequantized
 * with the reference's arithmetic: every product of a scale and a quant is exact in float32 (an fp16
 * scale has 11 significant bits, the quants and sub-scales at most 13), so the one rounding per weight is
 * the final add of Q4_1/Q4_K's minimum and the dequantized values equal gguf.quants.dequantize bit for bit,
 * whatever the compiler contracts. The products with the activations then accumulate in float32: the
 * result is the float32 GEMM on the dequantized weights up to summation order. */
#ifndef MINISGL_CPU_QUANTS_H
#define MINISGL_CPU_QUANTS_H

#include "simd.h"

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

static inline int64_t qk_of(int type) {
    if (type == GT_F32 || type == GT_F16 || type == GT_BF16) return 1;
    return (type >= GT_Q2_K && type <= GT_Q6_K) || type == GT_IQ4_XS ? 256 : 32;
}

static inline int64_t block_bytes(int type) {
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

/* Elements [k0, k0 + n) of one stored row dequantized into out, k0 and n multiples of the block size
 * (dequant.c). */
HIDDEN void dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, float *out);

#endif
