// What one all-to-all hop between the resident blocks of a persistent kernel costs, by the way its words are
// passed: the question behind folding a projection into the stage before it (kernel/cuda/decode_step.cu),
// where every block would add its part of every output instead of writing its own outputs.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/hop_probe minisgl/benchmark/hop_probe.cu
//   /tmp/hop_probe
//
// One block an SM (or half of them), 480 threads, ROUNDS rounds of one hop over N words each, the block's
// threads meeting at a barrier between rounds as a stage's do; the best of three launches, a round's time:
//   tagged   the step kernel's way: a block stores its N / G words (a bf16 value and a 16-bit tag in 32 bits),
//            every block loads all N until each carries the round's tag (two buffers in turn)
//   counted  every block adds its part of all N words into 64-bit words (the sum in fixed point above a
//            16-bit count; red.add.u64), every block loads all N until each count is G
//   quarter  the same with a quarter of the blocks adding (the atomics' share of the cost)
//   counter  every block adds float parts (red.add.v4.f32), then a fence and one counter a block; every
//            block polls the counter with one thread, then loads all N
// and within a thread-block cluster of C blocks (C = 2..16, one block an SM, as many clusters as fit at once):
//   cluster barrier  a block stores its N / C words into the shared memory of every block of its cluster
//                    (distributed shared memory), then the cluster's barrier (arrive.release, wait.acquire);
//                    every block reads its N words from its own shared memory
//   cluster tagged   the same stores as tagged words, no barrier: every block polls its own shared memory
// beside the tagged hop through L2 among C blocks alone, and how many SMs the clusters of C hold at once
// (all that a persistent kernel of such clusters could use).
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdio>

namespace {

constexpr int NT = 512, CT = 480, ROUNDS = 2000, NMAX = 4096;
enum Mode { TAGGED, COUNTED, QUARTER, COUNTER, MODES };
const char* kNames[MODES] = {"tagged", "counted", "quarter", "counter"};

__device__ __forceinline__ void st32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld4(const unsigned* p) {
  uint4 u;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p) : "memory");
  return u;
}
__device__ __forceinline__ ulonglong2 ld2(const unsigned long long* p) {
  ulonglong2 u;
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];" : "=l"(u.x), "=l"(u.y) : "l"(p) : "memory");
  return u;
}
__device__ __forceinline__ void red64(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red4(float* p, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned x;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
  return x;
}
// all four tagged words carry the round's tag
__device__ __forceinline__ bool tagged4(uint4 u, unsigned tag) {
  return (u.x & 0xffffu) == tag && (u.y & 0xffffu) == tag && (u.z & 0xffffu) == tag && (u.w & 0xffffu) == tag;
}
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"n"(CT) : "memory"); }

// words: 2 x NMAX tagged words, then ROUNDS counters; sums: ROUNDS x N 64-bit words (or floats), zeroed
__global__ void __launch_bounds__(NT, 1) hop(int mode, int n, unsigned* words, unsigned long long* sums, float* sink) {
  if (threadIdx.x >= CT) return;
  const int g = gridDim.x, b = blockIdx.x;
  float acc = 0.f;  // what the reads sum, so none is optimised away
  for (int r = 0; r < ROUNDS; ++r) {
    if (mode == TAGGED) {
      const unsigned tag = (r + 1) & 0xffffu;
      unsigned* w = words + (r & 1) * NMAX;  // a round's stores wait (through its reads) for the last round's
      for (int i = b * n / g + threadIdx.x; i < (b + 1) * n / g; i += CT)
        st32(w + i, (__float_as_uint(acc + i) & 0xffff0000u) | tag);
      for (int c = threadIdx.x * 4; c < n; c += CT * 4) {
        uint4 u = ld4(w + c);
        while (!tagged4(u, tag)) {
          __nanosleep(32);
          u = ld4(w + c);
        }
        acc += __uint_as_float(u.x & 0xffff0000u) + __uint_as_float(u.w & 0xffff0000u);
      }
    } else if (mode == COUNTER) {
      float* f = reinterpret_cast<float*>(sums) + (size_t)r * n;
      unsigned* count = words + 2 * NMAX + r;
      for (int c = threadIdx.x * 4; c < n; c += CT * 4) red4(f + c, acc, acc + 1.f, acc + 2.f, acc + 3.f);
      csync();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        while (ld_acquire(count) < (unsigned)g) __nanosleep(32);
      }
      csync();
      const unsigned* fw = reinterpret_cast<const unsigned*>(f);
      for (int c = threadIdx.x * 4; c < n; c += CT * 4) acc += __uint_as_float(ld4(fw + c).x) * 1e-9f;
    } else {
      unsigned long long* s = sums + (size_t)r * n;
      const int every = mode == QUARTER ? 4 : 1, adders = (g + every - 1) / every;
      if (b % every == 0)
        for (int i = threadIdx.x; i < n; i += CT)
          red64(s + i, (static_cast<unsigned long long>(static_cast<long long>(acc * 16.f + i)) << 16) + 1ull);
      for (int c = threadIdx.x * 2; c < n; c += CT * 2) {
        ulonglong2 u = ld2(s + c);
        while ((u.x & 0xffffu) != (unsigned)adders || (u.y & 0xffffu) != (unsigned)adders) {
          __nanosleep(32);
          u = ld2(s + c);
        }
        acc += static_cast<float>(static_cast<long long>(u.x) >> 16) * 1e-9f;
      }
    }
    csync();
  }
  if (acc == 12345.f) sink[0] = acc;
}

__device__ __forceinline__ uint4 lds4(const unsigned* p) {  // this block's shared memory, as it is now
  uint4 u;
  asm volatile("ld.volatile.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
  return u;
}
// the cluster hop: 2 x NMAX words of dynamic shared memory, a round's buffer in turn (a round's stores
// follow, through the barrier before them, every block's reads of the buffer two rounds back)
__global__ void __launch_bounds__(NT, 1) cluster_hop(int n, int tagged, float* sink) {
  extern __shared__ unsigned smem[];
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  const int c = (int)cl.num_blocks(), rank = (int)cl.block_rank();
  for (int i = threadIdx.x; i < 2 * NMAX; i += NT) smem[i] = 0;  // no stale tag passes round 0
  cl.sync();
  float acc = 0.f;
  for (int r = 0; r < ROUNDS; ++r) {
    unsigned* buf = smem + (r & 1) * NMAX;
    const unsigned tag = (r + 1) & 0xffffu;
    for (int peer = 0; peer < c; ++peer) {
      volatile unsigned* remote = cl.map_shared_rank(buf, peer);
      for (int i = rank * n / c + threadIdx.x; i < (rank + 1) * n / c; i += NT)
        remote[i] = tagged ? (__float_as_uint(acc + i) & 0xffff0000u) | tag : __float_as_uint(acc + i);
    }
    if (!tagged) cl.sync();
    for (int i = threadIdx.x * 4; i < n; i += NT * 4) {
      uint4 u = lds4(buf + i);
      while (tagged && !tagged4(u, tag)) u = lds4(buf + i);
      acc += __uint_as_float(u.x & 0xffff0000u) * 1e-9f + __uint_as_float(u.w & 0xffff0000u) * 1e-9f;
    }
    if (tagged) __syncthreads();  // as a stage's threads meet before the next
  }
  cl.sync();  // no block leaves while another may still store into its shared memory
  if (acc == 12345.f) sink[0] = acc;
}

// one launch's time in milliseconds between two events; negative (and the error printed) if it failed
template <typename F>
float timed(cudaEvent_t e0, cudaEvent_t e1, F&& launch) {
  cudaEventRecord(e0);
  launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  if (cudaError_t err = cudaGetLastError()) {
    std::printf("error: %s\n", cudaGetErrorString(err));
    return -1.f;
  }
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms;
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* words;
  unsigned long long* sums;
  float* sink;
  const size_t words_bytes = (2 * NMAX + ROUNDS) * sizeof(unsigned);
  cudaMalloc(&words, words_bytes);
  cudaMalloc(&sums, (size_t)ROUNDS * NMAX * sizeof(unsigned long long));
  cudaMalloc(&sink, sizeof(float));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int g : {sms, sms / 2}) {
    for (int n : {1024, 2048, 3072}) {
      for (int mode = 0; mode < MODES; ++mode) {
        float best = 1e30f;
        for (int rep = 0; rep < 3; ++rep) {
          cudaMemset(words, 0, words_bytes);
          cudaMemset(sums, 0, (size_t)ROUNDS * n * sizeof(unsigned long long));
          const float ms = timed(e0, e1, [&] { hop<<<g, NT>>>(mode, n, words, sums, sink); });
          if (ms < 0.f) return 1;
          best = ms < best ? ms : best;
        }
        std::printf("blocks %3d  words %4d  %-8s %.3f us a hop\n", g, n, kNames[mode], best * 1e3f / ROUNDS);
      }
    }
  }
  // within clusters
  // shared memory for one block an SM (as the step kernel takes), of which the hop uses 2 x NMAX words
  const int smem = 160 * 1024;
  cudaFuncSetAttribute(cluster_hop, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(cluster_hop, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int c : {2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = c;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(NT);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(c);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, cluster_hop, &cfg) != cudaSuccess || clusters == 0) {
      std::printf("cluster %2d: not launchable (%s)\n", c, cudaGetErrorString(cudaGetLastError()));
      continue;
    }
    cfg.gridDim = dim3(c * clusters);
    for (int n : {512, 1024, 2048, 4096}) {
      float best = 1e30f, best_tagged = 1e30f;
      for (int rep = 0; rep < 6; ++rep) {
        const float ms = timed(e0, e1, [&] { cudaLaunchKernelEx(&cfg, cluster_hop, n, rep & 1, sink); });
        if (ms < 0.f) return 1;
        float& b = rep & 1 ? best_tagged : best;
        b = ms < b ? ms : b;
      }
      float tagged = 1e30f;  // the tagged hop among C blocks alone
      for (int rep = 0; rep < 3; ++rep) {
        cudaMemset(words, 0, words_bytes);
        const float ms = timed(e0, e1, [&] { hop<<<c, NT>>>(TAGGED, n, words, sums, sink); });
        if (ms < 0.f) return 1;
        tagged = ms < tagged ? ms : tagged;
      }
      std::printf(
          "cluster %2d x %2d clusters (%3d SMs)  words %4d  cluster barrier %.3f us a hop, cluster tagged %.3f, "
          "tagged in L2 among %2d blocks %.3f\n",
          c, clusters, c * clusters, n, best * 1e3f / ROUNDS, best_tagged * 1e3f / ROUNDS, c, tagged * 1e3f / ROUNDS);
    }
  }
  return 0;
}
