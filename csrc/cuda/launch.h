// Launchers of the moezero CUDA kernels (EXPERIMENTAL: compiled in CI, not yet run on a GPU).
//
// Pure CUDA on raw pointers and a stream, so the .cu files build with nvcc alone; the torch-facing
// glue is bindings_cuda.cpp. Same contract as moezero/ops/reference.py and csrc/moezero_ops.h.
// Shape letters: T tokens, K top-k, E experts, D hidden, N kept assignments. Every launcher
// returns the first CUDA error it met (cudaSuccess otherwise).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moezero {
namespace cuda {

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

// ---- permute.cu: stable counting sort of the assignments by expert, then a row gather.
// Largest num_experts the sort supports (its per-warp histograms live in shared memory).
constexpr int64_t kMaxPermuteExperts = 1536;
size_t permute_workspace_bytes(int64_t num_assignments, int64_t num_experts);
// ids: T*K int64 (negative = dropped). Writes counts[E], row_map[T*K], src_token[row] for every
// kept row, status[0] = kept rows N, status[1] = number of ids >= E (treated as dropped).
cudaError_t launch_permute_index(const int64_t* ids, int64_t num_assignments, int64_t top_k, int64_t num_experts,
                                 int64_t* counts, int64_t* row_map, int64_t* src_token, int64_t* status,
                                 void* workspace, cudaStream_t stream);
// out[r] = x[src_row[r]] for r < num_rows; rows of row_bytes bytes (any dtype).
cudaError_t launch_gather_rows(const void* x, const int64_t* src_row, int64_t num_rows, int64_t row_bytes,
                               void* out, cudaStream_t stream);

// ---- combine.cu: weights (and grad_w) are in the accumulation dtype: fp64 for fp64 rows, else
// fp32; weights == nullptr means all ones, grad_w == nullptr skips the weight gradient.
cudaError_t launch_unpermute_combine(const void* y_ND, const int64_t* row_map_TK, const void* weights_TK,
                                     void* out_TD, int64_t T, int64_t K, int64_t D, DType dtype,
                                     cudaStream_t stream);
// grad_y must be zeroed beforehand when some of its rows are not addressed by row_map.
cudaError_t launch_unpermute_combine_backward(const void* grad_TD, const void* y_ND, const int64_t* row_map_TK,
                                              const void* weights_TK, void* grad_y_ND, void* grad_w_TK,
                                              int64_t T, int64_t K, int64_t D, DType dtype, cudaStream_t stream);

// ---- flatten.cu / sum_of_squares.cu: multi-tensor ops over a device table of chunks, one block each.
struct TensorChunk {
  const void* src;     // first element of the chunk
  int64_t dst_offset;  // element offset of the chunk in the flat buffer (flatten only)
  int64_t numel;       // at most kChunkElems
  DType dtype;         // of src
};
constexpr int64_t kChunkElems = 1 << 16;

cudaError_t launch_flatten_into(const TensorChunk* chunks, int64_t num_chunks, void* flat, DType flat_dtype,
                                double scale, bool accumulate, cudaStream_t stream);
// partials: num_chunks doubles of scratch; out: one fp32 (fp64 when fp64) scalar.
cudaError_t launch_sum_of_squares(const TensorChunk* chunks, int64_t num_chunks, double* partials, void* out,
                                  bool fp64, cudaStream_t stream);

}  // namespace cuda
}  // namespace moezero
