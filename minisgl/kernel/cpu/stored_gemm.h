/* The stored GEMM's interface for the other files (stored_gemm.c): its work function, and the dot paths' task
 * loop that the int8 dot (q8_dot.c) runs its own group kernel in. */
#ifndef MINISGL_CPU_STORED_GEMM_H
#define MINISGL_CPU_STORED_GEMM_H

#include "simd.h"

#define GR 4       /* weight rows per task on the dot paths */
#define PASS_MAX 9 /* rows of x a call of a group_fn at most */
#define MB_DOT 128 /* rows of x a block of the dot paths */

/* out[r][m] = weight row p[r] (r < GR, K elements of GGML type `type`) dotted with row m < M of x (rows ld
 * elements apart); pf [pf_len): memory the next groups read, to prefetch along the way. */
typedef void (*group_fn)(int type, int M, const void *x, int64_t ld, const uint8_t *const p[GR], int64_t K,
                         const uint8_t *pf, int64_t pf_len, float out[GR][PASS_MAX]);

/* The dot paths' task loop (the exact one over float rows of x, the int8 one over quantized rows): GR weight
 * rows a task, `pass` rows of x a call of fn (as many as the registers hold; the group's blocks come from L1
 * after the first pass), the group PF_AHEAD groups on (its rows are contiguous) prefetched while this one
 * computes. Past MB_DOT rows of x the rows go in blocks of MB_DOT, each against every group, so a block's
 * rows stay in L2 while the weights stream through once a block. x's rows are ld elements of elem bytes
 * apart. For the threads of an enclosing parallel region. */
HIDDEN void dot_tasks_work(group_fn fn, int pass, const void *x, int64_t ld, size_t elem, const uint8_t *w,
                           int type, int64_t row_bytes, const float *bias, float *y, int64_t ldy, int64_t M,
                           int64_t N, int64_t K);

/* linear_stored's work for the threads of an enclosing parallel region (alone: one thread): y [M, N] (row
 * stride ldy) = x [M, K] (row stride ldx) times the stored W [N, K] (rows row_bytes apart), transposed
 * (+ bias). */
HIDDEN void linear_stored_work(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes,
                               const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);

/* The entry point (stored_gemm.c): linear_stored_work in a parallel region of num_threads. */
void linear_stored(const float *x, int64_t ldx, const uint8_t *w, int type, int64_t row_bytes, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads);

#endif
