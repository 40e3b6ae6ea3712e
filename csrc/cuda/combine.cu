// Un-permute with the weighted top-k combine, and its backward, on the GPU
// (EXPERIMENTAL: not yet run on a GPU).
//
// One block per token, threads across the hidden dim: the forward sums the token's K expert
// rows in fp32 (fp64) registers; the backward writes each expert row's gradient and reduces the
// routing-weight dot product over the block in the same sweep.
#include "common.cuh"

namespace moezero {
namespace cuda {
namespace {

template <typename T>
__global__ void combine_kernel(const T* y, const int64_t* rows, const acc_t<T>* w, T* out,
                               int64_t num_tokens, int64_t K, int64_t D) {
  using A = acc_t<T>;
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      A acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = rows[t * K + k];
        if (r >= 0) acc += (w ? w[t * K + k] : A(1)) * static_cast<A>(widen(y[r * D + d]));
      }
      out[t * D + d] = narrow<T>(acc);
    }
  }
}

template <typename T>
__global__ void combine_backward_kernel(const T* grad, const T* y, const int64_t* rows, const acc_t<T>* w,
                                        T* grad_y, acc_t<T>* grad_w, int64_t num_tokens, int64_t K, int64_t D) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = rows[t * K + k];  // uniform over the block, so block_sum below is safe
      if (r < 0) {
        if (grad_w && threadIdx.x == 0) grad_w[t * K + k] = 0;
        continue;
      }
      const A wk = w ? w[t * K + k] : A(1);
      A dot = 0;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        const A g = static_cast<A>(widen(grad[t * D + d]));
        grad_y[r * D + d] = narrow<T>(wk * g);
        dot += g * static_cast<A>(widen(y[r * D + d]));
      }
      if (grad_w) {
        dot = block_sum(dot, scratch);
        if (threadIdx.x == 0) grad_w[t * K + k] = dot;
      }
    }
  }
}

}  // namespace

cudaError_t launch_unpermute_combine(const void* y_ND, const int64_t* row_map_TK, const void* weights_TK,
                                     void* out_TD, int64_t T, int64_t K, int64_t D, DType dtype,
                                     cudaStream_t stream) {
  if (T == 0 || D == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    combine_kernel<S><<<grid_for(T), kThreads, 0, stream>>>(
        static_cast<const S*>(y_ND), row_map_TK, static_cast<const acc_t<S>*>(weights_TK), static_cast<S*>(out_TD),
        T, K, D);
  });
}

cudaError_t launch_unpermute_combine_backward(const void* grad_TD, const void* y_ND, const int64_t* row_map_TK,
                                              const void* weights_TK, void* grad_y_ND, void* grad_w_TK,
                                              int64_t T, int64_t K, int64_t D, DType dtype, cudaStream_t stream) {
  if (T == 0 || K == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    combine_backward_kernel<S><<<grid_for(T), kThreads, 0, stream>>>(
        static_cast<const S*>(grad_TD), static_cast<const S*>(y_ND), row_map_TK,
        static_cast<const acc_t<S>*>(weights_TK), static_cast<S*>(grad_y_ND), static_cast<acc_t<S>*>(grad_w_TK),
        T, K, D);
  });
}

}  // namespace cuda
}  // namespace moezero
