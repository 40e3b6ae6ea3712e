// Multi-tensor squared L2 norm on the GPU (EXPERIMENTAL: not yet run on a GPU).
//
// One block per chunk writes a partial sum (fp32 or fp64 accumulation), then a single block adds
// the partials in fp64 in a fixed order, so the result is deterministic and needs no atomics.
#include "common.cuh"

namespace moezero {
namespace cuda {
namespace {

template <typename S, typename A>
__device__ A chunk_sum_of_squares(const TensorChunk& chunk) {
  const S* p = static_cast<const S*>(chunk.src);
  A sum = 0;
  for (int64_t i = threadIdx.x; i < chunk.numel; i += blockDim.x) {
    const A v = static_cast<A>(widen(p[i]));
    sum += v * v;
  }
  return sum;
}

template <typename A>
__global__ void partial_sums_kernel(const TensorChunk* chunks, double* partials) {
  __shared__ A scratch[32];
  const TensorChunk chunk = chunks[blockIdx.x];
  A sum = 0;
  switch (chunk.dtype) {  // uniform over the block
    case DType::kFloat32: sum = chunk_sum_of_squares<float, A>(chunk); break;
    case DType::kFloat64: sum = chunk_sum_of_squares<double, A>(chunk); break;
    case DType::kBFloat16: sum = chunk_sum_of_squares<__nv_bfloat16, A>(chunk); break;
    case DType::kFloat16: sum = chunk_sum_of_squares<__half, A>(chunk); break;
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = static_cast<double>(sum);
}

__global__ void total_kernel(const double* partials, int64_t n, void* out, bool fp64) {
  __shared__ double scratch[32];
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum, scratch);
  if (threadIdx.x != 0) return;
  if (fp64) *static_cast<double*>(out) = sum;
  else *static_cast<float*>(out) = static_cast<float>(sum);
}

}  // namespace

cudaError_t launch_sum_of_squares(const TensorChunk* chunks, int64_t num_chunks, double* partials, void* out,
                                  bool fp64, cudaStream_t stream) {
  if (num_chunks > 0x7fffffff) return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaMemsetAsync(out, 0, fp64 ? sizeof(double) : sizeof(float), stream);
  const unsigned int grid = static_cast<unsigned int>(num_chunks);
  if (fp64) partial_sums_kernel<double><<<grid, kThreads, 0, stream>>>(chunks, partials);
  else partial_sums_kernel<float><<<grid, kThreads, 0, stream>>>(chunks, partials);
  total_kernel<<<1, kThreads, 0, stream>>>(partials, num_chunks, out, fp64);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moezero
