// Helpers shared by the CPU kernels: OpenMP thread counts, multi-tensor chunking, and the
// AVX2/baseline multiversioning of hot loops. Without OpenMP everything runs serially.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// A hot loop marked MOEZERO_MULTIVERSION is compiled twice, for AVX2 and for the baseline ISA,
// and the dynamic loader picks one for this CPU (GNU ifunc): the wheel stays portable while the
// bf16 <-> fp32 conversions run 8 wide where they can. Elsewhere it is a no-op.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define MOEZERO_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MOEZERO_MULTIVERSION
#endif

namespace moezero {

// Below this many elements of work a parallel region costs more than it saves.
constexpr int64_t kParallelGrain = 1 << 15;

// Threads for `work` elements: torch.set_num_threads reaches us through OpenMP's ICV, and
// a call from inside someone else's parallel region stays serial.
inline int threads_for(int64_t work) {
#ifdef _OPENMP
  if (omp_in_parallel() || work < 2 * kParallelGrain) return 1;
  return static_cast<int>(std::min<int64_t>(omp_get_max_threads(), work / kParallelGrain));
#else
  (void)work;
  return 1;
#endif
}

// Work is split into more pieces than threads and handed out dynamically (schedule(dynamic)):
// when another process takes a core, the other threads pick up its share instead of waiting at
// the barrier. Results never depend on the schedule.
constexpr int kPiecesPerThread = 4;

// A contiguous element range [begin, end) of tensor `tensor` in a multi-tensor op.
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Splits every tensor into ranges of at most `chunk_size` elements, so a list of a few huge
// and many tiny tensors balances across threads. Empty tensors get no chunk.
inline std::vector<Chunk> split_into_chunks(const std::vector<int64_t>& numels, int64_t chunk_size) {
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < static_cast<int64_t>(numels.size()); ++i) {
    for (int64_t b = 0; b < numels[i]; b += chunk_size) {
      chunks.push_back({i, b, std::min(numels[i], b + chunk_size)});
    }
  }
  return chunks;
}

}  // namespace moezero
