// Token permute: a stable counting sort of the (token, expert) assignments by expert.
//
// The assignments are cut into a few contiguous ranges per thread. Pass 1 counts experts per
// range; an exclusive prefix over (expert, range) then gives every range its first output row
// for each expert, so pass 2 can place rows independently and still keep the flat order
// t * K + k within an expert. Pass 2 copies each token row as soon as its slot is known, so
// the activations are read once and written once.
#include "moezero_ops.h"
#include "cpu_utils.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace moezero {
namespace {

// Counts of each expert in every range: hist[r * E + e]. Returns false on an id >= E.
template <typename index_t>
bool count_experts(const index_t* ids, int64_t n, int64_t E, int64_t num_ranges, int threads, int64_t* hist) {
  bool ok = true;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(&& : ok) if (threads > 1)
  for (int64_t r = 0; r < num_ranges; ++r) {
    int64_t* h = hist + r * E;
    for (int64_t i = n * r / num_ranges; i < n * (r + 1) / num_ranges; ++i) {
      const int64_t e = static_cast<int64_t>(ids[i]);
      if (e >= E) ok = false;
      else if (e >= 0) ++h[e];
    }
  }
  return ok;
}

// Turns per-range counts into each range's first row per expert (expert-major, range-minor),
// and writes the per-expert totals. Returns the number of kept assignments.
int64_t prefix_offsets(int64_t* hist, int64_t E, int64_t num_ranges, int64_t* counts) {
  int64_t next = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = next;
    for (int64_t r = 0; r < num_ranges; ++r) {
      const int64_t c = hist[r * E + e];
      hist[r * E + e] = next;
      next += c;
    }
    counts[e] = next - first;
  }
  return next;
}

// Pass 2: row_map for every assignment and the row copy of each kept one.
template <typename index_t>
void place_rows(const index_t* ids, int64_t n, int64_t K, int64_t E, int64_t num_ranges, int threads,
                int64_t* offsets, const char* x, int64_t row_bytes, char* out, int64_t* row_map) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
  for (int64_t r = 0; r < num_ranges; ++r) {
    int64_t* next_row = offsets + r * E;
    for (int64_t i = n * r / num_ranges; i < n * (r + 1) / num_ranges; ++i) {
      const int64_t e = static_cast<int64_t>(ids[i]);
      if (e < 0) {
        row_map[i] = -1;
        continue;
      }
      const int64_t row = next_row[e]++;
      row_map[i] = row;
      std::memcpy(out + row * row_bytes, x + (i / K) * row_bytes, row_bytes);
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute(
    const at::Tensor& x_TD, const at::Tensor& topk_ids_TK, int64_t num_experts) {
  TORCH_CHECK(x_TD.device().is_cpu() && topk_ids_TK.device().is_cpu(), "permute: the CPU kernel got ",
              x_TD.device(), " tensors");
  TORCH_CHECK(x_TD.dim() == 2 && topk_ids_TK.dim() == 2, "permute: x_TD and topk_ids_TK must be 2-D");
  TORCH_CHECK(x_TD.size(0) == topk_ids_TK.size(0), "permute: x_TD has ", x_TD.size(0),
              " tokens but topk_ids_TK has ", topk_ids_TK.size(0));
  TORCH_CHECK(num_experts >= 0, "permute: num_experts (", num_experts, ") must be >= 0");
  const at::Tensor x = x_TD.contiguous();
  const at::Tensor ids = topk_ids_TK.contiguous();
  const int64_t T = ids.size(0), K = ids.size(1), D = x.size(1), n = T * K, E = num_experts;
  const int64_t row_bytes = D * static_cast<int64_t>(x.element_size());

  const int threads = threads_for(n * std::max<int64_t>(D, 1));
  const int64_t num_ranges = threads > 1 ? std::min<int64_t>(n, threads * kPiecesPerThread) : 1;
  std::vector<int64_t> hist(static_cast<size_t>(num_ranges * E), 0);
  at::Tensor counts = at::empty({E}, ids.options().dtype(at::kLong));
  at::Tensor row_map = at::empty({T, K}, ids.options().dtype(at::kLong));

  int64_t kept = 0;
  at::Tensor out;
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "moezero_permute", [&] {
    const index_t* ids_ptr = ids.data_ptr<index_t>();
    TORCH_CHECK(count_experts(ids_ptr, n, E, num_ranges, threads, hist.data()),
                "permute: an expert id is >= num_experts (", E, ")");
    kept = prefix_offsets(hist.data(), E, num_ranges, counts.data_ptr<int64_t>());
    out = at::empty({kept, D}, x.options());
    place_rows(ids_ptr, n, K, E, num_ranges, threads, hist.data(), static_cast<const char*>(x.data_ptr()),
               row_bytes, static_cast<char*>(out.data_ptr()), row_map.data_ptr<int64_t>());
  });
  return {out, counts, row_map};
}

}  // namespace moezero
