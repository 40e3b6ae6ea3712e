// Torch-facing glue of the CUDA kernels (module moezero._C_cuda; EXPERIMENTAL: not yet run on a
// GPU). Built only when torch has CUDA. Same functions and signatures as the CPU module
// (csrc/bindings.cpp): checks, output allocation, and the launch on torch's current stream.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "launch.h"

namespace moezero {
namespace {

namespace mc = moezero::cuda;

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "moezero CUDA ", what, ": ", cudaGetErrorString(err));
}

mc::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return mc::DType::kFloat32;
    case at::kDouble: return mc::DType::kFloat64;
    case at::kBFloat16: return mc::DType::kBFloat16;
    case at::kHalf: return mc::DType::kFloat16;
    default: TORCH_CHECK(false, "moezero CUDA kernels support fp32/fp64/bf16/fp16, not ", t);
  }
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute(const at::Tensor& x_TD, const at::Tensor& topk_ids_TK,
                                                       int64_t num_experts) {
  TORCH_CHECK(x_TD.dim() == 2 && topk_ids_TK.dim() == 2 && x_TD.size(0) == topk_ids_TK.size(0),
              "permute: x_TD [T, D] and topk_ids_TK [T, K] must agree on T");
  TORCH_CHECK(num_experts <= mc::kMaxPermuteExperts, "permute: num_experts (", num_experts,
              ") exceeds the CUDA kernel's limit (", mc::kMaxPermuteExperts, ")");
  const c10::cuda::CUDAGuard guard(x_TD.device());
  const at::Tensor x = x_TD.contiguous(), ids = topk_ids_TK.to(at::kLong).contiguous();
  const int64_t T = ids.size(0), K = ids.size(1), n = T * K, D = x.size(1);
  const auto longs = ids.options();
  at::Tensor counts = at::empty({num_experts}, longs), row_map = at::empty({T, K}, longs);
  at::Tensor src_token = at::empty({n}, longs), status = at::empty({2}, longs);
  at::Tensor workspace = at::empty({static_cast<int64_t>(mc::permute_workspace_bytes(n, num_experts))},
                                   longs.dtype(at::kByte));
  check_cuda(mc::launch_permute_index(ids.data_ptr<int64_t>(), n, K, num_experts, counts.data_ptr<int64_t>(),
                                      row_map.data_ptr<int64_t>(), src_token.data_ptr<int64_t>(),
                                      status.data_ptr<int64_t>(), workspace.data_ptr(), stream()),
             "permute");
  const at::Tensor host = status.cpu();  // the row count sizes the output: one sync, as in the reference
  TORCH_CHECK(host[1].item<int64_t>() == 0, "permute: an expert id is >= num_experts (", num_experts, ")");
  at::Tensor out = at::empty({host[0].item<int64_t>(), D}, x.options());
  check_cuda(mc::launch_gather_rows(x.data_ptr(), src_token.data_ptr<int64_t>(), out.size(0),
                                    D * static_cast<int64_t>(x.element_size()), out.data_ptr(), stream()),
             "permute gather");
  return {out, counts, row_map};
}

void check_combine_args(const at::Tensor& y_ND, const at::Tensor& row_map_TK,
                        const std::optional<at::Tensor>& weights_TK) {
  TORCH_CHECK(y_ND.dim() == 2 && row_map_TK.dim() == 2 && row_map_TK.scalar_type() == at::kLong,
              "unpermute_combine: y_ND [N, D] and int64 row_map_TK [T, K] expected");
  TORCH_CHECK(!weights_TK || weights_TK->sizes() == row_map_TK.sizes(),
              "unpermute_combine: weights_TK must have row_map_TK's shape");
}

std::optional<at::Tensor> weights_as(const std::optional<at::Tensor>& weights_TK, at::ScalarType acc) {
  if (!weights_TK) return std::nullopt;
  return weights_TK->to(acc).contiguous();
}

at::Tensor unpermute_combine(const at::Tensor& y_ND, const at::Tensor& row_map_TK,
                             const std::optional<at::Tensor>& weights_TK) {
  check_combine_args(y_ND, row_map_TK, weights_TK);
  const c10::cuda::CUDAGuard guard(y_ND.device());
  const at::Tensor y = y_ND.contiguous(), rows = row_map_TK.contiguous();
  const int64_t T = rows.size(0), K = rows.size(1), D = y.size(1);
  const auto w = weights_as(weights_TK, acc_dtype(y.scalar_type()));
  at::Tensor out = at::empty({T, D}, y.options());
  check_cuda(mc::launch_unpermute_combine(y.data_ptr(), rows.data_ptr<int64_t>(), w ? w->data_ptr() : nullptr,
                                          out.data_ptr(), T, K, D, dtype_of(y.scalar_type()), stream()),
             "unpermute_combine");
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> unpermute_combine_backward(
    const at::Tensor& grad_TD, const at::Tensor& y_ND, const at::Tensor& row_map_TK,
    const std::optional<at::Tensor>& weights_TK) {
  check_combine_args(y_ND, row_map_TK, weights_TK);
  const c10::cuda::CUDAGuard guard(y_ND.device());
  const at::Tensor y = y_ND.contiguous(), rows = row_map_TK.contiguous();
  const at::Tensor grad = grad_TD.to(y.scalar_type()).contiguous();
  const int64_t T = rows.size(0), K = rows.size(1), D = y.size(1);
  const at::ScalarType acc = acc_dtype(y.scalar_type());
  const auto w = weights_as(weights_TK, acc);
  at::Tensor grad_y = at::zeros_like(y);  // rows no assignment maps to stay zero; a memset is cheap here
  std::optional<at::Tensor> grad_w;
  if (w) grad_w = at::empty({T, K}, y.options().dtype(acc));
  check_cuda(mc::launch_unpermute_combine_backward(grad.data_ptr(), y.data_ptr(), rows.data_ptr<int64_t>(),
                                                   w ? w->data_ptr() : nullptr, grad_y.data_ptr(),
                                                   grad_w ? grad_w->data_ptr() : nullptr, T, K, D,
                                                   dtype_of(y.scalar_type()), stream()),
             "unpermute_combine_backward");
  if (grad_w) grad_w = grad_w->to(weights_TK->scalar_type());
  return {grad_y, grad_w};
}

// The chunk table of a tensor list, copied to `device` (a synchronous copy from pageable memory).
at::Tensor chunk_table(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                       const at::Device& device) {
  std::vector<mc::TensorChunk> chunks;
  for (size_t i = 0; i < sources.size(); ++i) {
    const char* base = static_cast<const char*>(sources[i].data_ptr());
    const int64_t n = sources[i].numel(), item = static_cast<int64_t>(sources[i].element_size());
    for (int64_t b = 0; b < n; b += mc::kChunkElems) {
      chunks.push_back({base + b * item, offsets[i] + b, std::min(mc::kChunkElems, n - b),
                        dtype_of(sources[i].scalar_type())});
    }
  }
  const int64_t bytes = static_cast<int64_t>(chunks.size() * sizeof(mc::TensorChunk));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  if (bytes) std::memcpy(host.data_ptr(), chunks.data(), static_cast<size_t>(bytes));
  return host.to(device);
}

int64_t num_chunks(const at::Tensor& table) {
  return table.numel() / static_cast<int64_t>(sizeof(mc::TensorChunk));
}

void flatten_into(at::Tensor flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
                  double scale, bool accumulate) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flatten_into: flat must be a contiguous 1-D tensor");
  TORCH_CHECK(tensors.size() == offsets.size(), "flatten_into: one offset per tensor expected");
  const c10::cuda::CUDAGuard guard(flat.device());
  std::vector<at::Tensor> sources;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == flat.device(), "flatten_into: tensor ", i, " is not on flat's device");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), "flatten_into: tensor ", i,
                " does not fit in flat at offset ", offsets[i]);
    sources.push_back(tensors[i].contiguous());
  }
  const at::Tensor table = chunk_table(sources, offsets, flat.device());
  check_cuda(mc::launch_flatten_into(static_cast<const mc::TensorChunk*>(table.data_ptr()), num_chunks(table),
                                     flat.data_ptr(), dtype_of(flat.scalar_type()), scale, accumulate, stream()),
             "flatten_into");
}

at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "sum_of_squares: empty tensor list");
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  bool fp64 = false;
  std::vector<at::Tensor> sources;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == device, "sum_of_squares: all tensors must be on ", device);
    fp64 = fp64 || t.scalar_type() == at::kDouble;
    sources.push_back(t.contiguous());
  }
  const at::Tensor table = chunk_table(sources, std::vector<int64_t>(sources.size(), 0), device);
  const auto options = at::TensorOptions().device(device);
  at::Tensor partials = at::empty({std::max<int64_t>(num_chunks(table), 1)}, options.dtype(at::kDouble));
  at::Tensor out = at::empty({}, options.dtype(fp64 ? at::kDouble : at::kFloat));
  check_cuda(mc::launch_sum_of_squares(static_cast<const mc::TensorChunk*>(table.data_ptr()), num_chunks(table),
                                       partials.data_ptr<double>(), out.data_ptr(), fp64, stream()),
             "sum_of_squares");
  return out;
}

}  // namespace
}  // namespace moezero

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moezero CUDA kernels (experimental): same API as moezero._C";
  m.def("permute", &moezero::permute, py::arg("x_TD"), py::arg("topk_ids_TK"), py::arg("num_experts"));
  m.def("unpermute_combine", &moezero::unpermute_combine, py::arg("y_ND"), py::arg("row_map_TK"),
        py::arg("weights_TK"));
  m.def("unpermute_combine_backward", &moezero::unpermute_combine_backward, py::arg("grad_TD"), py::arg("y_ND"),
        py::arg("row_map_TK"), py::arg("weights_TK"));
  m.def("flatten_into", &moezero::flatten_into, py::arg("flat"), py::arg("tensors"), py::arg("offsets"),
        py::arg("scale"), py::arg("accumulate"));
  m.def("sum_of_squares", &moezero::sum_of_squares, py::arg("tensors"));
}
