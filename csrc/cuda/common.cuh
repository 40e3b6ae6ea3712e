// Device helpers shared by the moezero CUDA kernels: dtype dispatch, conversions, block sums.
// Only explicit conversion intrinsics are used, because torch builds with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "launch.h"

namespace moezero {
namespace cuda {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) for the C++ type of `dtype`; then reports launch errors.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(Tag<float>{}); break;
    case DType::kFloat64: f(Tag<double>{}); break;
    case DType::kBFloat16: f(Tag<__nv_bfloat16>{}); break;
    case DType::kFloat16: f(Tag<__half>{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// fp64 rows accumulate in fp64, all others in fp32 (as the reference does).
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }

template <typename T>
struct Narrow {
  template <typename A>
  __device__ static T of(A v) { return static_cast<T>(v); }
};
template <>
struct Narrow<__nv_bfloat16> {
  template <typename A>
  __device__ static __nv_bfloat16 of(A v) { return __float2bfloat16(static_cast<float>(v)); }
};
template <>
struct Narrow<__half> {
  template <typename A>
  __device__ static __half of(A v) { return __float2half(static_cast<float>(v)); }
};

template <typename T, typename A>
__device__ __forceinline__ T narrow(A v) { return Narrow<T>::of(v); }

// Sum of v over the block, valid in thread 0. Every thread must call it; blockDim.x % 32 == 0.
template <typename A>
__device__ A block_sum(A v, A* scratch /* 32 entries of shared memory */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : A(0);
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

inline unsigned int grid_for(int64_t items) {
  return static_cast<unsigned int>(items < kMaxBlocks ? (items > 0 ? items : 1) : kMaxBlocks);
}

}  // namespace cuda
}  // namespace moezero
