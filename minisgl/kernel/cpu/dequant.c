/* GGUF weights as stored, dequantized a span of a row at a time (dequant_span: the stored GEMM's slow paths
 * and the embedding lookups of dequant_rows), every block type exactly as gguf.quants.dequantize: the scalar
 * routines where the build has no AVX2, the vector ones of quants.h where it has. */
#include "quants.h"

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

void dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, float *out) {
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
