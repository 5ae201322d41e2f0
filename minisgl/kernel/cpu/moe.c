/* A sparse layer's experts as stored, in one call (moe_stored_f32), and its routing (moe_route_rows, for the
 * decode step).
 * out [T, H] = sum over token t's k choices j of w[t][j] down_e(silu(gate_e(x[t])) * up_e(x[t])), e =
 * ids[t][j] (-1: none): the (token, choice) pairs are grouped by expert, each expert's rows gathered and
 * multiplied by its three stored weights at once (the exact stored GEMM, any rows), and each token's results
 * added in expert order, the reference's (kernel/reference.py fused_moe). experts: E EXPERT descriptors
 * (layout.py): per expert the STORED descriptors of gate [I, H], up [I, H], down [H, I]. */
#include "layout.h"
#include "ops.h"
#include "q8.h"
#include "stored_gemm.h"

void moe_stored_work(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I, int64_t k, const int32_t *ids,
                     const float *w, const int64_t *experts, int64_t E, float *out, float *scratch, int64_t *order,
                     xgroup *qx) {
    const int64_t P = T * k;
    int64_t *start = order + P;  // [E + 1]: expert e's pairs are order[start[e] .. start[e + 1])
    float *xs = scratch, *gu = xs + P * H, *act = gu + P * 2 * I, *ys = act + P * I;
#pragma omp single
    {
        for (int64_t e = 0; e <= E; e++) start[e] = 0;
        for (int64_t p = 0; p < P; p++)
            if (ids[p] >= 0 && ids[p] < E) start[ids[p] + 1]++;
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        for (int64_t e = 0; e < E; e++)  // pairs in token order within each expert
            for (int64_t p = 0, n = start[e]; p < P; p++)
                if (ids[p] == e) order[n++] = p;
    }
    const int64_t used = start[E], gH = (H / 32 + XB - 1) / XB, gI = (I / 32 + XB - 1) / XB;
    const int q8 = qx && H % 32 == 0 && I % 32 == 0;  // int8 mode: each expert's rows quantized once
#pragma omp for schedule(static)
    for (int64_t i = 0; i < used; i++) memcpy(xs + i * H, x + order[i] / k * ldx, H * sizeof(float));
    if (q8) quant_rows_work(xs, H, used, H, qx);
#define MOE_LIN(proj, xin, ldin, gq, y, ldy, N, K)                                                             \
    {                                                                                                          \
        const int64_t *s = d + (proj); /* its STORED descriptor */                                             \
        const int type = (int)s[STORED_TYPE];                                                                  \
        const uint8_t *data = (const uint8_t *)s[STORED_DATA];                                                 \
        if (q8 && q8_takes(type, n))                                                                           \
            linear_q8_work(qx + start[e] * (gq), data, type, s[STORED_ROW_BYTES], 0, y, ldy, n, N, K);         \
        else                                                                                                   \
            linear_stored_work(xin, ldin, data, type, s[STORED_ROW_BYTES], 0, y, ldy, n, N, K);                \
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e], *d = experts + EXPERT_WORDS * e;
        if (!n) continue;
        const float *xe = xs + start[e] * H;
        float *g = gu + start[e] * 2 * I;
        MOE_LIN(EXPERT_GATE, xe, H, gH, g, 2 * I, I, H)
        MOE_LIN(EXPERT_UP, xe, H, gH, g + I, 2 * I, I, H)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) silu_row(g + i * 2 * I, g + i * 2 * I + I, act + (start[e] + i) * I, I);
    }
    if (q8) quant_rows_work(act, I, used, I, qx);
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e], *d = experts + EXPERT_WORDS * e;
        if (!n) continue;
        MOE_LIN(EXPERT_DOWN, act + start[e] * I, I, gI, ys + start[e] * H, H, H, I)
    }
#undef MOE_LIN
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {  // each token's choices in expert order, float32 as the reference
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t i = 0; i < used; i++) {
            if (order[i] / k != t) continue;
            const float c = w[order[i]], *y = ys + i * H;
            for (int64_t h = 0; h < H; h++) o[h] += y[h] * c;
        }
    }
}

/* qx: NULL for the exact dot, else room for T k rows of max(H, I) quantized (the int8 dot, where q8_takes). */
void moe_stored_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int32_t *ids,
                    const float *w, const int64_t *experts, int64_t E, float *out, float *scratch, int64_t *order,
                    void *qx, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    moe_stored_work(x, H, T, H, I, k, ids, w, experts, E, out, scratch, order, (xgroup *)qx);
}

void moe_route_rows(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, int32_t *ids,
                    float *w) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float mx = -INFINITY, sum = 0.0f, p[E];
        for (int64_t e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(l[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        float tot = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            ids[t * k + j] = (int32_t)best, w[t * k + j] = p[best], tot += p[best];
            p[best] = -1.0f;
        }
        if (renormalize)
            for (int64_t j = 0; j < k; j++) w[t * k + j] /= tot;
    }
}
