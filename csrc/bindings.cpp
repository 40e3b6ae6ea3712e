// Python bindings of the CPU kernels (module moezero._C). The torch.library registration
// (schemas, fake kernels, autograd) lives in moezero/ops/_library.py, on top of these functions
// and their CUDA twins in moezero._C_cuda, which have the same names and signatures.
#include <torch/extension.h>

#include "moezero_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moezero CPU kernels: permute / unpermute_combine / flatten_into / sum_of_squares / bias_gelu / "
            "grouped_bias_add / rms_norm / swiglu / quick_geglu / cross_entropy";
  m.def("permute", &moezero::permute, "(x_ND, counts_E, row_map_TK) sorted by expert",
        py::arg("x_TD"), py::arg("topk_ids_TK"), py::arg("num_experts"));
  m.def("unpermute_combine", &moezero::unpermute_combine, "weighted top-k sum back in token order",
        py::arg("y_ND"), py::arg("row_map_TK"), py::arg("weights_TK"));
  m.def("unpermute_combine_backward", &moezero::unpermute_combine_backward,
        "(grad_y_ND, grad_weights_TK or None)", py::arg("grad_TD"), py::arg("y_ND"), py::arg("row_map_TK"),
        py::arg("weights_TK"));
  m.def("flatten_into", &moezero::flatten_into, "flat[o_i:o_i+n_i] (+)= scale * tensors[i]",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"), py::arg("scale"), py::arg("accumulate"));
  m.def("bias_gelu", &moezero::bias_gelu, "(gelu(h), h) of h = y + each row's expert bias",
        py::arg("y_MF"), py::arg("bias_LF"), py::arg("counts"), py::arg("tanh") = false);
  m.def("bias_gelu_backward", &moezero::bias_gelu_backward, "(grad_h, per-expert bias gradient or None)",
        py::arg("grad_a_MF"), py::arg("h_MF"), py::arg("counts"), py::arg("bias_grad"), py::arg("tanh") = false);
  m.def("grouped_bias_add", &moezero::grouped_bias_add, "y + each row's expert bias", py::arg("y_MF"),
        py::arg("bias_LF"), py::arg("counts"));
  m.def("grouped_bias_grad", &moezero::grouped_bias_grad, "each expert's column sums of its rows, fp32",
        py::arg("grad_MF"), py::arg("counts"));
  m.def("rms_norm", &moezero::rms_norm, "(y, rstd) of RMSNorm over the rows", py::arg("x_NH"),
        py::arg("weight_H"), py::arg("eps"));
  m.def("rms_norm_backward", &moezero::rms_norm_backward, "(grad_x, fp32 weight gradient or None)",
        py::arg("grad_NH"), py::arg("x_NH"), py::arg("rstd_N"), py::arg("weight_H"), py::arg("weight_grad"));
  m.def("swiglu", &moezero::swiglu, "silu(gate) * up of rows [gate | up]", py::arg("h_M2F"));
  m.def("swiglu_backward", &moezero::swiglu_backward, "the gradient of rows [gate | up]", py::arg("grad_MF"),
        py::arg("h_M2F"));
  m.def("quick_geglu", &moezero::quick_geglu, "GPT-OSS's clamped quick GEGLU of rows [gate | up]",
        py::arg("h_M2F"), py::arg("alpha"), py::arg("offset"), py::arg("clamp"));
  m.def("quick_geglu_backward", &moezero::quick_geglu_backward, "the gradient of rows [gate | up]",
        py::arg("grad_MF"), py::arg("h_M2F"), py::arg("alpha"), py::arg("offset"), py::arg("clamp"));
  m.def("cross_entropy", &moezero::cross_entropy, "(losses_N, stats_N2: each row's max and log-sum-exp past it) in fp32", py::arg("logits_NV"),
        py::arg("labels_N"), py::arg("ignore_index"));
  m.def("cross_entropy_backward", &moezero::cross_entropy_backward, "grad_N * (softmax - one_hot)",
        py::arg("grad_N"), py::arg("logits_NV"), py::arg("labels_N"), py::arg("stats_N2"),
        py::arg("ignore_index"));
  m.def("sum_of_squares", &moezero::sum_of_squares, "sum_i ||t_i||^2 in fp32 (fp64)", py::arg("tensors"));
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
