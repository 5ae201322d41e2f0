// The decode step of one request as one persistent kernel: every decoder layer of a dense Llama-family
// model (pre-norm RMSNorm, QKV with an optional bias, Qwen3's q/k norm, neox rotary, paged attention,
// the output projection, a SiLU-gated MLP), from the embedding row to the last layer's (MLP output,
// residual). kernel/step_kernel.py builds it with nvcc, packs its arguments and launches it.
//
// One block per SM, all resident. A layer is five stages; the blocks wait for each other between stages
// at a counter in global memory (a grid barrier) instead of at kernel boundaries:
//   qkv   h = y + h2 (x on the first layer), rms_norm(h), the QKV rows of this block
//   attn  (KV head, split) work items: q/k norm + rotary, the new K/V stored, a split of the keys; the
//         last split of a KV head to finish merges that head group's splits (a per-head counter)
//   o     the output projection's rows, h2 = o + h
//   gu    rms_norm(h2), gate and up rows in pairs, silu(gate) * up
//   down  the down projection's rows: y
// Weights never depend on the step, so each block copies its rows of the next weight stages into a ring
// of shared memory (cp.async) as soon as the ring has room, before it waits at the barrier: the weight
// stream runs while the blocks wait for each other and while attention runs. Rows that do not fit the
// ring's half are read from global memory at compute time.
//
// Data written by other blocks during the launch is read with ld.global.cg (L2, never a stale L1 line).
// The roundings are the layer kernels' (kernel/reference.py): each projection's output, the residual
// adds, the normalised row before the norm weight, silu before the multiply, the merged attention output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int NT = 512;
constexpr int NW = NT / 32;
constexpr int MAXG = 8;     // query heads per KV head, at most
constexpr int RING_SLOTS = 4;

// The argument block: one int64 each, in this order (FIELDS is checked against step_kernel.py's list).
#define STEP_FIELDS(X)                                                                                     \
  X(layers) X(num_layers) X(hidden) X(heads) X(kv_heads) X(head_dim) X(inter) X(rot_half) X(splits)       \
  X(x_in) X(h) X(h2) X(y) X(qkv) X(attn) X(act) X(part_o) X(part_lse) X(k_cache) X(v_cache)              \
  X(kv_layer_stride) X(stride_kt) X(stride_kh) X(page_table) X(stride_pt) X(table_idx) X(seq_lens)        \
  X(out_loc) X(positions) X(idx64) X(cos_sin) X(stride_cs) X(counters) X(ring_bytes) X(vec_floats)       \
  X(scratch_floats)
#define AS_ENUM(name) F_##name,
enum Field { STEP_FIELDS(AS_ENUM) NUM_FIELDS };
#define AS_NAME(name) #name ","
const char kFieldNames[] = STEP_FIELDS(AS_NAME);

// per layer: the tensors' addresses, 0 where absent
enum LayerField { L_IN_NORM, L_QKV, L_QKV_BIAS, L_Q_NORM, L_K_NORM, L_O, L_POST_NORM, L_GATE_UP, L_DOWN,
                  NUM_LAYER_FIELDS };

struct Args {
  int64_t v[NUM_FIELDS];
  float eps, scale_log2;
};

template <typename T> __device__ __forceinline__ float tof(T x);
template <> __device__ __forceinline__ float tof<float>(float x) { return x; }
template <> __device__ __forceinline__ float tof<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float tof<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half fromf<__half>(float x) { return __float2half(x); }
template <typename T> __device__ __forceinline__ float rnd(float x) { return tof<T>(fromf<T>(x)); }

// 16 bytes of T as floats
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };
template <typename T> __device__ __forceinline__ void unpack(const uint4& u, float* f) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) f[i] = tof<T>(e[i]);
}

__device__ __forceinline__ uint4 ld_cg(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
template <typename T> __device__ __forceinline__ float ldcg_f(const T* p) { return tof<T>(__ldcg(p)); }
template <> __device__ __forceinline__ float ldcg_f<__nv_bfloat16>(const __nv_bfloat16* p) {
  unsigned short b = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return __uint_as_float(static_cast<unsigned>(b) << 16);
}
template <> __device__ __forceinline__ float ldcg_f<__half>(const __half* p) {
  unsigned short b = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return __half2float(__ushort_as_half(b));
}

__device__ __forceinline__ void cp16(void* smem, const void* g) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_wait(int younger) {
  if (younger <= 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
  else if (younger == 1) asm volatile("cp.async.wait_group 1;" ::: "memory");
  else if (younger == 2) asm volatile("cp.async.wait_group 2;" ::: "memory");
  else asm volatile("cp.async.wait_group 3;" ::: "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int64_t ld_idx(int64_t ptr, int64_t is64) {
  return is64 ? __ldcg(reinterpret_cast<const long long*>(ptr)) : __ldcg(reinterpret_cast<const int*>(ptr));
}

// ---- the grid barrier --------------------------------------------------------------------------------
__device__ __forceinline__ void arrive(unsigned* ctr) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
  }
}
__device__ __forceinline__ void wait_for(const unsigned* ctr, unsigned target) {
  if (threadIdx.x == 0) {
    // a barrier that is never met (a block not resident, a bug) traps after ~2 s instead of hanging
    const long long t0 = clock64();
    while (ld_acquire(ctr) < target) {
      if (clock64() - t0 > 4000000000LL) __trap();
    }
    __threadfence();
  }
  __syncthreads();
}

// ---- weight stages and the shared-memory ring ----------------------------------------------------------
// weight stage ws = 4 * layer + kind; a block's work is a run of units (a row, or for gu a gate/up pair)
enum Kind { K_QKV = 0, K_O = 1, K_GU = 2, K_DOWN = 3 };

struct Stage {
  const char* w;       // W [rows, k]
  int k;               // row length
  int pair_offset;     // gu: rows between a unit's gate row and its up row; 0: one row a unit
  int u0, n;           // this block's units
  int npre;            // of them, prefetched into the ring
  int bytes;           // of the prefetched part
};

__device__ __forceinline__ const char* lptr(const int64_t* lp, int field) {
  return reinterpret_cast<const char*>(__ldg(reinterpret_cast<const long long*>(lp) + field));
}

template <typename T>
__device__ Stage stage_of(const Args& a, int ws, int ring_bytes) {
  const int64_t* lp = reinterpret_cast<const int64_t*>(a.v[F_layers]) + (ws >> 2) * NUM_LAYER_FIELDS;
  const int H = a.v[F_hidden], D = a.v[F_head_dim], I = a.v[F_inter];
  const int Hq = a.v[F_heads], Hk = a.v[F_kv_heads];
  Stage s;
  int units;
  s.pair_offset = 0;
  switch (ws & 3) {
    case K_QKV: s.w = lptr(lp, L_QKV); s.k = H; units = (Hq + 2 * Hk) * D; break;
    case K_O: s.w = lptr(lp, L_O); s.k = Hq * D; units = H; break;
    case K_GU: s.w = lptr(lp, L_GATE_UP); s.k = H; units = I; s.pair_offset = I; break;
    default: s.w = lptr(lp, L_DOWN); s.k = I; units = H; break;
  }
  const int per = (units + gridDim.x - 1) / gridDim.x;
  s.u0 = min(units, (int)blockIdx.x * per);
  s.n = min(units, s.u0 + per) - s.u0;
  const int unit_bytes = (s.pair_offset ? 2 : 1) * s.k * (int)sizeof(T);
  s.npre = min(s.n, (ring_bytes / 2) / unit_bytes);
  s.bytes = s.npre * unit_bytes;
  return s;
}

// every thread holds the same copy of this state: allocations are decided identically everywhere
struct Ring {
  int bytes, head, used, live, next;  // next: the next weight stage to issue
  int off[RING_SLOTS], size[RING_SLOTS];
  int first;  // FIFO index of the oldest live slot
};

template <typename T>
__device__ void ring_issue(Ring& r, const Args& a, char* ring, int total_ws) {
  while (r.next < total_ws && r.live < RING_SLOTS - 1) {
    Stage s = stage_of<T>(a, r.next, r.bytes);
    int pad = (r.head + s.bytes > r.bytes) ? r.bytes - r.head : 0;
    if (r.used + pad + s.bytes > r.bytes) break;
    int off = pad ? 0 : r.head;
    char* dst = ring + off;
    const int row_bytes = s.k * (int)sizeof(T);
    const int chunks_per_unit = (s.pair_offset ? 2 : 1) * row_bytes / 16;
    const int total = s.npre * chunks_per_unit;
    for (int c = threadIdx.x; c < total; c += NT) {
      int u = c / chunks_per_unit, j = c - u * chunks_per_unit;
      int row = s.u0 + u, rc = row_bytes / 16;
      if (j >= rc) { row += s.pair_offset; j -= rc; }
      cp16(dst + (size_t)c * 16, s.w + (size_t)row * row_bytes + (size_t)j * 16);
    }
    cp_commit();
    int slot = (r.first + r.live) % RING_SLOTS;
    r.off[slot] = off;
    r.size[slot] = pad + s.bytes;
    r.head = off + s.bytes;
    r.used += pad + s.bytes;
    r.live++;
    r.next++;
  }
}

// the oldest live stage's rows, in shared memory: waits for its copies
__device__ char* ring_front(Ring& r, char* ring) {
  cp_wait(r.live - 1);
  __syncthreads();
  return ring + r.off[r.first];
}
__device__ void ring_pop(Ring& r) {
  __syncthreads();  // every thread is done reading the slot
  r.used -= r.size[r.first];
  r.first = (r.first + 1) % RING_SLOTS;
  r.live--;
  if (r.live == 0) r.head = 0, r.used = 0;
}

// one row of W (in shared memory or global) times vec, summed over the warp
template <typename T>
__device__ __forceinline__ float row_dot(const char* row, bool smem, const float* vec, int k, int lane) {
  constexpr int E = Vec<T>::N;
  float acc = 0.f;
#pragma unroll 4
  for (int i = lane * E; i < k; i += 32 * E) {
    uint4 u = smem ? *reinterpret_cast<const uint4*>(row + (size_t)i * sizeof(T)) : ld_stream(row + (size_t)i * sizeof(T));
    float w[E];
    unpack<T>(u, w);
#pragma unroll
    for (int e = 0; e < E; ++e) acc += w[e] * vec[i + e];
  }
  return warp_sum(acc);
}

// ---- the input rows of the projections -------------------------------------------------------------------
__device__ float block_sum(float x, float* red) {
  x = warp_sum(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = lane < NW ? red[lane] : 0.f;
  return warp_sum(t);
}

// vec = rms_norm(h, w) with h = a (+ b, rounded); h_out (where given) gets h
template <typename T>
__device__ void normed_row(const T* a, const T* b, T* h_out, const T* w, int k, float eps, float* vec,
                           float* red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < k; i += NT) {
    float h = ldcg_f(a + i);
    if (b) h = rnd<T>(h + ldcg_f(b + i));
    if (h_out) h_out[i] = fromf<T>(h);
    vec[i] = h;
    ss += h * h;
  }
  const float rstd = rsqrtf(block_sum(ss, red) / k + eps);
  for (int i = threadIdx.x; i < k; i += NT) vec[i] = rnd<T>(tof<T>(w[i]) * rnd<T>(vec[i] * rstd));
  __syncthreads();
}

template <typename T>
__device__ void plain_row(const T* a, int k, float* vec) {
  for (int i = threadIdx.x; i < k; i += NT) vec[i] = ldcg_f(a + i);
  __syncthreads();
}

// ---- attention ---------------------------------------------------------------------------------------------
// head row x [D] (rounded to T) RMS-normalised with w (if any) and rotated, by one warp into out[D]
template <typename T>
__device__ void rope_head(const T* x, const T* w, float eps, const float* cs, int half, int D, float* tmp,
                          float* out, int lane) {
  float ss = 0.f;
  for (int d = lane; d < D; d += 32) {
    float v = ldcg_f(x + d);
    tmp[d] = v;
    ss += v * v;
  }
  if (w) {
    const float rstd = rsqrtf(warp_sum(ss) / D + eps);
    for (int d = lane; d < D; d += 32) tmp[d] = rnd<T>(tof<T>(w[d]) * rnd<T>(tmp[d] * rstd));
  }
  __syncwarp();
  for (int d = lane; d < D; d += 32) {
    float v = tmp[d];
    if (d < 2 * half) {
      const int f = d < half ? d : d - half;
      const float c = cs[f], s = cs[half + f];
      v = d < half ? v * c - tmp[d + half] * s : v * c + tmp[d - half] * s;
    }
    out[d] = rnd<T>(v);
  }
  __syncwarp();
}

template <typename T, int LPK, int GM>
__device__ void attend(const Args& a, int layer, float* smem_f, float* red) {
  constexpr int E = Vec<T>::N;
  constexpr int KPW = 32 / LPK;
  const int D = a.v[F_head_dim], Hq = a.v[F_heads], Hk = a.v[F_kv_heads], S = a.v[F_splits];
  const int group = Hq / Hk;
  const int item = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned* head_ctr = reinterpret_cast<unsigned*>(a.v[F_counters]) + 2;
  if (item >= Hk * S) return;
  const int kvh = item / S, split = item - kvh * S;
  const int64_t i64 = a.v[F_idx64];
  const int seq = (int)ld_idx(a.v[F_seq_lens], i64 & 1);
  const int64_t pos = ld_idx(a.v[F_positions], i64 & 2);
  const int64_t row = ld_idx(a.v[F_table_idx], i64 & 4);
  const int chunk = (seq + S - 1) / S;
  const int start = split * chunk, end = min(start + chunk, seq);
  float* part_o = reinterpret_cast<float*>(a.v[F_part_o]);
  float* part_lse = reinterpret_cast<float*>(a.v[F_part_lse]);
  T* attn = reinterpret_cast<T*>(a.v[F_attn]);
  const int64_t* lp = reinterpret_cast<const int64_t*>(a.v[F_layers]) + layer * NUM_LAYER_FIELDS;
  const float eps = a.eps;

  if (start < end) {
    const T* qkv = reinterpret_cast<const T*>(a.v[F_qkv]);
    const float* cs = reinterpret_cast<const float*>(a.v[F_cos_sin]) + pos * a.v[F_stride_cs];
    const int half = a.v[F_rot_half];
    float* qs = smem_f;                   // [group][D]
    float* tmp = smem_f + MAXG * D;       // [NW][D]
    char* kc = reinterpret_cast<char*>(a.v[F_k_cache]) + (size_t)layer * a.v[F_kv_layer_stride] * sizeof(T);
    char* vc = reinterpret_cast<char*>(a.v[F_v_cache]) + (size_t)layer * a.v[F_kv_layer_stride] * sizeof(T);
    const int64_t skt = a.v[F_stride_kt] * sizeof(T), skh = a.v[F_stride_kh] * sizeof(T);
    if (warp < group) {
      rope_head<T>(qkv + (kvh * group + warp) * D, (const T*)lp[L_Q_NORM], eps, cs, half, D, tmp + warp * D,
                   qs + warp * D, lane);
    } else if (warp == NW - 1 && end == seq) {  // this split holds the new key: rotate it, store it and v
      const int64_t slot = ld_idx(a.v[F_out_loc], i64 & 8);
      float* kn = tmp + warp * D;
      float* kr = qs + MAXG * D + NW * D;  // past tmp
      rope_head<T>(qkv + (Hq + kvh) * D, (const T*)lp[L_K_NORM], eps, cs, half, D, kn, kr, lane);
      T* kdst = reinterpret_cast<T*>(kc + slot * skt + kvh * skh);
      T* vdst = reinterpret_cast<T*>(vc + slot * skt + kvh * skh);
      const T* vsrc = qkv + (Hq + Hk + kvh) * D;
      for (int d = lane; d < D; d += 32) {
        kdst[d] = fromf<T>(kr[d]);
        vdst[d] = __ldcg(vsrc + d);
      }
      __threadfence_block();
    }
    __syncthreads();

    const int sub = lane / LPK, sl = lane % LPK;
    float q[GM][E], acc[GM][E], m[GM], l[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        q[g][e] = g < group ? qs[g * D + sl * E + e] * a.scale_log2 : 0.f;
        acc[g][e] = 0.f;
      }
    }
    const int* pt = reinterpret_cast<const int*>(a.v[F_page_table]) + row * a.v[F_stride_pt];
    const size_t dim_off = (size_t)kvh * skh + (size_t)sl * 16;
    // the loop bounds are the warp's (its shuffles need every lane): a sub-group past the end computes on
    // zeros and skips the update
    for (int t0 = start + warp * KPW; t0 < end; t0 += NW * KPW) {
      const int t = t0 + sub;
      const bool valid = t < end;
      float kf[E], vf[E];
      if (valid) {
        const int64_t slot = __ldcg(pt + t);
        unpack<T>(ld_cg(kc + slot * skt + dim_off), kf);
        unpack<T>(ld_cg(vc + slot * skt + dim_off), vf);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        if (g < group) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) s += q[g][e] * kf[e];
#pragma unroll
          for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
          if (valid) {
            const float mn = fmaxf(m[g], s);
            const float al = exp2f(m[g] - mn), p = exp2f(s - mn);
            l[g] = l[g] * al + p;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * al + p * vf[e];
            m[g] = mn;
          }
        }
      }
    }
    // the warp's sub-groups of lanes hold different keys of the same dims: merge them
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        if (g < group) {
          const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
          const float mn = fmaxf(m[g], mo);
          const float a0 = mn == -INFINITY ? 0.f : exp2f(m[g] - mn), a1 = mn == -INFINITY ? 0.f : exp2f(mo - mn);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
            acc[g][e] = acc[g][e] * a0 + ao * a1;
          }
          l[g] = l[g] * a0 + lo * a1;
          m[g] = mn;
        }
      }
    }
    // then the warps, through shared memory: [warp][g] (m, l) and [warp][g][D] acc
    float* wm = tmp;                  // reuses tmp: [NW][MAXG] m, then l, then acc
    float* wl = wm + NW * MAXG;
    float* wacc = wl + NW * MAXG;
    __syncthreads();
    if (sub == 0) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        if (g < group) {
          if (sl == 0) wm[warp * MAXG + g] = m[g], wl[warp * MAXG + g] = l[g];
#pragma unroll
          for (int e = 0; e < E; ++e) wacc[(warp * group + g) * D + sl * E + e] = acc[g][e];
        }
      }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < group * D; t += NT) {
      const int g = t / D, d = t - g * D;
      float mx = -INFINITY;
      for (int w = 0; w < NW; ++w) mx = fmaxf(mx, wm[w * MAXG + g]);
      float tot = 0.f, o = 0.f;
      for (int w = 0; w < NW; ++w) {
        const float lw = wl[w * MAXG + g];
        if (lw > 0.f) {
          const float f = exp2f(wm[w * MAXG + g] - mx);
          tot += lw * f;
          o += wacc[(w * group + g) * D + d] * f;
        }
      }
      const int head = kvh * group + g;
      part_o[((size_t)head * S + split) * D + d] = o / tot;
      if (d == 0) part_lse[head * S + split] = mx + log2f(tot);
    }
  } else {
    for (int g = threadIdx.x; g < group; g += NT) part_lse[(kvh * group + g) * S + split] = -INFINITY;
  }
  // the last split of this KV head to finish merges the group's splits
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned old = atomicAdd(head_ctr + kvh, 1u);
    red[NW] = old == (unsigned)(S * (layer + 1) - 1) ? 1.f : 0.f;
  }
  __syncthreads();
  if (red[NW] == 0.f) return;
  __threadfence();
  for (int t = threadIdx.x; t < group * D; t += NT) {
    const int g = t / D, d = t - g * D, head = kvh * group + g;
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, __ldcg(part_lse + head * S + s));
    float tot = 0.f, o = 0.f;
    for (int s = 0; s < S; ++s) {
      const float ls = __ldcg(part_lse + head * S + s);
      if (ls != -INFINITY) {
        const float f = exp2f(ls - mx);
        tot += f;
        o += f * __ldcg(part_o + ((size_t)head * S + s) * D + d);
      }
    }
    attn[head * D + d] = fromf<T>(o / tot);
  }
}

// ---- the kernel -------------------------------------------------------------------------------------------
template <typename T, int LPK, int GM>
__global__ void __launch_bounds__(NT, 1) decode_step_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) char smem[];
  const int L = a.v[F_num_layers], H = a.v[F_hidden], I = a.v[F_inter];
  const int Hq = a.v[F_heads], D = a.v[F_head_dim];
  const int ring_bytes = a.v[F_ring_bytes];
  char* ring = smem;
  float* vec = reinterpret_cast<float*>(smem + ring_bytes);
  float* scratch = vec + a.v[F_vec_floats];
  float* red = scratch + a.v[F_scratch_floats];  // NW + 1 floats
  unsigned* ctr = reinterpret_cast<unsigned*>(a.v[F_counters]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* h = reinterpret_cast<T*>(a.v[F_h]);
  T* h2 = reinterpret_cast<T*>(a.v[F_h2]);
  T* y = reinterpret_cast<T*>(a.v[F_y]);
  T* qkv = reinterpret_cast<T*>(a.v[F_qkv]);
  T* act = reinterpret_cast<T*>(a.v[F_act]);
  const int total_ws = 4 * L;
  Ring r{ring_bytes, 0, 0, 0, 0, {0}, {0}, 0};
  unsigned barriers = 0;

  for (int layer = 0; layer < L; ++layer) {
    const int64_t* lp = reinterpret_cast<const int64_t*>(a.v[F_layers]) + layer * NUM_LAYER_FIELDS;
    // qkv
    ring_issue<T>(r, a, ring, total_ws);
    wait_for(ctr, barriers * gridDim.x);
    if (layer == 0) {
      normed_row<T>(reinterpret_cast<const T*>(a.v[F_x_in]), nullptr, nullptr, (const T*)lp[L_IN_NORM], H, a.eps,
                    vec, red);
    } else {
      normed_row<T>(y, h2, blockIdx.x == 0 ? h : nullptr, (const T*)lp[L_IN_NORM], H, a.eps, vec, red);
    }
    {
      Stage s = stage_of<T>(a, 4 * layer + K_QKV, ring_bytes);
      const char* sm = ring_front(r, ring);
      const T* bias = (const T*)lp[L_QKV_BIAS];
      for (int u = warp; u < s.n; u += NW) {
        const bool pre = u < s.npre;
        const char* rowp = pre ? sm + (size_t)u * s.k * sizeof(T) : s.w + (size_t)(s.u0 + u) * s.k * sizeof(T);
        float v = row_dot<T>(rowp, pre, vec, s.k, lane);
        if (lane == 0) {
          if (bias) v += tof<T>(bias[s.u0 + u]);
          qkv[s.u0 + u] = fromf<T>(v);
        }
      }
      ring_pop(r);
    }
    arrive(ctr);
    ++barriers;
    // attention
    ring_issue<T>(r, a, ring, total_ws);
    wait_for(ctr, barriers * gridDim.x);
    attend<T, LPK, GM>(a, layer, scratch, red);
    arrive(ctr);
    ++barriers;
    // o
    ring_issue<T>(r, a, ring, total_ws);
    wait_for(ctr, barriers * gridDim.x);
    plain_row<T>(reinterpret_cast<const T*>(a.v[F_attn]), Hq * D, vec);
    {
      const T* hin = layer == 0 ? reinterpret_cast<const T*>(a.v[F_x_in]) : h;
      Stage s = stage_of<T>(a, 4 * layer + K_O, ring_bytes);
      const char* sm = ring_front(r, ring);
      for (int u = warp; u < s.n; u += NW) {
        const bool pre = u < s.npre;
        const char* rowp = pre ? sm + (size_t)u * s.k * sizeof(T) : s.w + (size_t)(s.u0 + u) * s.k * sizeof(T);
        float v = row_dot<T>(rowp, pre, vec, s.k, lane);
        if (lane == 0) h2[s.u0 + u] = fromf<T>(rnd<T>(v) + ldcg_f(hin + s.u0 + u));
      }
      ring_pop(r);
    }
    arrive(ctr);
    ++barriers;
    // gate / up
    ring_issue<T>(r, a, ring, total_ws);
    wait_for(ctr, barriers * gridDim.x);
    normed_row<T>(h2, nullptr, nullptr, (const T*)lp[L_POST_NORM], H, a.eps, vec, red);
    {
      Stage s = stage_of<T>(a, 4 * layer + K_GU, ring_bytes);
      const char* sm = ring_front(r, ring);
      const size_t row_bytes = (size_t)s.k * sizeof(T);
      for (int u = warp; u < s.n; u += NW) {
        const bool pre = u < s.npre;
        const char* gp = pre ? sm + 2 * u * row_bytes : s.w + (size_t)(s.u0 + u) * row_bytes;
        const char* up = pre ? gp + row_bytes : s.w + (size_t)(s.u0 + u + I) * row_bytes;
        const float g = rnd<T>(row_dot<T>(gp, pre, vec, s.k, lane));
        const float uv = rnd<T>(row_dot<T>(up, pre, vec, s.k, lane));
        if (lane == 0) act[s.u0 + u] = fromf<T>(rnd<T>(g / (1.f + __expf(-g))) * uv);
      }
      ring_pop(r);
    }
    arrive(ctr);
    ++barriers;
    // down
    ring_issue<T>(r, a, ring, total_ws);
    wait_for(ctr, barriers * gridDim.x);
    plain_row<T>(act, I, vec);
    {
      Stage s = stage_of<T>(a, 4 * layer + K_DOWN, ring_bytes);
      const char* sm = ring_front(r, ring);
      for (int u = warp; u < s.n; u += NW) {
        const bool pre = u < s.npre;
        const char* rowp = pre ? sm + (size_t)u * s.k * sizeof(T) : s.w + (size_t)(s.u0 + u) * s.k * sizeof(T);
        float v = row_dot<T>(rowp, pre, vec, s.k, lane);
        if (lane == 0) y[s.u0 + u] = fromf<T>(v);
      }
      ring_pop(r);
    }
    if (layer + 1 < L) {
      arrive(ctr);
      ++barriers;
    }
  }
  // the last block out resets the counters for the next launch (every block is past its last wait)
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
      const int Hk = a.v[F_kv_heads];
      ctr[0] = 0;
      ctr[1] = 0;
      for (int i = 0; i < Hk; ++i) ctr[2 + i] = 0;
      __threadfence();
    }
  }
}

template <typename T, int LPK, int GM>
cudaError_t launch_t(const Args& a, int grid, int smem, cudaStream_t stream) {
  auto k = decode_step_kernel<T, LPK, GM>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  k<<<grid, NT, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int LPK>
cudaError_t launch_g(const Args& a, int grid, int smem, cudaStream_t stream) {
  const int group = (int)(a.v[F_heads] / a.v[F_kv_heads]);
  if (group <= 2) return launch_t<T, LPK, 2>(a, grid, smem, stream);
  if (group <= 4) return launch_t<T, LPK, 4>(a, grid, smem, stream);
  if (group <= MAXG) return launch_t<T, LPK, MAXG>(a, grid, smem, stream);
  return cudaErrorInvalidValue;
}

// head_dim 64 or 128
template <typename T>
cudaError_t launch_d(const Args& a, int grid, int smem, cudaStream_t stream) {
  const int lpk = (int)(a.v[F_head_dim] / Vec<T>::N);
  if (lpk == 64 / Vec<T>::N) return launch_g<T, 64 / Vec<T>::N>(a, grid, smem, stream);
  if (lpk == 128 / Vec<T>::N) return launch_g<T, 128 / Vec<T>::N>(a, grid, smem, stream);
  return cudaErrorInvalidValue;
}

template <typename T, int LPK>
cudaError_t prepare_g(int smem) {
  cudaError_t e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, MAXG>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return e;
}

}  // namespace

extern "C" {
// loads every instance and allows it smem bytes of shared memory: done before any CUDA-graph capture, so
// no module loads inside one
int minisgl_step_prepare(int smem) {
  cudaError_t e = prepare_g<__nv_bfloat16, 8>(smem);
  if (e == cudaSuccess) e = prepare_g<__nv_bfloat16, 16>(smem);
  if (e == cudaSuccess) e = prepare_g<float, 16>(smem);
  if (e == cudaSuccess) e = prepare_g<float, 32>(smem);
  return (int)e;
}

const char* minisgl_step_fields() { return kFieldNames; }
int minisgl_step_threads() { return NT; }
int minisgl_step_max_group() { return MAXG; }

// dtype: 0 float32, 1 bfloat16
int minisgl_decode_step(const int64_t* fields, float eps, float scale_log2, int dtype, int grid, int smem,
                        void* stream) {
  Args a;
  for (int i = 0; i < NUM_FIELDS; ++i) a.v[i] = fields[i];
  a.eps = eps;
  a.scale_log2 = scale_log2;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t e;
  if (dtype == 1) e = launch_d<__nv_bfloat16>(a, grid, smem, s);
  else if (dtype == 0) e = launch_d<float>(a, grid, smem, s);
  else e = cudaErrorInvalidValue;
  return (int)e;
}

const char* minisgl_step_error(int code) { return cudaGetErrorString((cudaError_t)code); }
}
