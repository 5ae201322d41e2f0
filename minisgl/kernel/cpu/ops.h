/* The per-layer operations' work functions that the fused decode step (decode_step.c) and the MoE (moe.c) run
 * inside their own parallel regions: attention (attention.c), the elementwise rows (elementwise.c), the
 * sparse layer's experts and routing (moe.c). Each is the same code its entry point runs, so the step
 * computes what the layer-by-layer calls compute. */
#ifndef MINISGL_CPU_OPS_H
#define MINISGL_CPU_OPS_H

#include "q8.h"
#include "simd.h"

/* q, out: [B, Hq, D], rows q_stride floats apart for q, contiguous for out. k, v: [slots, Hkv, D]
 * contiguous. page_table: [rows, table_stride] int32. rows[b]: request b's page-table row; lens[b]: its
 * number of keys (all positions up to and including the query's), of which a layer with a sliding window
 * (window > 0) attends the last `window`. Query head h reads KV head h / (Hq / Hkv).
 * For the threads of an enclosing parallel region. One task per (request, KV head), where consecutive rows of
 * one request (a verify step's or a prefill's: the same page-table row, lens one apart) count as one
 * request whose keys are read once for all its rows; where there are fewer than two tasks a thread (a lone request), each
 * task's keys are cut into splits whose softmax states are merged after: with 3 KV heads on 2 threads one
 * thread would otherwise attend twice as long. */
HIDDEN void decode_attention_work(const float *q, int64_t q_stride, const float *k, const float *v,
                                  const int32_t *page_table, int64_t table_stride, const int64_t *rows,
                                  const int64_t *lens, float *out, int B, int Hq, int Hkv, int D, float scale,
                                  int64_t window);

/* One row: o = x' / rms(x') * w with x' = xr (+ residual); with a residual, x' is also written to
 * residual_out (which may be the residual itself). */
HIDDEN void rms_row(const float *xr, const float *residual, float *residual_out, const float *w, float *o,
                    int64_t H, float eps);

/* One row: o [I] = silu(g) * u. */
HIDDEN void silu_row(const float *g, const float *u, float *o, int64_t I);

/* Neox-style rotary, in place, on the first `rot` dims of each of the H heads of x (contiguous, D apart);
 * cs: cos then sin of the position's rot/2 frequencies. */
HIDDEN void rotary_heads(float *x, int H, int D, const float *cs, int rot);

/* moe_stored_f32's work for the threads of an enclosing parallel region (one groups the pairs): x [T, H]
 * (rows ldx apart), token t's k choices ids[t] (-1: none) weighted w[t], E expert descriptors. scratch:
 * T k (2 H + 3 I) floats; order: T k + E + 1 int64; qx: NULL for the exact dot, else room for T k rows of
 * max(H, I) quantized (the int8 dot, where q8_takes). */
HIDDEN void moe_stored_work(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I, int64_t k,
                            const int32_t *ids, const float *w, const int64_t *experts, int64_t E, float *out,
                            float *scratch, int64_t *order, xgroup *qx);

/* Mixture-of-experts routing as kernel/reference.py moe_route, for T rows of logits [T, E] (one thread):
 * softmax in float32, the top k (the larger first; the lower index first among equals), divided by their
 * sum when renormalize. */
HIDDEN void moe_route_rows(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, int32_t *ids,
                           float *w);

#endif
