/* The per-layer elementwise steps, one call each instead of 5-20 small torch ops (at decode's batch sizes
 * their dispatch cost exceeds their work): rms_norm_f32, silu_and_mul_f32, rotary_neox_f32, store_kv_f32.
 * Their row functions (rms_row, silu_row, rotary_heads: ops.h) serve the decode step and the MoE too. */
#include "ops.h"

void rms_row(const float *xr, const float *residual, float *residual_out, const float *w, float *o,
             int64_t H, float eps) {
    float sum = 0.0f;
    if (residual) {
        for (int64_t i = 0; i < H; i++) {
            float r = xr[i] + residual[i];
            residual_out[i] = r;
            sum += r * r;
        }
        xr = residual_out;
    } else {
        for (int64_t i = 0; i < H; i++) sum += xr[i] * xr[i];
    }
    float inv = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xr[i] * inv);
}

/* rms_row over M rows; row strides are in floats (x_stride for x, H for the others). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *residual_out, const float *w,
                  float *out, int64_t M, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H > 16384)
    for (int64_t m = 0; m < M; m++)
        rms_row(x + m * x_stride, residual ? residual + m * H : 0, residual ? residual_out + m * H : 0, w,
                out + m * H, H, eps);
}

static inline float silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

void silu_row(const float *g, const float *u, float *o, int64_t I) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) o[i] = silu_mul1(g[i], u[i]);
}

/* x = [gate | up] per row (row stride x_stride) -> out [M, I] = silu(gate) * up. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t M, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I > 16384)
    for (int64_t m = 0; m < M; m++) silu_row(x + m * x_stride, x + m * x_stride + I, out + m * I, I);
}

void rotary_heads(float *x, int H, int D, const float *cs, int rot) {
    int half = rot / 2;
    const float *sn = cs + half;
    for (int h = 0; h < H; h++, x += D)
        for (int i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cs[i] - x2 * sn[i];
            x[i + half] = x2 * cs[i] + x1 * sn[i];
        }
}

/* rotary_heads on every token of q [T, Hq, D] and k [T, Hk, D] (token strides in floats, heads
 * contiguous); cos_sin [max_pos, rot] holds cos then sin for the rot/2 frequencies. */
void rotary_neox_f32(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
                     const float *cos_sin, int64_t T, int Hq, int Hk, int D, int rot) {
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * rot;
        rotary_heads(q + t * q_stride, Hq, D, cs, rot);
        rotary_heads(k + t * k_stride, Hk, D, cs, rot);
    }
}

/* k_cache[loc[t]] = k[t], v_cache[loc[t]] = v[t]; a row is `row` floats, k/v token strides in floats. */
void store_kv_f32(float *k_cache, float *v_cache, const int64_t *loc, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + loc[t] * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + loc[t] * row, v + t * v_stride, row * sizeof(float));
    }
}
