// The decode step of one request as one persistent kernel: every decoder layer of a dense Llama-family
// model (pre-norm RMSNorm, QKV with an optional bias, Qwen3's q/k norm, neox rotary, paged attention,
// the output projection, a SiLU-gated MLP), from the embedding row to the last layer's (MLP output,
// residual). kernel/step_kernel.py builds it with nvcc, packs its arguments and launches it.
//
// One block per SM, all resident. A layer is five stages, each split over every block:
//   qkv   h = y + h2 (x on the first layer), rms_norm(h), this block's QKV rows
//   attn  (KV head, split) work items: q/k norm + rotary, the new K/V stored, a split of the keys; split 0
//         of each KV head merges the head group's splits
//   o     the output projection's rows, h2 = o + h
//   gu    rms_norm(h2), gate and up rows in pairs, silu(gate) * up
//   down  the down projection's rows: y
// No grid barrier: a stage's outputs are written as tagged words (the value in the high half, the tag of
// this launch's layer in the low half, one store each) and a consumer spins on its inputs' words until every
// tag is the layer's. A word is stored and read whole, so a reader that sees the tag sees the value: no
// fence, no counter, and a stage starts the moment the words it reads are there. Every block takes part in
// every projection stage, so each buffer's next write depends (through the layer's chain) on every reader
// of its last write having read it.
//
// Weights never depend on the step, so each block's last warp does nothing but copy the block's rows of
// the next weight stages into a ring of shared memory (bulk copies on mbarriers) as soon as the ring has
// room: the weight stream runs while the other fifteen warps wait for their inputs, compute and attend. Rows past 3/5 of the
// ring are read from global memory at compute time. Attention loads its first keys from the KV
// cache (written by earlier steps) before its q arrives.
//
// The roundings are the layer kernels' (kernel/reference.py): each projection's output, the residual
// adds, the normalised row before the norm weight, silu before the multiply, the merged attention output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int NT = 512;
constexpr int NW = NT / 32;
constexpr int CT = NT - 32;   // the compute threads: every warp but the last, which issues the weight copies
constexpr int CW = CT / 32;
constexpr int MAXG = 8;        // query heads per KV head, at most
constexpr int MAXS = NW;       // KV splits, at most
constexpr int RING_SLOTS = 4;
constexpr int PRE_ROUNDS = 2;  // rounds of keys loaded before q arrives
constexpr int STAGES = 5;      // trace: stages a layer
constexpr int POINTS = 5;      // trace: clock readings a stage

// STEP_NO_GEMV (a measurement: wrong outputs): the projections' dot products left out
#ifndef STEP_NO_GEMV
#define STEP_NO_GEMV 0
#endif

// The argument block: one int64 each, in this order (FIELDS is checked against step_kernel.py's list).
#define STEP_FIELDS(X)                                                                                     \
  X(layers) X(num_layers) X(hidden) X(heads) X(kv_heads) X(head_dim) X(inter) X(rot_half) X(splits)       \
  X(x_in) X(h2) X(y) X(w_qkv) X(w_attn) X(w_h2) X(w_act) X(w_y) X(part_o) X(part_lse) X(k_cache)         \
  X(v_cache) X(kv_layer_stride) X(stride_kt) X(stride_kh) X(page_table) X(stride_pt) X(table_idx)        \
  X(seq_lens) X(out_loc) X(positions) X(idx64) X(cos_sin) X(stride_cs) X(counters) X(ring_bytes)         \
  X(vec_elems) X(scratch_floats) X(trace)
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
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
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

__device__ __forceinline__ unsigned saddr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// ---- bulk copies into shared memory (the copy engine), completed on an mbarrier --------------------------
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(saddr(p)));
  return r;
}
// 16 bytes global -> shared, waited for by the issuing thread with cp_wait_all (then a block barrier)
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// bytes (a multiple of 16) of a row into shared memory, by the whole block
__device__ __forceinline__ void stage_row(void* dst, const void* src, int bytes) {
  for (int c = threadIdx.x; c < bytes / 16; c += CT) cp16((char*)dst + c * 16, (const char*)src + c * 16);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(bar)), "r"(count) : "memory");
}
// one arrival (this thread's) that also expects `bytes` of copies on the barrier's current phase
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}" ::"r"(saddr(bar)), "r"(parity) : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into shared memory
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory");
}

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// a barrier of the compute warps (the copy warp never joins one)
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"n"(CT) : "memory"); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int64_t ld_idx(int64_t ptr, int64_t is64) {
  return is64 ? __ldcg(reinterpret_cast<const long long*>(ptr)) : __ldcg(reinterpret_cast<const int*>(ptr));
}

// ---- tagged words ------------------------------------------------------------------------------------------
// bf16: a 32-bit word, the value's bits high, a 16-bit tag low; float: a 64-bit word, the value high, a
// 32-bit tag low. Tags of consecutive writes of a word differ by one (mod 2^16), so a stale word never
// carries the tag a reader waits for.
template <typename T> struct Word;
template <> struct Word<__nv_bfloat16> {
  using W = unsigned;
  static constexpr int PER = 4;  // words a 16-byte load
};
template <> struct Word<float> {
  using W = unsigned long long;
  static constexpr int PER = 2;
};
using FWord = unsigned long long;  // float32 values of any model (the attention splits)

__device__ __forceinline__ void st_word(unsigned* p, __nv_bfloat16 v, unsigned tag) {
  const unsigned w = (static_cast<unsigned>(__bfloat16_as_ushort(v)) << 16) | (tag & 0xffffu);
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}
__device__ __forceinline__ void st_word(unsigned long long* p, float v, unsigned tag) {
  const unsigned long long w = (static_cast<unsigned long long>(__float_as_uint(v)) << 32) | tag;
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

// a word that is never written (a block not resident, a bug) traps after ~2 s instead of hanging
__device__ __forceinline__ void spin(long long& t0) {
  if (t0 == 0) t0 = clock64();
  else if (clock64() - t0 > 4000000000LL) __trap();
  __nanosleep(32);
}

// 16 bytes of words once every tag is `tag`: their values
__device__ __forceinline__ void ld_words(const unsigned* p, unsigned tag, float* out) {
  uint4 u;
  long long t0 = 0;
  tag &= 0xffffu;
  for (;;) {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p) : "memory");
    if ((u.x & 0xffffu) == tag && (u.y & 0xffffu) == tag && (u.z & 0xffffu) == tag && (u.w & 0xffffu) == tag) break;
    spin(t0);
  }
  out[0] = __uint_as_float(u.x & 0xffff0000u);
  out[1] = __uint_as_float(u.y & 0xffff0000u);
  out[2] = __uint_as_float(u.z & 0xffff0000u);
  out[3] = __uint_as_float(u.w & 0xffff0000u);
}
__device__ __forceinline__ void ld_words(const unsigned long long* p, unsigned tag, float* out) {
  unsigned long long x, y;
  long long t0 = 0;
  for (;;) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];" : "=l"(x), "=l"(y) : "l"(p) : "memory");
    if (static_cast<unsigned>(x) == tag && static_cast<unsigned>(y) == tag) break;
    spin(t0);
  }
  out[0] = __uint_as_float(static_cast<unsigned>(x >> 32));
  out[1] = __uint_as_float(static_cast<unsigned>(y >> 32));
}
__device__ __forceinline__ float ld_word(const unsigned long long* p, unsigned tag) {
  unsigned long long x;
  long long t0 = 0;
  for (;;) {
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(x) : "l"(p) : "memory");
    if (static_cast<unsigned>(x) == tag) break;
    spin(t0);
  }
  return __uint_as_float(static_cast<unsigned>(x >> 32));
}

__device__ __forceinline__ bool word_ready(const unsigned* p, unsigned tag) {
  unsigned x;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
  return (x & 0xffffu) == (tag & 0xffffu);
}
__device__ __forceinline__ bool word_ready(const unsigned long long* p, unsigned tag) {
  unsigned long long x;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(x) : "l"(p) : "memory");
  return static_cast<unsigned>(x) == tag;
}

// STEP_GATE: before a block reads n words, one warp polls 32 of them spread over the buffer until all are
// tagged, so the block's other threads do not poll while the producers are still working
#ifndef STEP_GATE
#define STEP_GATE 0
#endif
template <typename W>
__device__ __forceinline__ void gate(const W* src, int n, unsigned tag) {
  if (!STEP_GATE) return;
  if (threadIdx.x < 32) {
    const int i = (int)(((long long)(threadIdx.x + 1) * n) / 32) - 1;
    long long t0 = 0;
    for (;;) {
      const bool ok = i < 0 || word_ready(src + i, tag);
      if (__all_sync(0xffffffffu, ok)) break;
      spin(t0);
    }
  }
  csync();
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
  return reinterpret_cast<const char*>(lp[field]);
}

// tab: the layers' pointer table, copied into shared memory at the start
template <typename T>
__device__ Stage stage_of(const Args& a, const int64_t* tab, int ws, int ring_bytes) {
  const int64_t* lp = tab + (ws >> 2) * NUM_LAYER_FIELDS;
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
  // balanced: every block gets at least one unit (step_kernel.py keeps the grid <= every stage's units)
  s.u0 = (int)blockIdx.x * units / (int)gridDim.x;
  s.n = ((int)blockIdx.x + 1) * units / (int)gridDim.x - s.u0;
  const int unit_bytes = (s.pair_offset ? 2 : 1) * s.k * (int)sizeof(T);
  s.npre = min(s.n, (ring_bytes / 5 * 3) / unit_bytes);  // any stage fits the ring once it is empty
  s.bytes = s.npre * unit_bytes;
  return s;
}

// The ring: weight stage ws lives in slot ws % RING_SLOTS, at an offset the copy warp chose (slot_off). The
// copy warp (one lane) issues the stages in order, each as one bulk copy per contiguous run of rows (a
// stage's rows are one run; gate/up's two, the gate rows then the up rows) completed on the slot's "full"
// mbarrier; it takes room back in order as the compute warps release stages on the slot's "empty" mbarrier
// (one arrival a warp). No compute warp ever waits for a copy to be issued.
struct Ring {
  uint64_t* full;
  uint64_t* empty;
  int* slot_off;
};

template <typename T>
__device__ void copy_weights(const Args& a, const int64_t* tab, char* ring, int ring_bytes, const Ring& r, int total_ws) {
  int head = 0, used = 0, rel = 0;  // rel: the oldest stage not yet released
  int size[RING_SLOTS];
  for (int ws = 0; ws < total_ws; ++ws) {
    const Stage s = stage_of<T>(a, tab, ws, ring_bytes);
    const int slot = ws % RING_SLOTS;
    for (;;) {
      const int pad = (head + s.bytes > ring_bytes) ? ring_bytes - head : 0;
      if (ws - rel < RING_SLOTS && used + pad + s.bytes <= ring_bytes) break;
      mbar_wait(r.empty + rel % RING_SLOTS, (rel / RING_SLOTS) & 1);
      used -= size[rel % RING_SLOTS];
      if (++rel == ws) head = 0, used = 0;
    }
    const int pad = (head + s.bytes > ring_bytes) ? ring_bytes - head : 0;
    const int off = pad ? 0 : head;
    r.slot_off[slot] = off;
    size[slot] = pad + s.bytes;
    head = off + s.bytes;
    used += pad + s.bytes;
    mbar_expect(r.full + slot, s.bytes);  // releases slot_off to the warps that wait on the slot
    if (s.bytes) {
      const size_t row_bytes = (size_t)s.k * sizeof(T);
      const unsigned run = (unsigned)(s.npre * row_bytes);
      bulk_copy(ring + off, s.w + s.u0 * row_bytes, run, r.full + slot);
      if (s.pair_offset) bulk_copy(ring + off + run, s.w + (s.u0 + s.pair_offset) * row_bytes, run, r.full + slot);
    }
  }
}

// stage ws's rows in shared memory: waits for its copies
__device__ __forceinline__ const char* ring_front(const Ring& r, const char* ring, int ws) {
  mbar_wait(r.full + ws % RING_SLOTS, (ws / RING_SLOTS) & 1);
  return ring + r.slot_off[ws % RING_SLOTS];
}
// this warp is done with stage ws's rows
__device__ __forceinline__ void ring_release(const Ring& r, int ws) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(r.empty + ws % RING_SLOTS)) : "memory");
  }
}

// one row of W (in shared memory or global) times vec (shared memory, T), summed over the warp: each lane
// reads 16 bytes of the row and 16 of vec, so neither read has bank conflicts
template <typename T>
__device__ __forceinline__ float row_dot(const char* row, bool smem, const T* vec, int k, int lane) {
  constexpr int E = Vec<T>::N;
  float acc = 0.f;
  if (STEP_NO_GEMV) k = 0;
#pragma unroll 4
  for (int i = lane * E; i < k; i += 32 * E) {
    const uint4 u = smem ? lds128(row + (size_t)i * sizeof(T)) : ld_stream(row + (size_t)i * sizeof(T));
    const uint4 xv = lds128(vec + i);
    float w[E], x[E];
    unpack<T>(u, w);
    unpack<T>(xv, x);
#pragma unroll
    for (int e = 0; e < E; ++e) acc += w[e] * x[e];
  }
  return warp_sum(acc);
}

// two rows at once (two sums in flight, vec read once for both)
template <typename T>
__device__ __forceinline__ void row_dot2(const char* r0, bool s0, const char* r1, bool s1, const T* vec, int k,
                                         int lane, float& o0, float& o1) {
  constexpr int E = Vec<T>::N;
  float a0 = 0.f, a1 = 0.f;
  if (STEP_NO_GEMV) k = 0;
#pragma unroll 4
  for (int i = lane * E; i < k; i += 32 * E) {
    const size_t b = (size_t)i * sizeof(T);
    const uint4 u0 = s0 ? lds128(r0 + b) : ld_stream(r0 + b);
    const uint4 u1 = s1 ? lds128(r1 + b) : ld_stream(r1 + b);
    const uint4 xv = lds128(vec + i);
    float x[E], w0[E], w1[E];
    unpack<T>(xv, x);
    unpack<T>(u0, w0);
    unpack<T>(u1, w1);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      a0 += w0[e] * x[e];
      a1 += w1[e] * x[e];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a0 += __shfl_xor_sync(0xffffffffu, a0, o);
    a1 += __shfl_xor_sync(0xffffffffu, a1, o);
  }
  o0 = a0;
  o1 = a1;
}

// this block's rows of a plain stage times vec, two rows a warp at a time: out(u, value) on lane 0 (u from 0)
template <typename T, typename F>
__device__ __forceinline__ void stage_rows(const Stage& s, const char* sm, const T* vec, F&& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t rb = (size_t)s.k * sizeof(T);
  for (int u = warp; u < s.n; u += 2 * CW) {
    const int u2 = u + CW;
    const bool p0 = u < s.npre, p1 = u2 < s.npre;
    const char* r0 = p0 ? sm + u * rb : s.w + (s.u0 + u) * rb;
    if (u2 < s.n) {
      const char* r1 = p1 ? sm + u2 * rb : s.w + (s.u0 + u2) * rb;
      float v0, v1;
      row_dot2<T>(r0, p0, r1, p1, vec, s.k, lane, v0, v1);
      if (lane == 0) out(u, v0), out(u2, v1);
    } else {
      const float v0 = row_dot<T>(r0, p0, vec, s.k, lane);
      if (lane == 0) out(u, v0);
    }
  }
}

// ---- the input rows of the projections -------------------------------------------------------------------
__device__ float block_sum(float x, float* red) {
  x = warp_sum(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  csync();
  if (lane == 0) red[warp] = x;
  csync();
  float t = lane < CW ? red[lane] : 0.f;
  return warp_sum(t);
}

// dst[:n] = the words' values once tagged `tag` (optionally + add[:n], rounded); returns the sum of squares
template <typename T>
__device__ float gather_words(const typename Word<T>::W* src, int n, unsigned tag, const T* add, T* dst) {
  constexpr int P = Word<T>::PER;
  gate(src, n, tag);
  float ss = 0.f;
  for (int c = threadIdx.x; c < n / P; c += CT) {
    float f[P];
    ld_words(src + c * P, tag, f);
#pragma unroll
    for (int e = 0; e < P; ++e) {
      float v = f[e];
      if (add) v = rnd<T>(v + tof<T>(add[c * P + e]));
      dst[c * P + e] = fromf<T>(v);
      ss += v * v;
    }
  }
  return ss;
}

// vec = rms_norm(row, w) for row [k] in shared memory, whose sum of squares this thread's part gave ss; w in
// shared memory, staged by this block's cp16s (waited for here)
template <typename T>
__device__ void norm_into(const T* row, float ss, const T* w, int k, float eps, T* vec, float* red) {
  cp_wait_all();
  const float rstd = rsqrtf(block_sum(ss, red) / k + eps);
  for (int i = threadIdx.x; i < k; i += CT) vec[i] = fromf<T>(rnd<T>(tof<T>(w[i]) * rnd<T>(tof<T>(row[i]) * rstd)));
  csync();
}

// ---- attention ---------------------------------------------------------------------------------------------
// head row x [D] (shared memory, values of T) RMS-normalised with w (if any) and rotated, by one warp into
// out[D] (rounded to T)
template <typename T>
__device__ void rope_head(const float* x, const T* w, float eps, const float* cs, int half, int D, float* tmp,
                          float* out, int lane) {
  float ss = 0.f;
  for (int d = lane; d < D; d += 32) {
    const float v = x[d];
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

// what a block's attention work item is, the same for every layer of a launch (read once at the start)
struct Ctx {
  int kvh, split;            // split < 0: no attention work
  int start, end, last;      // its keys [start, end); last: the new token's position
  int64_t row, slot_new;     // its page-table row; the new token's KV slot
  int pslot[PRE_ROUNDS];     // this lane's first keys' slots (-1: none or the new token)
  const float* cs;           // cos / sin of the position, in shared memory
};

// the attention scratch (floats), as step_kernel.py sizes it:
//   src [(group + 2) * D]  q heads, k, v of the KV head as read; qs [group * D] rotated q; knew [D];
//   tmp [(group + 1) * D]; then either the warps' partials (wm, wl [NW * MAXG], wacc [CW * group * D]) or
//   the merge's splits (mo [group * S * D], ml [group * S])
template <typename T, int LPK, int GM>
__device__ void attend(const Args& a, const Ctx& cx, const int64_t* lp, int layer, unsigned tag, float* sm,
                       T* nwt, long long* tr) {
  constexpr int E = Vec<T>::N;
  constexpr int KPW = 32 / LPK;
  using W = typename Word<T>::W;
  constexpr int P = Word<T>::PER;
  const int D = a.v[F_head_dim], Hq = a.v[F_heads], Hk = a.v[F_kv_heads], S = a.v[F_splits];
  const int group = Hq / Hk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (cx.split < 0) return;
  const int kvh = cx.kvh, split = cx.split;
  const int last = cx.last, start = cx.start, end = cx.end;
  FWord* part_o = reinterpret_cast<FWord*>(a.v[F_part_o]);
  FWord* part_lse = reinterpret_cast<FWord*>(a.v[F_part_lse]);
  char* kc = reinterpret_cast<char*>(a.v[F_k_cache]) + (size_t)layer * a.v[F_kv_layer_stride] * sizeof(T);
  char* vc = reinterpret_cast<char*>(a.v[F_v_cache]) + (size_t)layer * a.v[F_kv_layer_stride] * sizeof(T);
  const int64_t skt = a.v[F_stride_kt] * sizeof(T), skh = a.v[F_stride_kh] * sizeof(T);
  const int* pt = reinterpret_cast<const int*>(a.v[F_page_table]) + cx.row * a.v[F_stride_pt];
  const int sub = lane / LPK, sl = lane % LPK;
  const size_t dim_off = (size_t)kvh * skh + (size_t)sl * 16;

  float* src = sm;
  float* qs = src + (group + 2) * D;
  float* knew = qs + group * D;
  float* tmp = knew + D;
  float* wm = tmp + (group + 1) * D;
  float* wl = wm + NW * MAXG;
  float* wacc = wl + NW * MAXG;

  // the keys of the first rounds, from earlier steps, and the q / k norm weights: loaded before q arrives
  uint4 kp[PRE_ROUNDS], vp[PRE_ROUNDS];
#pragma unroll
  for (int r = 0; r < PRE_ROUNDS; ++r) {
    if (cx.pslot[r] >= 0) {
      kp[r] = ld_cg(kc + (int64_t)cx.pslot[r] * skt + dim_off);
      vp[r] = ld_cg(vc + (int64_t)cx.pslot[r] * skt + dim_off);
    } else {
      kp[r] = vp[r] = make_uint4(0, 0, 0, 0);
    }
  }
  const T* qn = (const T*)lp[L_Q_NORM];
  const T* kn = (const T*)lp[L_K_NORM];
  if (start < end) {
    if (qn) stage_row(nwt, qn, D * (int)sizeof(T));
    if (kn) stage_row(nwt + D, kn, D * (int)sizeof(T));
  }

  // this KV head's q heads, k and v (an empty split reads none)
  if (start < end) {
    const W* qkv = reinterpret_cast<const W*>(a.v[F_w_qkv]);
    gate(qkv + kvh * group * D, group * D, tag);
    const int nq = group * D / P, nk = D / P;
    for (int c = threadIdx.x; c < nq + 2 * nk; c += CT) {
      int off;
      if (c < nq) off = kvh * group * D + c * P;
      else if (c < nq + nk) off = (Hq + kvh) * D + (c - nq) * P;
      else off = (Hq + Hk + kvh) * D + (c - nq - nk) * P;
      ld_words(qkv + off, tag, src + c * P);
    }
  }
  cp_wait_all();
  csync();
  if (start < end) {
    const float* cs = cx.cs;
    const int half = a.v[F_rot_half];
    if (warp < group) {
      rope_head<T>(src + warp * D, qn ? nwt : nullptr, a.eps, cs, half, D, tmp + warp * D, qs + warp * D, lane);
    } else if (warp == CW - 1 && end == last + 1) {  // this split holds the new key: rotate it, store it and v
      const int64_t slot = cx.slot_new;
      rope_head<T>(src + group * D, kn ? nwt + D : nullptr, a.eps, cs, half, D, tmp + group * D, knew, lane);
      T* kdst = reinterpret_cast<T*>(kc + slot * skt + kvh * skh);
      T* vdst = reinterpret_cast<T*>(vc + slot * skt + kvh * skh);
      for (int d = lane; d < D; d += 32) {
        kdst[d] = fromf<T>(knew[d]);
        vdst[d] = fromf<T>(src[(group + 1) * D + d]);
      }
    }
  }
  csync();
  if (tr && threadIdx.x == 0) tr[2] = clock64();

  if (start < end) {
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
    // one key a sub-group of lanes; the loop bounds are the warp's (its shuffles need every lane): a
    // sub-group past the end computes on zeros and skips the update
    auto key = [&](int t, const uint4& ku, const uint4& vu) {
      const bool valid = t < end;
      float kf[E], vf[E];
      if (t == last) {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[e] = knew[sl * E + e], vf[e] = src[(group + 1) * D + sl * E + e];
      } else {
        unpack<T>(ku, kf);
        unpack<T>(vu, vf);
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
    };
#pragma unroll
    for (int r = 0; r < PRE_ROUNDS; ++r) {
      const int t0 = start + (r * CW + warp) * KPW;
      if (t0 < end) key(t0 + sub, kp[r], vp[r]);
    }
    for (int t0 = start + (PRE_ROUNDS * CW + warp) * KPW; t0 < end; t0 += CW * KPW) {
      const int t = t0 + sub;
      uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
      if (t < end && t != last) {
        const int64_t slot = __ldcg(pt + t);
        ku = ld_cg(kc + slot * skt + dim_off);
        vu = ld_cg(vc + slot * skt + dim_off);
      }
      key(t, ku, vu);
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
    csync();
    for (int t = threadIdx.x; t < group * D; t += CT) {
      const int g = t / D, d = t - g * D;
      float mx = -INFINITY;
      for (int w = 0; w < CW; ++w) mx = fmaxf(mx, wm[w * MAXG + g]);
      float tot = 0.f, o = 0.f;
      for (int w = 0; w < CW; ++w) {
        const float lw = wl[w * MAXG + g];
        if (lw > 0.f) {
          const float f = exp2f(wm[w * MAXG + g] - mx);
          tot += lw * f;
          o += wacc[(w * group + g) * D + d] * f;
        }
      }
      const int head = kvh * group + g;
      st_word(part_o + ((size_t)head * S + split) * D + d, o / tot, tag);
      if (d == 0) st_word(part_lse + head * S + split, mx + log2f(tot), tag);
    }
  } else {  // an empty split: zeros, and a log-sum of -inf
    for (int t = threadIdx.x; t < group * D; t += CT) {
      const int g = t / D, d = t - g * D, head = kvh * group + g;
      st_word(part_o + ((size_t)head * S + split) * D + d, 0.f, tag);
      if (d == 0) st_word(part_lse + head * S + split, -INFINITY, tag);
    }
  }
  if (tr && threadIdx.x == 0) tr[3] = clock64();
  if (split != 0) return;

  // split 0 merges the group's splits: every split's words in one pass, then the weighted sum
  csync();  // wm.. is reused
  float* mo = wm;                   // [group][S][D]
  float* ml = mo + group * S * D;   // [group][S]
  const int nvo = group * S * D / 2;
  for (int c = threadIdx.x; c < nvo + group * S; c += CT) {
    if (c < nvo) {
      const int g = c / (S * D / 2), rest = c - g * (S * D / 2);
      ld_words(part_o + (size_t)(kvh * group + g) * S * D + rest * 2, tag, mo + c * 2);
    } else {
      const int j = c - nvo, g = j / S, s = j - g * S;
      ml[j] = ld_word(part_lse + (kvh * group + g) * S + s, tag);
    }
  }
  csync();
  W* attn = reinterpret_cast<W*>(a.v[F_w_attn]);
  for (int t = threadIdx.x; t < group * D; t += CT) {
    const int g = t / D, d = t - g * D;
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, ml[g * S + s]);
    float tot = 0.f, o = 0.f;
    for (int s = 0; s < S; ++s) {
      const float ls = ml[g * S + s];
      if (ls != -INFINITY) {
        const float f = exp2f(ls - mx);
        tot += f;
        o += f * mo[(g * S + s) * D + d];
      }
    }
    st_word(attn + (kvh * group + g) * D + d, fromf<T>(o / tot), tag);
  }
}

// ---- the kernel -------------------------------------------------------------------------------------------
template <typename T, int LPK, int GM>
__global__ void __launch_bounds__(NT, 1) decode_step_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) char smem[];
  using W = typename Word<T>::W;
  const int L = a.v[F_num_layers], H = a.v[F_hidden], I = a.v[F_inter];
  const int Hq = a.v[F_heads], D = a.v[F_head_dim];
  const int ring_bytes = a.v[F_ring_bytes];
  char* ring = smem;
  const int vec_elems = a.v[F_vec_elems];
  T* vec = reinterpret_cast<T*>(smem + ring_bytes);  // the projection's input row
  T* hs = vec + vec_elems;                           // h: this layer's residual into the attention
  T* h2s = hs + H;                                   // h2: its residual into the MLP
  T* nwt = h2s + H;                                  // [vec_elems] the next norm's weights
  int64_t* tab = reinterpret_cast<int64_t*>(nwt + vec_elems);  // the layers' pointer table
  const int tab_n = (L * NUM_LAYER_FIELDS + 1) / 2 * 2;
  float* cs = reinterpret_cast<float*>(tab + tab_n);  // [D] cos / sin of the position
  float* scratch = cs + D;
  float* red = scratch + a.v[F_scratch_floats];  // CW floats
  unsigned* ctr = reinterpret_cast<unsigned*>(a.v[F_counters]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* h2 = reinterpret_cast<T*>(a.v[F_h2]);
  T* y = reinterpret_cast<T*>(a.v[F_y]);
  W* w_qkv = reinterpret_cast<W*>(a.v[F_w_qkv]);
  const W* w_attn = reinterpret_cast<const W*>(a.v[F_w_attn]);
  W* w_h2 = reinterpret_cast<W*>(a.v[F_w_h2]);
  W* w_act = reinterpret_cast<W*>(a.v[F_w_act]);
  W* w_y = reinterpret_cast<W*>(a.v[F_w_y]);
  long long* trace = reinterpret_cast<long long*>(a.v[F_trace]);
  const int total_ws = 4 * L;
  __shared__ __align__(8) uint64_t full[RING_SLOTS], empty[RING_SLOTS];
  __shared__ int slot_off[RING_SLOTS];
  if (threadIdx.x == 0) {
    for (int i = 0; i < RING_SLOTS; ++i) mbar_init(full + i, 1), mbar_init(empty + i, CW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const Ring r{full, empty, slot_off};
  // what stays the same for every layer: the pointer table, the position's cos / sin, the attention item
  Ctx cx;
  {
    const int64_t i64 = a.v[F_idx64];
    const int seq = (int)ld_idx(a.v[F_seq_lens], i64 & 1);
    const int64_t pos = ld_idx(a.v[F_positions], i64 & 2);
    const int Hk = a.v[F_kv_heads], S = a.v[F_splits];
    const long long* lt = reinterpret_cast<const long long*>(a.v[F_layers]);
    for (int i = threadIdx.x; i < L * NUM_LAYER_FIELDS; i += NT) tab[i] = __ldg(lt + i);
    const float* csg = reinterpret_cast<const float*>(a.v[F_cos_sin]) + pos * a.v[F_stride_cs];
    for (int i = threadIdx.x; i < 2 * (int)a.v[F_rot_half]; i += NT) cs[i] = __ldg(csg + i);
    cx.cs = cs;
    cx.row = ld_idx(a.v[F_table_idx], i64 & 4);
    cx.slot_new = ld_idx(a.v[F_out_loc], i64 & 8);
    cx.last = seq - 1;
    const int item = blockIdx.x;
    cx.split = item < Hk * S ? item % S : -1;
    cx.kvh = item / S;
    const int chunk = (seq + S - 1) / S;
    cx.start = cx.split * chunk;
    cx.end = min(cx.start + chunk, seq);
    constexpr int KPW = 32 / LPK;
    const int* pt = reinterpret_cast<const int*>(a.v[F_page_table]) + cx.row * a.v[F_stride_pt];
#pragma unroll
    for (int rr = 0; rr < PRE_ROUNDS; ++rr) {
      const int t = cx.start + (rr * CW + warp) * KPW + lane / LPK;
      cx.pslot[rr] = cx.split >= 0 && t < cx.end && t != cx.last ? __ldcg(pt + t) : -1;
    }
  }
  __syncthreads();
  if (warp == CW) {  // the copy warp: one lane streams every weight stage into the ring, then leaves
    if (lane == 0) copy_weights<T>(a, tab, ring, ring_bytes, r, total_ws);
    return;
  }
  // this launch's tags: base + layer + 1, base advanced by L at the end of every launch
  unsigned base;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(base) : "l"(ctr) : "memory");
  // the trace's tail: per block (clock64, globaltimer) at the start and at the end, to convert cycles
  long long* tail = trace && threadIdx.x == 0 ? trace + (size_t)gridDim.x * L * STAGES * POINTS + blockIdx.x * 4 : nullptr;
  if (tail) tail[0] = clock64(), tail[1] = globaltimer();

  for (int layer = 0; layer < L; ++layer) {
    const int64_t* lp = tab + layer * NUM_LAYER_FIELDS;
    const unsigned tag = base + layer + 1;
    long long* tr = trace && threadIdx.x == 0 ? trace + ((size_t)blockIdx.x * L + layer) * STAGES * POINTS : nullptr;
#define MARK(stage, point) \
  if (tr) tr[(stage) * POINTS + (point)] = clock64()
    // qkv: h = y + h2 (x on the first layer), normalised into vec
    MARK(0, 0);
    MARK(0, 1);
    stage_row(nwt, (const T*)lp[L_IN_NORM], H * (int)sizeof(T));
    {
      float ss = 0.f;
      if (layer == 0) {
        constexpr int E = Vec<T>::N;
        const T* x = reinterpret_cast<const T*>(a.v[F_x_in]);
        for (int c = threadIdx.x; c < H / E; c += CT) {
          const uint4 u = ld_cg(x + c * E);
          *reinterpret_cast<uint4*>(hs + c * E) = u;
          float f[E];
          unpack<T>(u, f);
#pragma unroll
          for (int e = 0; e < E; ++e) ss += f[e] * f[e];
        }
      } else {
        ss = gather_words<T>(w_y, H, tag - 1, h2s, hs);
      }
      norm_into<T>(hs, ss, nwt, H, a.eps, vec, red);
    }
    MARK(0, 2);
    {
      Stage s = stage_of<T>(a, tab, 4 * layer + K_QKV, ring_bytes);
      const char* sm = ring_front(r, ring, 4 * layer + K_QKV);
      MARK(0, 3);
      const T* bias = (const T*)lp[L_QKV_BIAS];
      stage_rows<T>(s, sm, vec, [&](int u, float v) {
        if (bias) v += tof<T>(bias[s.u0 + u]);
        st_word(w_qkv + s.u0 + u, fromf<T>(v), tag);
      });
      ring_release(r, 4 * layer + K_QKV);
      csync();  // vec is rewritten next
    }
    MARK(0, 4);
    // attention
    MARK(1, 0);
    MARK(1, 1);
    attend<T, LPK, GM>(a, cx, lp, layer, tag, scratch, nwt, tr ? tr + 1 * POINTS : nullptr);
    csync();  // the scratch is free again
    MARK(1, 4);
    // o: h2 = o + h
    MARK(2, 0);
    MARK(2, 1);
    gather_words<T>(w_attn, Hq * D, tag, nullptr, vec);
    csync();
    MARK(2, 2);
    {
      Stage s = stage_of<T>(a, tab, 4 * layer + K_O, ring_bytes);
      const char* sm = ring_front(r, ring, 4 * layer + K_O);
      MARK(2, 3);
      stage_rows<T>(s, sm, vec, [&](int u, float v) {
        const T o = fromf<T>(rnd<T>(v) + tof<T>(hs[s.u0 + u]));
        st_word(w_h2 + s.u0 + u, o, tag);
        h2[s.u0 + u] = o;
      });
      ring_release(r, 4 * layer + K_O);
      csync();  // vec is rewritten next
    }
    MARK(2, 4);
    // gate / up: h2 gathered (kept for the next layer's residual) and normalised into vec
    MARK(3, 0);
    MARK(3, 1);
    stage_row(nwt, (const T*)lp[L_POST_NORM], H * (int)sizeof(T));
    {
      const float ss = gather_words<T>(w_h2, H, tag, nullptr, h2s);
      norm_into<T>(h2s, ss, nwt, H, a.eps, vec, red);
    }
    MARK(3, 2);
    {
      Stage s = stage_of<T>(a, tab, 4 * layer + K_GU, ring_bytes);
      const char* sm = ring_front(r, ring, 4 * layer + K_GU);
      MARK(3, 3);
      // the ring holds the gate rows, then the up rows
      const size_t row_bytes = (size_t)s.k * sizeof(T);
      for (int u = warp; u < s.n; u += CW) {
        const bool pre = u < s.npre;
        const char* gp = pre ? sm + u * row_bytes : s.w + (size_t)(s.u0 + u) * row_bytes;
        const char* up = pre ? sm + (s.npre + u) * row_bytes : s.w + (size_t)(s.u0 + u + I) * row_bytes;
        float g, uv;
        row_dot2<T>(gp, pre, up, pre, vec, s.k, lane, g, uv);
        g = rnd<T>(g);
        uv = rnd<T>(uv);
        if (lane == 0) st_word(w_act + s.u0 + u, fromf<T>(rnd<T>(g / (1.f + __expf(-g))) * uv), tag);
      }
      ring_release(r, 4 * layer + K_GU);
      csync();  // vec is rewritten next
    }
    MARK(3, 4);
    // down: y
    MARK(4, 0);
    MARK(4, 1);
    gather_words<T>(w_act, I, tag, nullptr, vec);
    csync();
    MARK(4, 2);
    {
      Stage s = stage_of<T>(a, tab, 4 * layer + K_DOWN, ring_bytes);
      const char* sm = ring_front(r, ring, 4 * layer + K_DOWN);
      MARK(4, 3);
      stage_rows<T>(s, sm, vec, [&](int u, float v) {
        const T o = fromf<T>(v);
        st_word(w_y + s.u0 + u, o, tag);
        y[s.u0 + u] = o;
      });
      ring_release(r, 4 * layer + K_DOWN);
      csync();  // vec is rewritten next
    }
    MARK(4, 4);
#undef MARK
  }
  if (tail) tail[2] = clock64(), tail[3] = globaltimer();
  // the last block out advances the tags' base for the next launch (every block has read it by then)
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
      ctr[1] = 0;
      ctr[0] = base + L;
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
int minisgl_step_max_splits() { return MAXS; }
int minisgl_step_trace_points() { return STAGES * POINTS; }

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
