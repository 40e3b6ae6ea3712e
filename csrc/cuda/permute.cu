// Token permute on the GPU (EXPERIMENTAL: not yet run on a GPU): a stable counting sort.
//
// The assignments are cut into tiles of kThreads, one block each. (1) Each block counts its
// experts. (2) One block scans the (expert, tile) counts in expert-major order into each tile's
// first row per expert. (3) Each block ranks every assignment among the earlier ones of the same
// expert in its tile (warp match + per-warp histograms), which keeps the flat t * K + k order.
// (4) A gather copies each kept row. No sort of T*K keys, no global atomics on the hot path.
#include "common.cuh"

namespace moezero {
namespace cuda {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 1024;

int64_t num_tiles(int64_t n) { return (n + kThreads - 1) / kThreads; }

__global__ void count_tile_experts(const int64_t* ids, int64_t n, int64_t E, int64_t* tile_counts,
                                   int64_t* status) {
  extern __shared__ int hist[];  // E
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i < n) {
    const int64_t e = ids[i];
    if (e >= E) atomicAdd(reinterpret_cast<unsigned long long*>(status + 1), 1ull);
    else if (e >= 0) atomicAdd(hist + e, 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) tile_counts[e * gridDim.x + blockIdx.x] = hist[e];
}

// In-place exclusive scan of the m = E * tiles counts (one block); offsets[m] = total.
__global__ void scan_tile_offsets(int64_t* offsets, int64_t E, int64_t tiles, int64_t* counts, int64_t* status) {
  __shared__ int64_t sums[kScanThreads];
  const int64_t m = E * tiles, per = (m + kScanThreads - 1) / kScanThreads;
  const int64_t begin = min(m, threadIdx.x * per), end = min(m, begin + per);
  int64_t s = 0;
  for (int64_t i = begin; i < end; ++i) s += offsets[i];
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int o = 1; o < kScanThreads; o <<= 1) {  // Hillis-Steele inclusive scan of the thread sums
    const int64_t v = threadIdx.x >= o ? sums[threadIdx.x - o] : 0;
    __syncthreads();
    sums[threadIdx.x] += v;
    __syncthreads();
  }
  int64_t run = threadIdx.x ? sums[threadIdx.x - 1] : 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t c = offsets[i];
    offsets[i] = run;
    run += c;
  }
  if (threadIdx.x == kScanThreads - 1) {
    offsets[m] = sums[threadIdx.x];
    status[0] = sums[threadIdx.x];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += kScanThreads) counts[e] = offsets[(e + 1) * tiles] - offsets[e * tiles];
}

__global__ void place_tile_rows(const int64_t* ids, int64_t n, int64_t K, int64_t E, const int64_t* offsets,
                                int64_t* row_map, int64_t* src_token) {
  extern __shared__ int warp_hist[];  // kWarps * E
  for (int64_t j = threadIdx.x; j < kWarps * E; j += blockDim.x) warp_hist[j] = 0;
  __syncthreads();
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  int64_t e = i < n ? ids[i] : -1;
  if (e < 0 || e >= E) e = -1;  // dropped (ids >= E are counted in status[1]; the caller raises)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned peers = __match_any_sync(0xffffffffu, static_cast<unsigned long long>(e));
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank == 0) warp_hist[warp * E + e] = __popc(peers);
  __syncthreads();
  if (i >= n) return;
  if (e < 0) {
    row_map[i] = -1;
    return;
  }
  int64_t row = offsets[e * gridDim.x + blockIdx.x] + rank;
  for (int w = 0; w < warp; ++w) row += warp_hist[w * E + e];
  row_map[i] = row;
  src_token[row] = i / K;
}

template <typename V>
__global__ void gather_rows(const V* x, const int64_t* src_row, int64_t num_rows, int64_t row_vecs, V* out) {
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const V* src = x + src_row[r] * row_vecs;
    V* dst = out + r * row_vecs;
    for (int64_t j = threadIdx.x; j < row_vecs; j += blockDim.x) dst[j] = src[j];
  }
}

template <typename V>
bool fits(const void* x, const void* out, int64_t row_bytes) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % sizeof(V) == 0; };
  return row_bytes % static_cast<int64_t>(sizeof(V)) == 0 && aligned(x) && aligned(out);
}

template <typename V>
void launch_gather(const void* x, const int64_t* src_row, int64_t num_rows, int64_t row_bytes, void* out,
                   cudaStream_t stream) {
  gather_rows<V><<<grid_for(num_rows), kThreads, 0, stream>>>(
      static_cast<const V*>(x), src_row, num_rows, row_bytes / static_cast<int64_t>(sizeof(V)), static_cast<V*>(out));
}

}  // namespace

size_t permute_workspace_bytes(int64_t num_assignments, int64_t num_experts) {
  return static_cast<size_t>(num_experts * num_tiles(num_assignments) + 1) * sizeof(int64_t);
}

cudaError_t launch_permute_index(const int64_t* ids, int64_t num_assignments, int64_t top_k, int64_t num_experts,
                                 int64_t* counts, int64_t* row_map, int64_t* src_token, int64_t* status,
                                 void* workspace, cudaStream_t stream) {
  if (num_experts > kMaxPermuteExperts || (top_k <= 0 && num_assignments > 0)) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(status, 0, 2 * sizeof(int64_t), stream);
  if (err == cudaSuccess && num_experts > 0) err = cudaMemsetAsync(counts, 0, num_experts * sizeof(int64_t), stream);
  if (err != cudaSuccess || num_assignments == 0) return err;
  const int64_t tiles = num_tiles(num_assignments);
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  int64_t* offsets = static_cast<int64_t*>(workspace);
  const size_t hist_bytes = num_experts * sizeof(int);
  count_tile_experts<<<tiles, kThreads, hist_bytes, stream>>>(ids, num_assignments, num_experts, offsets, status);
  scan_tile_offsets<<<1, kScanThreads, 0, stream>>>(offsets, num_experts, tiles, counts, status);
  place_tile_rows<<<tiles, kThreads, kWarps * hist_bytes, stream>>>(ids, num_assignments, top_k, num_experts,
                                                                    offsets, row_map, src_token);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const void* x, const int64_t* src_row, int64_t num_rows, int64_t row_bytes,
                               void* out, cudaStream_t stream) {
  if (num_rows == 0 || row_bytes == 0) return cudaSuccess;
  if (fits<uint4>(x, out, row_bytes)) launch_gather<uint4>(x, src_row, num_rows, row_bytes, out, stream);
  else if (fits<uint2>(x, out, row_bytes)) launch_gather<uint2>(x, src_row, num_rows, row_bytes, out, stream);
  else if (fits<unsigned int>(x, out, row_bytes)) launch_gather<unsigned int>(x, src_row, num_rows, row_bytes, out, stream);
  else if (fits<unsigned short>(x, out, row_bytes)) launch_gather<unsigned short>(x, src_row, num_rows, row_bytes, out, stream);
  else launch_gather<unsigned char>(x, src_row, num_rows, row_bytes, out, stream);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moezero
