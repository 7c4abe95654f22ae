// TreeAttentionMask CUDA kernel: one thread block per request, one thread per tree node (row).
// Each thread walks from its node up to the root, marking the node and every ancestor in its
// mask row and packed row; the walk length is the node's depth + 1.
#include <cuda_runtime.h>

#include "launcher.h"

namespace {

constexpr int kThreads = 128;
constexpr int64_t kPadParent = -2;

template <typename MaskT>
__global__ void treeAttentionMaskKernel(const int64_t* __restrict__ parents,
                                        const int64_t* __restrict__ pastLengths, int32_t numNodes,
                                        int32_t numWords, MaskT* __restrict__ mask,
                                        int64_t* __restrict__ positionIds,
                                        int32_t* __restrict__ packedMask) {
  const int64_t b = blockIdx.x;
  const int64_t* treeParents = parents + b * numNodes;
  for (int32_t i = threadIdx.x; i < numNodes; i += blockDim.x) {
    MaskT* row = mask + (b * numNodes + i) * numNodes;
    uint32_t* words = reinterpret_cast<uint32_t*>(packedMask + (b * numNodes + i) * numWords);
    for (int32_t j = 0; j < numNodes; ++j) row[j] = 0;
    for (int32_t w = 0; w < numWords; ++w) words[w] = 0u;

    int64_t depth = 0;
    if (treeParents[i] == kPadParent) {  // padding attends only to itself
      row[i] = 1;
      words[i / 32] |= 1u << (i % 32);
    } else {
      // A valid tree has parent < node, so the walk ends at the root (-1) after at most numNodes
      // steps; the bound and the range check keep an invalid tree in bounds.
      int64_t j = i;
      int32_t steps = 0;
      while (j >= 0 && j < numNodes && steps < numNodes) {
        row[j] = 1;
        words[j / 32] |= 1u << (j % 32);
        j = treeParents[j];
        ++steps;
      }
      depth = steps - 1;
    }
    positionIds[b * numNodes + i] = pastLengths[b] + depth;
  }
}

template <typename MaskT>
int launch(const int64_t* parents, const int64_t* pastLengths, int32_t batch, int32_t numNodes,
           MaskT* mask, int64_t* positionIds, int32_t* packedMask, void* stream) {
  if (batch < 0 || numNodes < 1) return static_cast<int>(cudaErrorInvalidValue);
  if (batch == 0) return static_cast<int>(cudaSuccess);
  const int32_t numWords = (numNodes + 31) / 32;
  treeAttentionMaskKernel<MaskT><<<batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      parents, pastLengths, numNodes, numWords, mask, positionIds, packedMask);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int dspark_tree_attention_mask(const int64_t* parents, const int64_t* past_lengths,
                                          int32_t batch, int32_t num_nodes, uint8_t* mask,
                                          int64_t* position_ids, int32_t* packed_mask,
                                          void* stream) {
  return launch(parents, past_lengths, batch, num_nodes, mask, position_ids, packed_mask, stream);
}

extern "C" int dspark_tree_attention_mask_i32(const int64_t* parents, const int64_t* past_lengths,
                                              int32_t batch, int32_t num_nodes, int32_t* mask,
                                              int64_t* position_ids, int32_t* packed_mask,
                                              void* stream) {
  return launch(parents, past_lengths, batch, num_nodes, mask, position_ids, packed_mask, stream);
}
