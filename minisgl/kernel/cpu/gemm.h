/* The packed float32 GEMM's shapes and micro-kernels (gemm.c), shared with the stored GEMM's panel path
 * (stored_gemm.c), which dequantizes weights into the same panel layout. AVX2 builds only. */
#ifndef MINISGL_CPU_GEMM_H
#define MINISGL_CPU_GEMM_H

#include "layout.h"
#include "simd.h"

#define NR LAYOUT_PANEL_ROWS /* weight rows a panel: the layout Python allocates packed weights in */
#if defined(__AVX512F__)
#define MR 12 /* one zmm a row of a panel slice: 12 accumulators, enough chains for both FMA ports */
#else
#define MR 6
#endif
#define MB 96
#define KC 192

#if HAVE_AVX2
/* y[0..R) x [0..nr) (+)= R rows of x (ldx apart) times K steps of one panel slice wp (+ bias where not
 * accumulate), for R = 1..MR; next: the panel to prefetch (or NULL). */
typedef void (*micro_fn)(const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy,
                         int nr, const float *bias, const float *next, int accumulate);
extern HIDDEN const micro_fn MICROS[MR + 1];

/* The work of linear_packed_f32 for the threads of an enclosing parallel region (alone: one thread): y [M, N]
 * = x [M, K] times the packed W, transposed (+ bias); x and y with row strides ldx and ldy. */
HIDDEN void linear_packed_work(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                               int64_t ldy, int64_t M, int64_t N, int64_t K);
#endif

/* Rows of x the next micro-kernel call takes when `left` remain: the calls of an MR-row block split it evenly
 * (16 rows as 8 + 8, not 12 + 4: a call of few rows has too few FMA chains to cover their latency). */
static inline int micro_rows_of(int64_t left) {
    const int64_t calls = (left + MR - 1) / MR;
    return (int)((left + calls - 1) / calls);
}

#endif
