// The decode step of a batch of one to eight requests as one persistent kernel: every decoder layer of a dense Llama-family
// model (pre-norm RMSNorm, QKV with an optional bias, Qwen3's q/k norm, neox rotary, paged attention,
// the output projection, a SiLU-gated MLP), from the embedding row to the last layer's (MLP output,
// residual). kernel/step_kernel.py builds it with nvcc, packs its arguments and launches it.
//
// One block per SM, all resident. A layer is five stages, each split over every block:
//   qkv   h = y + h2 (x on the first layer), rms_norm(h), this block's QKV rows
//   attn  (request, KV head, split) work items: q/k norm + rotary, the new K/V stored, a split of the keys;
//         split 0 of each (request, KV head) merges the head group's splits
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
// the next weight stages into a ring of shared memory, chunk by chunk (bulk copies, an mbarrier a chunk),
// wherever the ring has room: the weight stream runs while the other fifteen warps wait for their inputs,
// compute and attend, and a warp starts on its rows when their chunk is in. It keeps a few chunks in flight,
// not the whole ring, so the loads the step waits on do not queue behind the weights. Rows past 3/5 of the
// ring are read from global memory at compute time. Attention loads its first keys from the KV cache
// (written by earlier steps) before its q arrives, and asks L2 for the next layer's once it is done.
//
// A batch of requests shares the weight stream: a projection's rows are read once and each is dotted with
// every request's input row (the rows of a stage's words are [request][unit]); a request's attention items
// are its own.
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
constexpr int MAXB = 8;        // requests a launch, at most
constexpr int MAXS = NW;       // KV splits, at most
constexpr int RING_SLOTS = 4;
constexpr int PRE_ROUNDS = 2;  // rounds of keys loaded before q arrives
constexpr int STAGES = 5;      // trace: stages a layer
constexpr int POINTS = 5;      // trace: clock readings a stage

// STEP_NO_GEMV (a measurement: wrong outputs): the projections' dot products left out; likewise
// STEP_NO_KEYS, attention's key loop (2: the loop kept, its keys' loads left out), and STEP_NO_WMERGE, the
// merge of a split's warps
#ifndef STEP_NO_GEMV
#define STEP_NO_GEMV 0
#endif
#ifndef STEP_NO_KEYS
#define STEP_NO_KEYS 0
#endif
#ifndef STEP_NO_WMERGE
#define STEP_NO_WMERGE 0
#endif
// STEP_NO_STREAM (a measurement: wrong outputs): the copy warp completes each chunk's barrier without copying
// (the ring holds zeros), so the step runs at the pace of its dependencies alone; STEP_STREAM_ONLY: the
// compute warps only wait for each stage's chunks and release them, so the step runs at the weight stream's
// pace alone
#ifndef STEP_NO_STREAM
#define STEP_NO_STREAM 0
#endif
#ifndef STEP_STREAM_ONLY
#define STEP_STREAM_ONLY 0
#endif
// STEP_L2_AHEAD = A > 0: as the copy warp starts a weight stage it asks L2 for this block's rows of the stage
// A stages later (bulk prefetches: no shared memory, no barrier), so the ring's copies find them there
#ifndef STEP_L2_AHEAD
#define STEP_L2_AHEAD 0
#endif
// STEP_DOT_SUMS: independent sums a row keeps in a projection's dot product where a warp takes several
// rows (one row always keeps two): more shortens each chain of dependent FMAs
#ifndef STEP_DOT_SUMS
#define STEP_DOT_SUMS 1
#endif
// STEP_DOT_UNROLL: rounds of a dot product's loop whose loads are issued together (16 bytes a lane and row
// a round)
#ifndef STEP_DOT_UNROLL
#define STEP_DOT_UNROLL 2
#endif
constexpr int DOT_UNROLL = STEP_DOT_UNROLL;  // nvcc's unroll pragma takes a constant, not a macro
// The weight stream is copied in chunks of whole units of at most STEP_CHUNK bytes (one unit when a unit is
// larger), each completed on its own mbarrier, so a warp starts on its rows as soon as their chunk is in,
// and the copy warp keeps at most STEP_PACE chunks in flight (0: as many as the ring has room for): the
// memory's queues stay short, so the loads that the step waits on (keys, rows past the ring) are not
// queued behind the next layers' weights.
#ifndef STEP_CHUNK
#define STEP_CHUNK 8192
#endif
#ifndef STEP_PACE
#define STEP_PACE 2
#endif
// STEP_KV_L2: each attention item asks L2 for the next layer's keys and values of its split once it is
// done with this layer's, and the weight copies are marked evict-first
#ifndef STEP_KV_L2
#define STEP_KV_L2 1
#endif
// chunk mbarriers: a chunk is at least STEP_CHUNK / 2 bytes or one unit, so the ring's RING_SLOTS stages hold
// fewer chunks than this (227 KB of ring at most), and a barrier is never re-armed while a warp waits on it
constexpr int NCB = 2 * (232448 / STEP_CHUNK) + 2 * RING_SLOTS;

// The argument block: one int64 each, in this order (FIELDS is checked against step_kernel.py's list).
#define STEP_FIELDS(X)                                                                                     \
  X(layers) X(num_layers) X(hidden) X(heads) X(kv_heads) X(head_dim) X(inter) X(rot_half) X(splits)       \
  X(batch) X(x_in) X(h2) X(y) X(w_qkv) X(w_attn) X(w_h2) X(w_act) X(w_y) X(part_o) X(part_lse)           \
  X(k_cache) X(v_cache) X(kv_layer_stride) X(stride_kt) X(stride_kh) X(page_table) X(stride_pt)          \
  X(table_idx) X(seq_lens) X(out_loc) X(positions) X(idx64) X(cos_sin) X(stride_cs) X(counters)          \
  X(ring_bytes) X(vec_elems) X(scratch_floats) X(trace)
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
__device__ __forceinline__ bool mbar_try(uint64_t* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(done) : "r"(saddr(bar)), "r"(parity) : "memory");
  return done;
}
// a phase that never completes (a bug) traps after ~2 s instead of hanging, as spin() below
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  long long t0 = 0;
  while (!mbar_try(bar, parity)) {
    if (t0 == 0) t0 = clock64();
    else if (clock64() - t0 > 4000000000LL) __trap();
  }
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into shared memory
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if STEP_KV_L2
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)), "l"(policy) : "memory");
#else
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory");
#endif
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

// entry i of an index tensor, int64 or int32
__device__ __forceinline__ int64_t ld_idx(int64_t ptr, int64_t is64, int i) {
  return is64 ? __ldcg(reinterpret_cast<const long long*>(ptr) + i) : __ldcg(reinterpret_cast<const int*>(ptr) + i);
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

// 16 bytes of words as loaded (Raw<W>::R), whether each carries `tag`, and their values
template <typename W> struct Raw;
template <> struct Raw<unsigned> {
  using R = uint4;
  static constexpr int PER = 4;
};
template <> struct Raw<unsigned long long> {
  using R = ulonglong2;
  static constexpr int PER = 2;
};
__device__ __forceinline__ void ld_raw(const unsigned* p, uint4& u) {
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p) : "memory");
}
__device__ __forceinline__ void ld_raw(const unsigned long long* p, ulonglong2& u) {
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];" : "=l"(u.x), "=l"(u.y) : "l"(p) : "memory");
}
__device__ __forceinline__ bool tagged(const uint4& u, unsigned tag) {
  tag &= 0xffffu;
  return (u.x & 0xffffu) == tag && (u.y & 0xffffu) == tag && (u.z & 0xffffu) == tag && (u.w & 0xffffu) == tag;
}
__device__ __forceinline__ bool tagged(const ulonglong2& u, unsigned tag) {
  return static_cast<unsigned>(u.x) == tag && static_cast<unsigned>(u.y) == tag;
}
__device__ __forceinline__ void values(const uint4& u, float* out) {
  out[0] = __uint_as_float(u.x & 0xffff0000u);
  out[1] = __uint_as_float(u.y & 0xffff0000u);
  out[2] = __uint_as_float(u.z & 0xffff0000u);
  out[3] = __uint_as_float(u.w & 0xffff0000u);
}
__device__ __forceinline__ void values(const ulonglong2& u, float* out) {
  out[0] = __uint_as_float(static_cast<unsigned>(u.x >> 32));
  out[1] = __uint_as_float(static_cast<unsigned>(u.y >> 32));
}

// 16 bytes of words once every tag is `tag`: their values
template <typename W>
__device__ __forceinline__ void ld_words(const W* p, unsigned tag, float* out) {
  typename Raw<W>::R u;
  long long t0 = 0;
  for (ld_raw(p, u); !tagged(u, tag); ld_raw(p, u)) spin(t0);
  values(u, out);
}

// The 16 bytes of words at at(c) for c = first + i * step (i < B, c < n), each handed to use(c, values) once
// tagged: all B loads are issued before the first is waited on, so once the producers are done a thread
// waits about one round trip to L2 for B of its loads, not one a load. B is what the registers allow:
// gather<GM>() loads at once in an instance whose attention holds GM heads' sums (more, and the instance
// spills inside its key loop); STEP_GATHER = B > 0 sets it (1: one load at a time).
#ifndef STEP_GATHER
#define STEP_GATHER 0
#endif
template <int GM> __host__ __device__ constexpr int gather() { return STEP_GATHER > 0 ? STEP_GATHER : GM <= 2 ? 4 : 2; }
template <int B, typename W, typename A, typename F>
__device__ __forceinline__ void ld_words_batch(A&& at, int first, int step, int n, unsigned tag, F&& use) {
  typename Raw<W>::R u[B];
#pragma unroll
  for (int i = 0; i < B; ++i) {
    if (first + i * step < n) ld_raw(at(first + i * step), u[i]);
  }
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const int c = first + i * step;
    if (c < n) {
      long long t0 = 0;
      while (!tagged(u[i], tag)) {
        spin(t0);
        ld_raw(at(c), u[i]);
      }
      float f[Raw<W>::PER];
      values(u[i], f);
      use(c, f);
    }
  }
}
__device__ __forceinline__ unsigned long long ld_raw1(const unsigned long long* p) {
  unsigned long long x;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(x) : "l"(p) : "memory");
  return x;
}
// a float word once tagged, from its first load x
__device__ __forceinline__ float word_value(const unsigned long long* p, unsigned long long x, unsigned tag) {
  long long t0 = 0;
  while (static_cast<unsigned>(x) != tag) {
    spin(t0);
    x = ld_raw1(p);
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
  int upc, nch;        // units a chunk, chunks of the prefetched part
  unsigned upc_m;      // ceil(2^32 / upc) (0 for upc 1): chunk_of divides by upc with it
};
// the kernel's static shared memory: the chunks' barriers and offsets, the ring slots' barriers, the four
// stage kinds (kinds[] in the kernel)
static_assert(NCB * 12 + RING_SLOTS * 8 + 4 * sizeof(Stage) <= 1024,
              "the static shared memory outgrows what step_kernel.py allows (_STATIC_SMEM)");

__device__ __forceinline__ const char* lptr(const int64_t* lp, int field) {
  return reinterpret_cast<const char*>(lp[field]);
}

// a stage kind's weights in the layer's pointer table
__device__ __forceinline__ int kind_field(int kind) {
  return kind == K_QKV ? L_QKV : kind == K_O ? L_O : kind == K_GU ? L_GATE_UP : L_DOWN;
}

// this block's part of a stage of the kind, its weights left out: the same for every layer, so the kernel
// works it out once at the start (kinds below)
template <typename T>
__device__ Stage stage_shape(const Args& a, int kind, int ring_bytes) {
  const int H = a.v[F_hidden], D = a.v[F_head_dim], I = a.v[F_inter];
  const int Hq = a.v[F_heads], Hk = a.v[F_kv_heads];
  Stage s;
  int units;
  s.w = nullptr;
  s.pair_offset = 0;
  switch (kind) {
    case K_QKV: s.k = H; units = (Hq + 2 * Hk) * D; break;
    case K_O: s.k = Hq * D; units = H; break;
    case K_GU: s.k = H; units = I; s.pair_offset = I; break;
    default: s.k = I; units = H; break;
  }
  // balanced: every block gets at least one unit (step_kernel.py keeps the grid <= every stage's units)
  s.u0 = (int)blockIdx.x * units / (int)gridDim.x;
  s.n = ((int)blockIdx.x + 1) * units / (int)gridDim.x - s.u0;
  const int unit_bytes = (s.pair_offset ? 2 : 1) * s.k * (int)sizeof(T);
  // a stage's prefetched part is at most 3/5 of the ring and a chunk at most 2/5, so the next chunk always
  // fits once the stages before are released (else the copy warp would wait on its own stage)
  s.npre = unit_bytes <= ring_bytes / 5 * 2 ? min(s.n, (ring_bytes / 5 * 3) / unit_bytes) : 0;
  s.bytes = s.npre * unit_bytes;
  s.upc = max(1, STEP_CHUNK / unit_bytes);
  s.upc_m = s.upc == 1 ? 0u : (unsigned)(((1ull << 32) + s.upc - 1) / s.upc);
  s.nch = (s.npre + s.upc - 1) / s.upc;
  return s;
}

// the chunk of unit u, u / upc without a division: exact while u * upc < 2^32 (u is below a stage's rows)
__device__ __forceinline__ int chunk_of(const Stage& s, int u) {
  return s.upc == 1 ? u : (int)__umulhi((unsigned)u, s.upc_m);
}

// weight stage ws: its kind's part (kinds[4], in shared memory) with the layer's weights from tab, the
// layers' pointer table copied into shared memory at the start
__device__ __forceinline__ Stage stage_of(const Stage* kinds, const int64_t* tab, int ws) {
  Stage s = kinds[ws & 3];
  s.w = lptr(tab + (ws >> 2) * NUM_LAYER_FIELDS, kind_field(ws & 3));
  return s;
}

// The chunks are numbered in stream order: chunk c of weight stage ws is chunk0(ws) + c. Every layer's
// stages have the same shapes, so a layer has the same chunks.
struct Chunks {
  int base[4];
  int per_layer;
};
__device__ Chunks chunks_of(const Stage* kinds) {
  Chunks c;
  int n = 0;
  for (int kind = 0; kind < 4; ++kind) {
    c.base[kind] = n;
    n += kinds[kind].nch;
  }
  c.per_layer = n;
  return c;
}
__device__ __forceinline__ int chunk0(const Chunks& c, int ws) { return (ws >> 2) * c.per_layer + c.base[ws & 3]; }

// The ring: the copy warp (one lane) issues the stages in order, chunk by chunk, each chunk where the ring
// has room (one bulk copy, or two for gate/up: the chunk's gate rows, then its up rows), at an offset it
// records (chunk_off), completed on the chunk's mbarrier. A chunk that does not fit before the ring's end
// starts at its beginning, so at most a chunk's bytes are left unused there. It takes room back in stage
// order as the compute warps release stages on the stage slot's "empty" mbarrier (one arrival a warp, slot
// ws % RING_SLOTS). No compute warp ever waits for a copy to be issued.
struct Ring {
  uint64_t* chunk;
  uint64_t* empty;
  int* chunk_off;
};

// chunk j's barrier and the parity of its j / NCB-th use (j >= 0: unsigned, so % and / are a mask and a shift)
__device__ __forceinline__ void chunk_wait(const Ring& r, unsigned j) { mbar_wait(r.chunk + j % NCB, (j / NCB) & 1); }

template <typename T>
__device__ void copy_weights(const Stage* kinds, const int64_t* tab, char* ring, int ring_bytes, const Ring& r,
                             const Chunks& ck, int total_ws) {
  int head = 0, used = 0, rel = 0;  // rel: the oldest stage not yet released
  int size[RING_SLOTS];             // a stage's bytes in the ring, its chunks' and their padding
  for (int ws = 0; ws < total_ws; ++ws) {
    const Stage s = stage_of(kinds, tab, ws);
    const int slot = ws % RING_SLOTS;
    while (ws - rel >= RING_SLOTS) {  // the slot's last stage released first: its size is taken back
      mbar_wait(r.empty + rel % RING_SLOTS, (rel / RING_SLOTS) & 1);
      used -= size[rel % RING_SLOTS];
      ++rel;
    }
    size[slot] = 0;
    if (STEP_L2_AHEAD > 0 && ws + STEP_L2_AHEAD < total_ws) {
      const Stage f = stage_of(kinds, tab, ws + STEP_L2_AHEAD);
      const size_t frb = (size_t)f.k * sizeof(T);
      for (int part = 0; part < (f.pair_offset ? 2 : 1); ++part) {
        const char* base = f.w + (size_t)(f.u0 + part * f.pair_offset) * frb;
        for (size_t o = 0; o < (size_t)f.n * frb; o += 16384) {
          const unsigned n = (unsigned)min((size_t)16384, (size_t)f.n * frb - o);
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + o), "r"(n) : "memory");
        }
      }
    }
    const size_t rb = (size_t)s.k * sizeof(T);
    const int unit_bytes = (s.pair_offset ? 2 : 1) * (int)rb;
    const int j0 = chunk0(ck, ws);
    for (int c = 0; c < s.nch; ++c) {
      const int j = j0 + c;
      const int first = c * s.upc, nu = min(s.upc, s.npre - first), bytes = nu * unit_bytes;
      for (;;) {
        const int pad = (head + bytes > ring_bytes) ? ring_bytes - head : 0;
        if (used + pad + bytes <= ring_bytes) break;
        mbar_wait(r.empty + rel % RING_SLOTS, (rel / RING_SLOTS) & 1);
        used -= size[rel % RING_SLOTS];
        ++rel;
      }
      // wrapped by whether the chunk fits, not by the padding: a chunk after one that ended exactly at the
      // ring's end (head == ring_bytes) has no padding and still starts at 0
      const bool wrap = head + bytes > ring_bytes;
      const int pad = wrap ? ring_bytes - head : 0;
      const int off = wrap ? 0 : head;
      head = off + bytes;
      used += pad + bytes;
      size[slot] += pad + bytes;
      if (STEP_PACE > 0 && j >= STEP_PACE) chunk_wait(r, j - STEP_PACE);
      r.chunk_off[j % NCB] = off;  // released to the warps by the chunk's arrival
      uint64_t* bar = r.chunk + j % NCB;
      const unsigned run = (unsigned)(nu * rb);
      if (STEP_NO_STREAM) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(bar)) : "memory");
        continue;
      }
      mbar_expect(bar, (unsigned)bytes);
      bulk_copy(ring + off, s.w + (s.u0 + first) * rb, run, bar);
      if (s.pair_offset) bulk_copy(ring + off + run, s.w + (s.u0 + s.pair_offset + first) * rb, run, bar);
    }
  }
}

// a stage's rows as a warp reads them: unit u's (gate) row in the ring once its chunk is in (u < npre),
// else in global memory; gate/up's up row follows its chunk's gate rows in the ring, pair_offset rows in W
struct Rows {
  const Ring* r;
  const char* ring;
  const Stage* s;
  int j0;
  size_t rb;
  __device__ __forceinline__ const char* unit(int u, bool& smem) const {
    smem = u < s->npre;
    if (!smem) return s->w + (size_t)(s->u0 + u) * rb;
    const int c = chunk_of(*s, u);
    chunk_wait(*r, j0 + c);
    return ring + r->chunk_off[(unsigned)(j0 + c) % NCB] + (size_t)(u - c * s->upc) * rb;
  }
  __device__ __forceinline__ const char* up(const char* gate, int u, bool smem) const {
    if (!smem) return gate + (size_t)s->pair_offset * rb;
    const int first = chunk_of(*s, u) * s->upc;
    return gate + (size_t)min(s->upc, s->npre - first) * rb;
  }
  // the trace's "weights in": the stage's first chunk
  __device__ __forceinline__ void first_in() const {
    if (s->nch) chunk_wait(*r, j0);
  }
};
template <typename T>
__device__ __forceinline__ Rows rows_of(const Ring& r, const char* ring, const Stage& s, const Chunks& ck, int ws) {
  return Rows{&r, ring, &s, chunk0(ck, ws), (size_t)s.k * sizeof(T)};
}

// this warp is done with stage ws's rows
__device__ __forceinline__ void ring_release(const Ring& r, int ws) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(r.empty + ws % RING_SLOTS)) : "memory");
  }
}

// N rows of W (in shared memory or global) times NB input rows (shared memory, T, vs elements apart), each
// summed over the warp: each lane reads 16 bytes of every row and 16 of every input row, so no read has
// bank conflicts; every weight load of a round is issued before its arithmetic. With one input a row keeps
// two sums (the chains are half as long; several rows STEP_DOT_SUMS each); several inputs' sums are
// independent chains already.
template <typename T, int N, int NB>
__device__ __forceinline__ void rows_dot(const char* const* p, const bool* sm, const T* vec, int vs, int k, int lane,
                                         float (&out)[N][NB]) {
  constexpr int E = Vec<T>::N;
  constexpr int A = NB > 1 ? 1 : N == 1 ? 2 : STEP_DOT_SUMS;
  float acc[N][NB][A];
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int c = 0; c < A; ++c) acc[j][b][c] = 0.f;
  if (STEP_NO_GEMV) k = 0;
#pragma unroll DOT_UNROLL
  for (int i = lane * E; i < k; i += 32 * E) {
    const size_t o = (size_t)i * sizeof(T);
    uint4 u[N];
#pragma unroll
    for (int j = 0; j < N; ++j) u[j] = sm[j] ? lds128(p[j] + o) : ld_stream(p[j] + o);
    float w[N][E];
#pragma unroll
    for (int j = 0; j < N; ++j) unpack<T>(u[j], w[j]);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      float x[E];
      unpack<T>(lds128(vec + (size_t)b * vs + i), x);
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][b][e % A] += w[j][e] * x[e];
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      out[j][b] = acc[j][b][0];
#pragma unroll
      for (int c = 1; c < A; ++c) out[j][b] += acc[j][b][c];
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int b = 0; b < NB; ++b) out[j][b] += __shfl_xor_sync(0xffffffffu, out[j][b], o);
}

// Inputs: the projection's NB rows of vec (vs elements apart), nb of them the batch's (the rest, up to the
// instance's NB, are dotted and dropped). Every lane holds every sum after rows_dot; value (i, b) is handed
// on by lane (i * NB + b) % 32, so the stores spread over the warp.
struct In {
  int vs, nb;
};
__device__ __forceinline__ bool mine(int lane, int i, int b, int NB) { return lane == ((i * NB + b) & 31); }

// units [first, first + P) of a plain stage (those < n): out(u, b, value)
template <typename T, int P, int NB, typename F>
__device__ __forceinline__ void rows_group(const Rows& rw, const T* vec, In in, int first, int lane, F& out) {
  const Stage& s = *rw.s;
  const char* p[P];
  bool sm[P];
#pragma unroll
  for (int i = 0; i < P; ++i) p[i] = rw.unit(first + i < s.n ? first + i : first, sm[i]);  // past n: a repeat
  float o[P][NB];
  rows_dot<T, P, NB>(p, sm, vec, in.vs, s.k, lane, o);
#pragma unroll
  for (int i = 0; i < P; ++i)
#pragma unroll
    for (int b = 0; b < NB; ++b)
      if (mine(lane, i, b, NB) && first + i < s.n && b < in.nb) out(first + i, b, o[i][b]);
}
template <typename T, int P, int NB, typename F>
__device__ __forceinline__ void rows_passes(const Rows& rw, const T* vec, In in, F& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int base = warp * P; base < rw.s->n; base += P * CW) rows_group<T, P, NB>(rw, vec, in, base, lane, out);
}
// in one pass where a warp's share is at most PM rows: a warp takes consecutive rows (of consecutive
// chunks); PM shrinks as NB grows (the sums a lane keeps)
template <typename T, int NB, typename F>
__device__ __forceinline__ void rows_nb(const Rows& rw, const T* vec, In in, F& out) {
  constexpr int PM = NB <= 2 ? 4 : 2;
  switch (min((rw.s->n + CW - 1) / CW, PM)) {
    case 1: rows_passes<T, 1, NB>(rw, vec, in, out); break;
    case 2: rows_passes<T, 2, NB>(rw, vec, in, out); break;
    case 3: rows_passes<T, (PM < 3 ? PM : 3), NB>(rw, vec, in, out); break;
    default: rows_passes<T, PM, NB>(rw, vec, in, out); break;
  }
}
// the instance of NB inputs a batch of nb takes: 1, 2, 4 or 8 (as step_kernel.py's _vec_rows)
__host__ __device__ __forceinline__ int vec_rows(int nb) { return nb <= 2 ? nb : nb <= 4 ? 4 : MAXB; }

// gate/up: units [first, first + P) as 2P rows (gate, up of each): out(u, b, gate, up)
template <typename T, int P, int NB, typename F>
__device__ __forceinline__ void pairs_passes(const Rows& rw, const T* vec, In in, F& out) {
  const Stage& s = *rw.s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int first = warp * P; first < s.n; first += P * CW) {
    const char* p[2 * P];
    bool sm[2 * P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int u = first + i < s.n ? first + i : first;  // past n: a repeat
      p[2 * i] = rw.unit(u, sm[2 * i]);
      p[2 * i + 1] = rw.up(p[2 * i], u, sm[2 * i]);
      sm[2 * i + 1] = sm[2 * i];
    }
    float o[2 * P][NB];
    rows_dot<T, 2 * P, NB>(p, sm, vec, in.vs, s.k, lane, o);
#pragma unroll
    for (int i = 0; i < P; ++i)
#pragma unroll
      for (int b = 0; b < NB; ++b)
        if (mine(lane, i, b, NB) && first + i < s.n && b < in.nb) out(first + i, b, o[2 * i][b], o[2 * i + 1][b]);
  }
}
template <typename T, int NB, typename F>
__device__ __forceinline__ void pairs_nb(const Rows& rw, const T* vec, In in, F& out) {
  if (NB <= 4 && rw.s->n > CW) pairs_passes<T, 2, NB>(rw, vec, in, out);
  else pairs_passes<T, 1, NB>(rw, vec, in, out);
}
template <bool PAIRS, typename T, int NB, typename F>
__device__ __forceinline__ void dots_nb(const Rows& rw, const T* vec, In in, F& out) {
  if constexpr (PAIRS) pairs_nb<T, NB>(rw, vec, in, out);
  else rows_nb<T, NB>(rw, vec, in, out);
}
// this block's rows of a stage times the batch's input rows: out(u, b, value), or for gate/up (PAIRS)
// out(u, b, gate, up). MB: the kernel instance's batch, 1 or MAXB (a batch of 2 to MAXB)
template <bool PAIRS, typename T, int MB, typename F>
__device__ __forceinline__ void stage_dots(const Rows& rw, const T* vec, In in, F&& out) {
  if (MB == 1) {
    dots_nb<PAIRS, T, 1>(rw, vec, in, out);
    return;
  }
  switch (vec_rows(in.nb)) {
    case 2: dots_nb<PAIRS, T, 2>(rw, vec, in, out); break;
    case 4: dots_nb<PAIRS, T, 4>(rw, vec, in, out); break;
    default: dots_nb<PAIRS, T, MAXB>(rw, vec, in, out); break;
  }
}

// ---- the input rows of the projections -------------------------------------------------------------------
// rows [0, nb) of dst (ds elements apart) = the words' rows (nb rows of n words, back to back) once tagged
// `tag`, optionally + add's rows (ds apart), rounded; ss[b] += this thread's part of row b's sum of squares
template <typename T, int B>
__device__ void gather_words(const typename Word<T>::W* src, int n, int nb, unsigned tag, const T* add, T* dst,
                             int ds, float (&ss)[MAXB]) {
  constexpr int P = Word<T>::PER;
  using W = typename Word<T>::W;
  gate(src, n, tag);
#pragma unroll
  for (int b = 0; b < MAXB; ++b) ss[b] = 0.f;
  const int per = n / P, total = nb * per;
  const auto at = [&](int c) { return src + (size_t)c * P; };
  for (int c0 = threadIdx.x; c0 < total; c0 += B * CT) {
    ld_words_batch<B, W>(at, c0, CT, total, tag, [&](int c, const float* f) {
      const int row = nb == 1 ? 0 : c / per;
      const int at_row = row * ds + (c - row * per) * P;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < P; ++e) {
        float v = f[e];
        if (add) v = rnd<T>(v + tof<T>(add[at_row + e]));
        dst[at_row + e] = fromf<T>(v);
        s += v * v;
      }
#pragma unroll
      for (int b = 0; b < MAXB; ++b)
        if (b == row) ss[b] += s;
    });
  }
}

// vec's rows [0, nb) (vs elements apart) = rms_norm(row b of rows (k elements, rs apart), w), ss[b] this
// thread's part of row b's sum of squares; w in shared memory, staged by this block's cp16s (waited for
// here); red: nb * CW floats
template <typename T>
__device__ void norm_rows(const T* rows, int rs, const float (&ss)[MAXB], int nb, const T* w, int k, float eps,
                          T* vec, int vs, float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  cp_wait_all();
  float part[MAXB];
#pragma unroll
  for (int b = 0; b < MAXB; ++b) part[b] = b < nb ? warp_sum(ss[b]) : 0.f;
  csync();  // red is free (its last readers are past)
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < MAXB; ++b)
      if (b < nb) red[b * CW + warp] = part[b];
  }
  csync();
#pragma unroll
  for (int b = 0; b < MAXB; ++b) {
    if (b < nb) {
      const float rstd = rsqrtf(warp_sum(lane < CW ? red[b * CW + lane] : 0.f) / k + eps);
      const T* row = rows + (size_t)b * rs;
      T* out = vec + (size_t)b * vs;
      for (int i = threadIdx.x; i < k; i += CT) out[i] = fromf<T>(rnd<T>(tof<T>(w[i]) * rnd<T>(tof<T>(row[i]) * rstd)));
    }
  }
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
  int b, kvh, split;         // request, KV head, split; split < 0: no attention work
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
  // this request's rows of the words: [request][head][split][D] parts, [request][head][split] log-sums
  FWord* part_o = reinterpret_cast<FWord*>(a.v[F_part_o]) + (size_t)cx.b * Hq * S * D;
  FWord* part_lse = reinterpret_cast<FWord*>(a.v[F_part_lse]) + (size_t)cx.b * Hq * S;
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
    if (cx.pslot[r] >= 0 && STEP_NO_KEYS != 2) {
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
    const W* qkv = reinterpret_cast<const W*>(a.v[F_w_qkv]) + (size_t)cx.b * (Hq + 2 * Hk) * D;
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
      // STEP_NO_KEYS: every warp's part a finite zero, so the merges run on numbers (NaNs would reach the
      // sampler and stop the run)
      m[g] = STEP_NO_KEYS == 1 ? 0.f : -INFINITY;
      l[g] = STEP_NO_KEYS == 1 ? 1.f : 0.f;
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
      if (t0 < end && STEP_NO_KEYS != 1) key(t0 + sub, kp[r], vp[r]);
    }
    for (int t0 = start + (PRE_ROUNDS * CW + warp) * KPW; t0 < end && STEP_NO_KEYS != 1; t0 += CW * KPW) {
      const int t = t0 + sub;
      uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
      if (t < end && t != last && STEP_NO_KEYS != 2) {
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
    if (!STEP_NO_WMERGE) csync();
    // each warp's weight in the merge, computed once: warp g's lane w for warp w's (m, l) of head g, the
    // weight exp2(m - max) written over m; the max and the weights' sum in the copy warp's (free) row
    float* wmax = wm + CW * MAXG;
    float* wtot = wl + CW * MAXG;
    if (!STEP_NO_WMERGE && warp < group) {
      const int g = warp;
      const float lw = lane < CW ? wl[lane * MAXG + g] : 0.f;
      const float mw = lw > 0.f ? wm[lane * MAXG + g] : -INFINITY;
      float mx = mw;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float f = lw > 0.f ? exp2f(mw - mx) : 0.f;
      const float tot = warp_sum(lw * f);
      __syncwarp();
      if (lane < CW) wm[lane * MAXG + g] = f;
      if (lane == 0) wmax[g] = mx, wtot[g] = tot;
    }
    if (!STEP_NO_WMERGE) csync();
    for (int t = threadIdx.x; t < group * D; t += CT) {
      const int g = t / D, d = t - g * D;
      if (STEP_NO_WMERGE) {
        st_word(part_o + ((size_t)(kvh * group + g) * S + split) * D + d, 0.f, tag);
        if (d == 0) st_word(part_lse + (kvh * group + g) * S + split, 0.f, tag);
        continue;
      }
      float o = 0.f;
      for (int w = 0; w < CW; ++w) o += wacc[(w * group + g) * D + d] * wm[w * MAXG + g];
      const float tot = wtot[g];
      const int head = kvh * group + g;
      st_word(part_o + ((size_t)head * S + split) * D + d, o / tot, tag);
      if (d == 0) st_word(part_lse + head * S + split, wmax[g] + log2f(tot), tag);
    }
  } else {  // an empty split: zeros, and a log-sum of -inf
    for (int t = threadIdx.x; t < group * D; t += CT) {
      const int g = t / D, d = t - g * D, head = kvh * group + g;
      st_word(part_o + ((size_t)head * S + split) * D + d, 0.f, tag);
      if (d == 0) st_word(part_lse + head * S + split, -INFINITY, tag);
    }
  }
  if (tr && threadIdx.x == 0) tr[3] = clock64();
  // the next layer's keys and values of this split, asked of L2 (split 0 first merges)
  auto prefetch_next = [&]() {
    if (!STEP_KV_L2 || layer + 1 >= (int)a.v[F_num_layers] || start >= end) return;
    const int lines = max(1, D * (int)sizeof(T) / 128);
    const int64_t lstride = a.v[F_kv_layer_stride] * (int64_t)sizeof(T);
    for (int i = threadIdx.x; i < (end - start) * 2 * lines; i += CT) {
      const int t = start + i / (2 * lines), rem = i % (2 * lines);
      if (t == last) continue;
      const char* base = (rem < lines ? kc : vc) + lstride;
      const char* p = base + (int64_t)__ldcg(pt + t) * skt + (size_t)kvh * skh + (rem % lines) * 128;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
  };
  if (split != 0) {
    prefetch_next();
    return;
  }

  // split 0 merges the group's splits: every split's words in one pass, then the weighted sum
  csync();  // wm.. is reused
  float* mo = wm;                   // [group][S][D]
  float* ml = mo + group * S * D;   // [group][S]
  // (the group's parts and log-sums are contiguous: head kvh * group + g, split s at (g * S + s) * D and
  // g * S + s); a thread's log-sum and its parts' loads are all issued before it waits on one
  const int nvo = group * S * D / 2;
  const FWord* lse_src = part_lse + (size_t)kvh * group * S + threadIdx.x;
  const unsigned long long lse_raw = threadIdx.x < group * S ? ld_raw1(lse_src) : 0;
  const FWord* po = part_o + (size_t)kvh * group * S * D;
  const auto at = [&](int c) { return po + (size_t)c * 2; };
  for (int c0 = threadIdx.x; c0 < nvo; c0 += gather<GM>() * CT) {
    ld_words_batch<gather<GM>(), FWord>(at, c0, CT, nvo, tag, [&](int c, const float* f) {
      mo[c * 2] = f[0];
      mo[c * 2 + 1] = f[1];
    });
  }
  if (threadIdx.x < group * S) ml[threadIdx.x] = word_value(lse_src, lse_raw, tag);
  // each split's weight, computed once: warp g's lane s, exp2(lse - max) written over the lse, the
  // weights' sum after the group's log-sums
  float* mtot = ml + group * S;
  csync();
  if (warp < group) {
    const int g = warp;
    const float ls = lane < S ? ml[g * S + lane] : -INFINITY;
    float mx = ls;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float f = ls == -INFINITY ? 0.f : exp2f(ls - mx);
    const float tot = warp_sum(f);
    __syncwarp();
    if (lane < S) ml[g * S + lane] = f;
    if (lane == 0) mtot[g] = tot;
  }
  csync();
  W* attn = reinterpret_cast<W*>(a.v[F_w_attn]) + (size_t)cx.b * Hq * D;
  for (int t = threadIdx.x; t < group * D; t += CT) {
    const int g = t / D, d = t - g * D;
    float o = 0.f;
    for (int s = 0; s < S; ++s) o += ml[g * S + s] * mo[(g * S + s) * D + d];
    st_word(attn + (kvh * group + g) * D + d, fromf<T>(o / mtot[g]), tag);
  }
  prefetch_next();
}

// ---- the kernel -------------------------------------------------------------------------------------------
// MB: 1 (a batch of one: nb a constant, the batch's loops folded away) or MAXB (2 to MAXB requests)
template <typename T, int LPK, int GM, int MB>
__global__ void __launch_bounds__(NT, 1) decode_step_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) char smem[];
  using W = typename Word<T>::W;
  const int L = a.v[F_num_layers], H = a.v[F_hidden], I = a.v[F_inter];
  const int Hq = a.v[F_heads], D = a.v[F_head_dim];
  const int ring_bytes = a.v[F_ring_bytes];
  const int nb = MB == 1 ? 1 : (int)a.v[F_batch], NQ = (Hq + 2 * (int)a.v[F_kv_heads]) * D;
  char* ring = smem;
  const int vec_elems = a.v[F_vec_elems];
  const In in{vec_elems, nb};
  T* vec = reinterpret_cast<T*>(smem + ring_bytes);  // [vec_rows(nb)][vec_elems] the projection's input rows
  T* hs = vec + vec_rows(nb) * vec_elems;            // [nb][H] h: this layer's residual into the attention
  T* h2s = hs + nb * H;                              // [nb][H] h2: its residual into the MLP
  T* nwt = h2s + nb * H;                             // [vec_elems] the next norm's weights
  int64_t* tab = reinterpret_cast<int64_t*>(nwt + vec_elems);  // the layers' pointer table
  const int tab_n = (L * NUM_LAYER_FIELDS + 1) / 2 * 2;
  float* cs = reinterpret_cast<float*>(tab + tab_n);  // [D] cos / sin of the position
  float* scratch = cs + D;
  float* red = scratch + a.v[F_scratch_floats];  // nb * CW floats
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
  __shared__ __align__(8) uint64_t chunk_bar[NCB], empty[RING_SLOTS];
  __shared__ int chunk_off[NCB];
  __shared__ Stage kinds[4];  // this block's part of each projection, the same every layer
  if (threadIdx.x < 4) kinds[threadIdx.x] = stage_shape<T>(a, threadIdx.x, ring_bytes);
  if (threadIdx.x == 0) {
    for (int i = 0; i < NCB; ++i) mbar_init(chunk_bar + i, 1);
    for (int i = 0; i < RING_SLOTS; ++i) mbar_init(empty + i, CW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const Ring r{chunk_bar, empty, chunk_off};
  // what stays the same for every layer: the pointer table, the attention item (block i: request
  // i / (Hk * S), KV head, split), its position's cos / sin
  Ctx cx;
  {
    const int Hk = a.v[F_kv_heads], S = a.v[F_splits];
    const int item = blockIdx.x, has = item < nb * Hk * S;
    cx.b = has ? item / (Hk * S) : 0;
    const int rest = item - cx.b * Hk * S;
    cx.split = has ? rest % S : -1;
    cx.kvh = rest / S;
    const int64_t i64 = a.v[F_idx64];
    const int seq = (int)ld_idx(a.v[F_seq_lens], i64 & 1, cx.b);
    const int64_t pos = ld_idx(a.v[F_positions], i64 & 2, cx.b);
    const long long* lt = reinterpret_cast<const long long*>(a.v[F_layers]);
    for (int i = threadIdx.x; i < L * NUM_LAYER_FIELDS; i += NT) tab[i] = __ldg(lt + i);
    const float* csg = reinterpret_cast<const float*>(a.v[F_cos_sin]) + pos * a.v[F_stride_cs];
    for (int i = threadIdx.x; i < 2 * (int)a.v[F_rot_half]; i += NT) cs[i] = __ldg(csg + i);
    cx.cs = cs;
    cx.row = ld_idx(a.v[F_table_idx], i64 & 4, cx.b);
    cx.slot_new = ld_idx(a.v[F_out_loc], i64 & 8, cx.b);
    cx.last = seq - 1;
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
  if (STEP_NO_STREAM) {
    for (int i = threadIdx.x; i < ring_bytes / 16; i += NT) reinterpret_cast<uint4*>(ring)[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();
  const Chunks ck = chunks_of(kinds);
  if (warp == CW) {  // the copy warp: one lane streams every weight stage into the ring, then leaves
    if (lane == 0) copy_weights<T>(kinds, tab, ring, ring_bytes, r, ck, total_ws);
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
#if STEP_STREAM_ONLY
    for (int kind = 0; kind < 4; ++kind) {
      const int st = kind == K_QKV ? 0 : kind + 1;
      MARK(st, 0);
      MARK(st, 1);
      MARK(st, 2);
      const Stage s = stage_of(kinds, tab, 4 * layer + kind);
      const Rows rw = rows_of<T>(r, ring, s, ck, 4 * layer + kind);
      MARK(st, 3);
      for (int c = warp; c < s.nch; c += CW) chunk_wait(r, rw.j0 + c);
      ring_release(r, 4 * layer + kind);
      csync();
      MARK(st, 4);
      if (kind == K_QKV)
        for (int p = 0; p < POINTS; ++p) MARK(1, p);
    }
    continue;
#endif
    // qkv: h = y + h2 (x on the first layer), normalised into vec
    MARK(0, 0);
    MARK(0, 1);
    stage_row(nwt, (const T*)lp[L_IN_NORM], H * (int)sizeof(T));
    {
      float ss[MAXB];
      if (layer == 0) {  // the embedding rows [nb][H], as hs is laid out
        constexpr int E = Vec<T>::N;
        const T* x = reinterpret_cast<const T*>(a.v[F_x_in]);
        const int per = H / E;
#pragma unroll
        for (int b = 0; b < MAXB; ++b) ss[b] = 0.f;
        for (int c = threadIdx.x; c < nb * per; c += CT) {
          const uint4 u = ld_cg(x + c * E);
          *reinterpret_cast<uint4*>(hs + c * E) = u;
          float f[E], sq = 0.f;
          unpack<T>(u, f);
#pragma unroll
          for (int e = 0; e < E; ++e) sq += f[e] * f[e];
          const int row = nb == 1 ? 0 : c / per;
#pragma unroll
          for (int b = 0; b < MAXB; ++b)
            if (b == row) ss[b] += sq;
        }
      } else {
        gather_words<T, gather<GM>()>(w_y, H, nb, tag - 1, h2s, hs, H, ss);
      }
      norm_rows<T>(hs, H, ss, nb, nwt, H, a.eps, vec, vec_elems, red);
    }
    MARK(0, 2);
    {
      const Stage s = stage_of(kinds, tab, 4 * layer + K_QKV);
      const Rows rw = rows_of<T>(r, ring, s, ck, 4 * layer + K_QKV);
      if (tr) rw.first_in();
      MARK(0, 3);
      const T* bias = (const T*)lp[L_QKV_BIAS];
      stage_dots<false, T, MB>(rw, vec, in, [&](int u, int b, float v) {
        if (bias) v += tof<T>(bias[s.u0 + u]);
        st_word(w_qkv + b * NQ + s.u0 + u, fromf<T>(v), tag);
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
    {
      float ss[MAXB];
      gather_words<T, gather<GM>()>(w_attn, Hq * D, nb, tag, nullptr, vec, vec_elems, ss);
    }
    csync();
    MARK(2, 2);
    {
      const Stage s = stage_of(kinds, tab, 4 * layer + K_O);
      const Rows rw = rows_of<T>(r, ring, s, ck, 4 * layer + K_O);
      if (tr) rw.first_in();
      MARK(2, 3);
      stage_dots<false, T, MB>(rw, vec, in, [&](int u, int b, float v) {
        const int i = b * H + s.u0 + u;
        const T o = fromf<T>(rnd<T>(v) + tof<T>(hs[i]));
        st_word(w_h2 + i, o, tag);
        h2[i] = o;
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
      float ss[MAXB];
      gather_words<T, gather<GM>()>(w_h2, H, nb, tag, nullptr, h2s, H, ss);
      norm_rows<T>(h2s, H, ss, nb, nwt, H, a.eps, vec, vec_elems, red);
    }
    MARK(3, 2);
    {
      const Stage s = stage_of(kinds, tab, 4 * layer + K_GU);
      const Rows rw = rows_of<T>(r, ring, s, ck, 4 * layer + K_GU);
      if (tr) rw.first_in();
      MARK(3, 3);
      stage_dots<true, T, MB>(rw, vec, in, [&](int u, int b, float g, float uv) {
        g = rnd<T>(g);
        uv = rnd<T>(uv);
        st_word(w_act + b * I + s.u0 + u, fromf<T>(rnd<T>(g / (1.f + __expf(-g))) * uv), tag);
      });
      ring_release(r, 4 * layer + K_GU);
      csync();  // vec is rewritten next
    }
    MARK(3, 4);
    // down: y
    MARK(4, 0);
    MARK(4, 1);
    {
      float ss[MAXB];
      gather_words<T, gather<GM>()>(w_act, I, nb, tag, nullptr, vec, vec_elems, ss);
    }
    csync();
    MARK(4, 2);
    {
      const Stage s = stage_of(kinds, tab, 4 * layer + K_DOWN);
      const Rows rw = rows_of<T>(r, ring, s, ck, 4 * layer + K_DOWN);
      if (tr) rw.first_in();
      MARK(4, 3);
      stage_dots<false, T, MB>(rw, vec, in, [&](int u, int b, float v) {
        const int i = b * H + s.u0 + u;
        const T o = fromf<T>(v);
        st_word(w_y + i, o, tag);
        y[i] = o;
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
  auto k = a.v[F_batch] == 1 ? decode_step_kernel<T, LPK, GM, 1> : decode_step_kernel<T, LPK, GM, MAXB>;
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

template <typename T, int LPK, int MB>
cudaError_t prepare_b(int smem) {
  cudaError_t e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, 2, MB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, 4, MB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(decode_step_kernel<T, LPK, MAXG, MB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return e;
}
template <typename T, int LPK>
cudaError_t prepare_g(int smem) {
  cudaError_t e = prepare_b<T, LPK, 1>(smem);
  return e == cudaSuccess ? prepare_b<T, LPK, MAXB>(smem) : e;
}

}  // namespace

// The library is built as parts compiled at once (step_kernel.py), one object each: STEP_PART = 1..4 holds
// the kernel instances of one (dtype, lanes a key row) with their launch and load functions, STEP_PART = 0
// the entry points, which pick a part by dtype and head dim. Without STEP_PART (one nvcc call), all of it.
#ifndef STEP_PART
#define STEP_PART -1
#endif
#define STEP_PARTS(X) X(1, __nv_bfloat16, 8) X(2, __nv_bfloat16, 16) X(3, float, 16) X(4, float, 32)
#define PART_DECLARE(p, T, LPK)                                                                  \
  cudaError_t step_launch_##p(const int64_t* fields, float eps, float scale_log2, int grid, int smem, \
                              cudaStream_t stream);                                                   \
  cudaError_t step_prepare_##p(int smem);
#define PART_DEFINE(p, T, LPK)                                                                   \
  cudaError_t step_launch_##p(const int64_t* fields, float eps, float scale_log2, int grid, int smem, \
                              cudaStream_t stream) {                                                  \
    Args a;                                                                                           \
    for (int i = 0; i < NUM_FIELDS; ++i) a.v[i] = fields[i];                                          \
    a.eps = eps;                                                                                      \
    a.scale_log2 = scale_log2;                                                                        \
    return launch_g<T, LPK>(a, grid, smem, stream);                                                   \
  }                                                                                                   \
  cudaError_t step_prepare_##p(int smem) { return prepare_g<T, LPK>(smem); }
STEP_PARTS(PART_DECLARE)
#if STEP_PART != 0
#if STEP_PART < 0 || STEP_PART == 1
PART_DEFINE(1, __nv_bfloat16, 8)
#endif
#if STEP_PART < 0 || STEP_PART == 2
PART_DEFINE(2, __nv_bfloat16, 16)
#endif
#if STEP_PART < 0 || STEP_PART == 3
PART_DEFINE(3, float, 16)
#endif
#if STEP_PART < 0 || STEP_PART == 4
PART_DEFINE(4, float, 32)
#endif
#endif

#if STEP_PART <= 0
extern "C" {
// loads every instance and allows it smem bytes of shared memory: done before any CUDA-graph capture, so
// no module loads inside one
int minisgl_step_prepare(int smem) {
  cudaError_t e = step_prepare_1(smem);
  if (e == cudaSuccess) e = step_prepare_2(smem);
  if (e == cudaSuccess) e = step_prepare_3(smem);
  if (e == cudaSuccess) e = step_prepare_4(smem);
  return (int)e;
}

const char* minisgl_step_fields() { return kFieldNames; }
int minisgl_step_threads() { return NT; }
int minisgl_step_max_group() { return MAXG; }
int minisgl_step_max_splits() { return MAXS; }
int minisgl_step_max_batch() { return MAXB; }
int minisgl_step_trace_points() { return STAGES * POINTS; }

// dtype: 0 float32, 1 bfloat16; head dim 64 or 128 (a key row in 8 or 16 lanes' 16 bytes for bf16, 16 or
// 32 for float32)
int minisgl_decode_step(const int64_t* fields, float eps, float scale_log2, int dtype, int grid, int smem,
                        void* stream) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t d = fields[F_head_dim];
  cudaError_t e = cudaErrorInvalidValue;
  if (dtype == 1 && d == 64) e = step_launch_1(fields, eps, scale_log2, grid, smem, s);
  else if (dtype == 1 && d == 128) e = step_launch_2(fields, eps, scale_log2, grid, smem, s);
  else if (dtype == 0 && d == 64) e = step_launch_3(fields, eps, scale_log2, grid, smem, s);
  else if (dtype == 0 && d == 128) e = step_launch_4(fields, eps, scale_log2, grid, smem, s);
  return (int)e;
}

const char* minisgl_step_error(int code) { return cudaGetErrorString((cudaError_t)code); }
}
#endif
