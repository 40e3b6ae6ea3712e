// Bucket flatten on the GPU (EXPERIMENTAL: not yet run on a GPU): one block per chunk of a
// device-side chunk table, so a whole list of gradients is scaled, cast and copied (or added)
// into the flat bucket by a single launch.
#include "common.cuh"

namespace moezero {
namespace cuda {
namespace {

// fp64 when either side is fp64, else fp32: never round the scale product through bf16.
template <typename Src, typename Dst>
using compute_t = std::conditional_t<std::is_same_v<Src, double> || std::is_same_v<Dst, double>, double, float>;

template <typename Src, typename Dst>
__device__ void flatten_chunk(const TensorChunk& chunk, Dst* flat, double scale, bool accumulate) {
  using A = compute_t<Src, Dst>;
  const Src* src = static_cast<const Src*>(chunk.src);
  Dst* dst = flat + chunk.dst_offset;
  const A s = static_cast<A>(scale);
  for (int64_t i = threadIdx.x; i < chunk.numel; i += blockDim.x) {
    const A v = s * static_cast<A>(widen(src[i]));
    dst[i] = narrow<Dst>(accumulate ? static_cast<A>(widen(dst[i])) + v : v);
  }
}

template <typename Dst>
__global__ void flatten_kernel(const TensorChunk* chunks, Dst* flat, double scale, bool accumulate) {
  const TensorChunk chunk = chunks[blockIdx.x];
  switch (chunk.dtype) {  // uniform over the block: no divergence
    case DType::kFloat32: flatten_chunk<float>(chunk, flat, scale, accumulate); break;
    case DType::kFloat64: flatten_chunk<double>(chunk, flat, scale, accumulate); break;
    case DType::kBFloat16: flatten_chunk<__nv_bfloat16>(chunk, flat, scale, accumulate); break;
    case DType::kFloat16: flatten_chunk<__half>(chunk, flat, scale, accumulate); break;
  }
}

}  // namespace

cudaError_t launch_flatten_into(const TensorChunk* chunks, int64_t num_chunks, void* flat, DType flat_dtype,
                                double scale, bool accumulate, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  if (num_chunks > 0x7fffffff) return cudaErrorInvalidValue;
  return dispatch_dtype(flat_dtype, [&](auto tag) {
    using D = typename decltype(tag)::type;
    flatten_kernel<D><<<static_cast<unsigned int>(num_chunks), kThreads, 0, stream>>>(
        chunks, static_cast<D*>(flat), scale, accumulate);
  });
}

}  // namespace cuda
}  // namespace moezero
