// Multi-tensor squared L2 norm for gradient clipping.
//
// Chunks of all tensors are reduced in parallel, each into kLanes independent fp32 (fp64)
// partial sums so the loop vectorises; the per-chunk results are then added in chunk order in
// fp64, so the result does not depend on the number of threads.
#include "moezero_ops.h"
#include "cpu_utils.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>

namespace moezero {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kLanes = 32;  // independent partial sums: enough vector accumulators to hide add latency

template <typename scalar_t, typename acc_t>
MOEZERO_MULTIVERSION double chunk_sum_of_squares(const void* data, int64_t n) {
  const scalar_t* p = static_cast<const scalar_t*>(data);
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const acc_t v = static_cast<acc_t>(p[i + j]);
      lanes[j] += v * v;
    }
  }
  acc_t sum = 0;
  for (; i < n; ++i) sum += static_cast<acc_t>(p[i]) * static_cast<acc_t>(p[i]);
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return static_cast<double>(sum);
}

using ChunkFn = double (*)(const void*, int64_t);

ChunkFn chunk_fn(at::ScalarType dtype, bool fp64) {
  ChunkFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "moezero_sum_of_squares", [&] {
    fn = fp64 ? &chunk_sum_of_squares<scalar_t, double> : &chunk_sum_of_squares<scalar_t, float>;
  });
  return fn;
}

}  // namespace

at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors) {
  bool fp64 = false;
  for (const at::Tensor& t : tensors) fp64 = fp64 || t.scalar_type() == at::kDouble;
  std::vector<at::Tensor> sources;
  std::vector<ChunkFn> fns;
  std::vector<int64_t> numels;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu(), "sum_of_squares: the CPU kernel got a tensor on ", t.device());
    sources.push_back(t.contiguous());
    fns.push_back(chunk_fn(t.scalar_type(), fp64));
    numels.push_back(t.numel());
  }
  const std::vector<Chunk> chunks = split_into_chunks(numels, kChunk);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  std::vector<double> partial(static_cast<size_t>(num_chunks));
#pragma omp parallel for num_threads(threads_for(num_chunks * kChunk)) schedule(dynamic, 1)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const Chunk& ch = chunks[c];
    const at::Tensor& src = sources[ch.tensor];
    const char* p = static_cast<const char*>(src.data_ptr()) + ch.begin * static_cast<int64_t>(src.element_size());
    partial[c] = fns[ch.tensor](p, ch.end - ch.begin);
  }
  double total = 0;
  for (double v : partial) total += v;
  return at::scalar_tensor(total, at::TensorOptions().dtype(fp64 ? at::kDouble : at::kFloat));
}

}  // namespace moezero
