/* The decode step: every layer of a Llama-family model in one call (decode_step_f32), AVX2 builds only.
 * One parallel region for the whole step instead of a dozen Python-dispatched calls per layer (their
 * dispatch cost a small model's decode step as much as its GEMVs); the threads meet at a barrier after each
 * phase. Each phase runs the same code as the per-op kernels (ops.h, gemm.h, stored_gemm.h, q8.h), so the
 * step computes what the layers do. The model, its layers and their linear layers come as int64
 * descriptors whose fields layout.py names (MODEL_*, LAYER_*, LIN_*, PART_*: the generated layout.h);
 * engine/cpu_step.py fills them. */
#include "gemm.h"
#include "layout.h"
#include "ops.h"
#include "q8.h"
#include "quants.h"
#include "stored_gemm.h"

/* The layout this library was built with (layout.py's signature(): the loader checks it). */
const char *cpu_layout_signature(void) { return LAYOUT_SIGNATURE; }

#if HAVE_AVX2
/* y [M, rows of every part] (row stride ldy) = x [M, K] times the linear layer d (a LIN descriptor), its parts
 * stacked along the output. qx (not NULL: int8 mode, room for M quantized rows of K): with K a multiple of 32,
 * x is quantized once and the parts q8_takes take the int8 dot; the rest (and every part without qx) the exact
 * kernels. */
static void lin_run(const int64_t *d, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M, int64_t K,
                    xgroup *qx) {
    const float *bias = (const float *)d[LIN_BIAS];
    const int64_t parts = d[LIN_PARTS];
    int q8 = 0;
    for (int i = 0; i < parts; i++) {
        const int64_t *p = d + LIN_PART + PART_WORDS * i;
        q8 |= p[PART_KIND] == PART_STORED && q8_takes((int)p[PART_TYPE], M);
    }
    q8 = q8 && qx && K % 32 == 0;
    if (q8) quant_rows_work(x, ldx, M, K, qx);
    int64_t off = 0;
    for (int i = 0; i < parts; i++) {
        const int64_t *p = d + LIN_PART + PART_WORDS * i;
        const float *b = bias ? bias + off : 0;
        const int type = (int)p[PART_TYPE];
        if (p[PART_KIND] == PART_PACKED)
            linear_packed_work(x, ldx, (const float *)p[PART_DATA], b, y + off, ldy, M, p[PART_ROWS], K);
        else if (q8 && q8_takes(type, M))
            linear_q8_work(qx, (const uint8_t *)p[PART_DATA], type, p[PART_ROW_BYTES], b, y + off, ldy, M,
                           p[PART_ROWS], K);
        else
            linear_stored_work(x, ldx, (const uint8_t *)p[PART_DATA], type, p[PART_ROW_BYTES], b, y + off, ldy, M,
                               p[PART_ROWS], K);
        off += p[PART_ROWS];
    }
}

/* One token's q [Hq, D] and k [Hk, D]: Qwen3's RMSNorm over each head (qn/kn not NULL), then rotary. */
static void qk_prepare(float *q, float *k, int Hq, int Hk, int D, const float *qn, const float *kn, float eps,
                       const float *cs, int rot) {
    if (qn) {
        for (int h = 0; h < Hq; h++) rms_row(q + h * D, 0, 0, qn, q + h * D, D, eps);
        for (int h = 0; h < Hk; h++) rms_row(k + h * D, 0, 0, kn, k + h * D, D, eps);
    }
    rotary_heads(q, Hq, D, cs, rot);
    rotary_heads(k, Hk, D, cs, rot);
}

/* A sparse layer's MLP for the B rows of nrm, its output into x: route (softmax, top k), then its stored
 * experts. For the threads of the step's region. */
static void sparse_mlp(const int64_t *m, const int64_t *ly, const float *nrm, float *x, int64_t B, xgroup *qx) {
    const int64_t H = m[MODEL_HIDDEN], E = ly[LAYER_EXPERTS], k = ly[LAYER_TOP_K], I = ly[LAYER_EXPERT_INTER];
    float *logits = (float *)m[MODEL_MOE_FLOATS], *wts = logits + B * E;
    int32_t *eids = (int32_t *)(wts + B * k);
    lin_run(ly + LAYER_ROUTER, nrm, H, logits, E, B, H, 0);
#pragma omp single
    moe_route_rows(logits, B, E, k, (int)ly[LAYER_RENORMALIZE], eids, wts);
    float *ms = (float *)(eids + B * k);  // then the experts' rows, and in int8 mode their quants
    moe_stored_work(nrm, H, B, H, I, k, eids, wts, (const int64_t *)ly[LAYER_EXPERT_DESC], E, x, ms,
                    (int64_t *)m[MODEL_MOE_INTS], qx ? (xgroup *)(ms + B * k * (2 * H + 3 * I)) : 0);
}

/* m: the MODEL descriptor, layers: MODEL_LAYERS LAYER descriptors. The sparse layers' scratch (MODEL_MOE_*):
 * floats B x (E + 2 k + k (2 H + 3 I_moe)) (then in int8 mode the experts' quantized rows) and int64
 * B k + E + 1. For B decode tokens: ids, positions, KV slots, page-table rows and key counts (int64); scratch
 * holds B x (3 H + qkv + Hq D + 3 I) floats, then in int8 mode B x ceil(max(H, Hq D, I) / 128) x 4
 * LAYOUT_Q8_BLOCK_BYTES bytes (room for the quantized rows: xgroup); out [B, H] gets the final norm's
 * output. */
void decode_step_f32(const int64_t *m, const int64_t *layers, const int64_t *ids, const int64_t *pos,
                     const int64_t *loc, const int64_t *rows, const int64_t *lens, int64_t B, float *scratch,
                     float *out, float eps, float scale, int num_threads) {
    const int64_t L = m[MODEL_LAYERS], H = m[MODEL_HIDDEN], Hq = m[MODEL_Q_HEADS], Hkv = m[MODEL_KV_HEADS];
    const int64_t D = m[MODEL_HEAD_DIM], I = m[MODEL_INTER], rot = m[MODEL_ROT];
    const float *cos_sin = (const float *)m[MODEL_COS_SIN], *final_norm = (const float *)m[MODEL_FINAL_NORM];
    const int32_t *pt = (const int32_t *)m[MODEL_PAGE_TABLE];
    const int64_t QKV = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    float *x = scratch, *res = x + B * H, *nrm = res + B * H, *qkv = nrm + B * H, *att = qkv + B * QKV;
    float *gu = att + B * Hq * D, *act = gu + B * 2 * I;
    xgroup *qx = m[MODEL_INT8] ? (xgroup *)(act + B * I) : 0;  // int8 mode: the quantized rows after act
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *row = (const uint8_t *)m[MODEL_EMBED_DATA] + ids[b] * m[MODEL_EMBED_ROW_BYTES];
            if (m[MODEL_EMBED_KIND] == EMBED_STORED)
                dequant_span((int)m[MODEL_EMBED_TYPE], row, 0, H, x + b * H);
            else
                memcpy(x + b * H, row, H * sizeof(float));
        }
        for (int64_t l = 0; l < L; l++) {
            const int64_t *ly = layers + l * LAYER_WORDS;
            const float *qn = (const float *)ly[LAYER_Q_NORM], *kn = (const float *)ly[LAYER_K_NORM];
            float *kc = (float *)ly[LAYER_K_CACHE], *vc = (float *)ly[LAYER_V_CACHE];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {  // the first layer's stream is x alone
                if (l == 0) memcpy(res + b * H, x + b * H, H * sizeof(float));
                rms_row(x + b * H, l ? res + b * H : 0, res + b * H, (const float *)ly[LAYER_INPUT_NORM], nrm + b * H,
                        H, eps);
            }
            lin_run(ly + LAYER_QKV, nrm, H, qkv, QKV, B, H, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                float *q = qkv + b * QKV, *k = q + Hq * D, *v = k + kv_row;
                qk_prepare(q, k, (int)Hq, (int)Hkv, (int)D, qn, kn, eps, cos_sin + pos[b] * rot, (int)rot);
                memcpy(kc + loc[b] * kv_row, k, kv_row * sizeof(float));
                memcpy(vc + loc[b] * kv_row, v, kv_row * sizeof(float));
            }
            decode_attention_work(qkv, QKV, kc, vc, pt, m[MODEL_PAGE_TABLE_STRIDE], rows, lens, att, (int)B, (int)Hq,
                                  (int)Hkv, (int)D, scale, ly[LAYER_WINDOW]);
            lin_run(ly + LAYER_O, att, Hq * D, x, H, B, Hq * D, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++)
                rms_row(x + b * H, res + b * H, res + b * H, (const float *)ly[LAYER_POST_NORM], nrm + b * H, H, eps);
            if (ly[LAYER_EXPERT_DESC]) {  // a sparse layer: route, then its stored experts
                sparse_mlp(m, ly, nrm, x, B, qx);
                continue;
            }
            lin_run(ly + LAYER_GATE_UP, nrm, H, gu, 2 * I, B, H, qx);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) silu_row(gu + b * 2 * I, gu + b * 2 * I + I, act + b * I, I);
            lin_run(ly + LAYER_DOWN, act, I, x, H, B, I, qx);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) rms_row(x + b * H, res + b * H, res + b * H, final_norm, out + b * H, H, eps);
    }
}
#endif
