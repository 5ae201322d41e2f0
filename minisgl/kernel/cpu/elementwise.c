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

/* out[m] = the first index of row m's maximum (torch.argmax's answer) for x [M, N] (row stride ld), in two
 * vector passes: the maximum, then its first position. torch's argmax took ~1 ms for a decode batch's
 * 16 x 49,152 logits; this takes a tenth of that. A row with a NaN gets -1 (torch ranks NaN first: the
 * caller asks torch then); returns how many rows had one. */
static int64_t argmax_row(const float *x, int64_t N) {
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= N; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    nan = un != 0;
    m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= N; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    nan = _mm256_movemask_ps(un) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < N; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) return -1;
    i = 0;
#if defined(__AVX512F__)
    const __m512 vmax = _mm512_set1_ps(m);
    for (; i + 16 <= N; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vmax, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
#elif defined(__AVX2__)
    const __m256 vmax = _mm256_set1_ps(m);
    for (; i + 8 <= N; i += 8) {
        int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmax, _CMP_EQ_OQ));
        if (eq) return i + __builtin_ctz(eq);
    }
#endif
    for (; i < N; i++)
        if (x[i] == m) return i;
    return 0;  // unreachable: m is one of the row's values
}

int64_t argmax_rows_f32(const float *x, int64_t ld, int64_t M, int64_t N, int32_t *out, int num_threads) {
    int64_t nans = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : nans) if (M * N > 65536)
    for (int64_t r = 0; r < M; r++) {
        int64_t idx = argmax_row(x + r * ld, N);
        out[r] = (int32_t)idx;
        nans += idx < 0;
    }
    return nans;
}
