// Bucket flatten: copy (or accumulate) a list of tensors, scaled and cast, into one flat buffer.
//
// Every tensor is cut into fixed-size chunks and the chunks of all tensors are shared out over
// the threads, so one huge embedding gradient and a hundred small bias gradients both use every
// core. Scale and cast happen in the same pass: one read of the source, one write of the bucket.
#include "moezero_ops.h"
#include "cpu_utils.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <type_traits>

namespace moezero {
namespace {

constexpr int64_t kChunk = 1 << 16;

// fp64 when either side is fp64, else fp32: never round the scale product through bf16.
template <typename src_t, typename dst_t>
using compute_type = std::conditional_t<std::is_same_v<src_t, double> || std::is_same_v<dst_t, double>, double, float>;

template <typename src_t, typename dst_t>
MOEZERO_MULTIVERSION void scale_cast(const void* src_v, void* dst_v, int64_t n, double scale, bool accumulate) {
  using acc_t = compute_type<src_t, dst_t>;
  const src_t* src = static_cast<const src_t*>(src_v);
  dst_t* dst = static_cast<dst_t*>(dst_v);
  const acc_t s = static_cast<acc_t>(scale);
  if constexpr (std::is_same_v<src_t, dst_t>) {
    if (!accumulate && scale == 1.0) {
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(dst_t));
      return;
    }
  }
  if (accumulate) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<dst_t>(static_cast<acc_t>(dst[i]) + s * static_cast<acc_t>(src[i]));
  } else if (scale == 1.0) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<dst_t>(static_cast<acc_t>(src[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<dst_t>(s * static_cast<acc_t>(src[i]));
  }
}

using ChunkFn = void (*)(const void*, void*, int64_t, double, bool);

ChunkFn chunk_fn(at::ScalarType src, at::ScalarType dst) {
  ChunkFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst, "moezero_flatten_dst", [&] {
    using dst_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src, "moezero_flatten_src", [&] {
      fn = &scale_cast<scalar_t, dst_t>;
    });
  });
  return fn;
}

}  // namespace

void flatten_into(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                  const std::vector<int64_t>& offsets, double scale, bool accumulate) {
  TORCH_CHECK(flat.device().is_cpu(), "flatten_into: the CPU kernel got a flat buffer on ", flat.device());
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flatten_into: flat must be a contiguous 1-D tensor");
  TORCH_CHECK(tensors.size() == offsets.size(), "flatten_into: ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  std::vector<at::Tensor> sources;
  std::vector<ChunkFn> fns;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + n <= flat.numel(), "flatten_into: tensor ", i, " (", n,
                " elements at offset ", offsets[i], ") does not fit in flat (", flat.numel(), ")");
    TORCH_CHECK(tensors[i].device() == flat.device(), "flatten_into: tensor ", i, " is not on flat's device");
    sources.push_back(tensors[i].contiguous());
    fns.push_back(chunk_fn(tensors[i].scalar_type(), flat.scalar_type()));
    numels.push_back(n);
  }
  const std::vector<Chunk> chunks = split_into_chunks(numels, kChunk);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t dst_size = static_cast<int64_t>(flat.element_size());
#pragma omp parallel for num_threads(threads_for(num_chunks * kChunk)) schedule(dynamic, 1)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const Chunk& ch = chunks[c];
    const at::Tensor& src = sources[ch.tensor];
    const char* src_ptr = static_cast<const char*>(src.data_ptr()) + ch.begin * static_cast<int64_t>(src.element_size());
    char* dst_ptr = base + (offsets[ch.tensor] + ch.begin) * dst_size;
    fns[ch.tensor](src_ptr, dst_ptr, ch.end - ch.begin, scale, accumulate);
  }
}

}  // namespace moezero
