/* The int8-activation dot (opt-in: --stored-dot int8), shared by its files: the quantized activations'
 * layout (xgroup), which types and row counts take it, and the work functions the decode step and the MoE
 * call (q8_dot.c: quantizing, the dot; q8_gemm.c: the GEMM for many rows).
 * llama.cpp's arithmetic for Q4_0 / Q4_1 / Q8_0 weights: each block of 32 activations is quantized to int8
 * with one float32 scale d = max|x| / 127 (q = round(x / d), half away from zero) and s = d * sum(q); a
 * block's dot with a weight block is then an exact integer sum times d_w d_x (plus m_w s_x for Q4_1's
 * minimum), the terms summed in float32. Approximate (the activations lose bits, ~0.5% relative error a
 * GEMV on random data), and for Q4_1 about half the time a block of dequantizing it to float32. */
#ifndef MINISGL_CPU_Q8_H
#define MINISGL_CPU_Q8_H

#include "layout.h"
#include "quants.h"

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
_Static_assert(sizeof(xgroup) == XB * LAYOUT_Q8_BLOCK_BYTES, "layout.py's Q8_BLOCK_BYTES sizes the scratch");

/* Q4_K / Q5_K / Q6_K: AVX-512 VNNI builds only (their sub-blocks of 32 / 16 map onto its quads of blocks;
 * the other builds keep the exact dot for them) */
static inline int q8_kquant(int type) {
    return HAVE_VNNI512 && (type == GT_Q4_K || type == GT_Q5_K || type == GT_Q6_K);
}
static inline int q8_type(int type) {
    return type == GT_Q4_0 || type == GT_Q4_1 || type == GT_Q8_0 || q8_kquant(type);
}

#ifndef Q8_GEMM_MIN
#define Q8_GEMM_MIN 10 /* rows of x from which the GEMM beats q8_group (its repacking pays): one thread, Q4_1,
                          the stored_dot shapes: 8 rows 13.5 against 15.1 ms, 12 rows 19.8 against 17.4 */
#endif
#ifndef Q8_K_ROWS
#define Q8_K_ROWS 32 /* rows of x from which the K-quants' exact GEMM (panels of dequantized weights) is faster:
                        Q4_K at 1B-Llama shapes, 24 rows 100 against 80 G weight-rows/s, 32 rows 93 against 106 */
#endif
/* Whether a linear of M rows of x multiplies this type by the int8 dot. */
static inline int q8_takes(int type, int64_t M) { return q8_type(type) && !(q8_kquant(type) && M >= Q8_K_ROWS); }

/* qx [M][(K / 32 + XB - 1) / XB] = the rows of x quantized, shared by the threads of an enclosing region
 * (the loop's end is their barrier). */
HIDDEN void quant_rows_work(const float *x, int64_t ldx, int64_t M, int64_t K, xgroup *qx);

/* y [M, N] = the quantized x (quant_rows_work) times the stored W [N, K] (q8_type), transposed (+ bias);
 * for the threads of an enclosing region. */
HIDDEN void linear_q8_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes, const float *bias,
                           float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);

#if HAVE_VNNI512
/* linear_q8_work for many rows of x (Q4_0, Q4_1, Q8_0 from Q8_GEMM_MIN rows: q8_gemm.c). */
HIDDEN void linear_q8_gemm_work(const xgroup *qx, const uint8_t *w, int type, int64_t row_bytes,
                                const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
#endif

#endif
