// TreeAccept (greedy) and TreeAcceptSampling CUDA kernels.
//
// Greedy: one thread per request walks the tree exactly as the numpy reference does.
// Sampling: one thread block per request. The walk itself (which child, when to stop) is the same
// on every thread, since every decision reads the same values; the threads share the work over the
// vocabulary: loading a target row, the residual update after a rejection, and the bonus draw.
#include <cuda_runtime.h>

#include "launcher.h"

namespace {

constexpr int kGreedyThreads = 128;
constexpr int kSamplingThreads = 256;  // a power of two: blockSum halves it

__device__ void startPath(int64_t* path, int64_t* kvKeep, int32_t width, int64_t past) {
  for (int32_t k = 0; k < width; ++k) {
    path[k] = -1;
    kvKeep[k] = -1;
  }
  path[0] = 0;
  kvKeep[0] = past;
}

__global__ void treeAcceptGreedyKernel(const int64_t* __restrict__ parents,
                                       const int64_t* __restrict__ draftTokens,
                                       const int64_t* __restrict__ pastLengths,
                                       const int64_t* __restrict__ targetTokens, int32_t batch,
                                       int32_t numNodes, int32_t maxDepth,
                                       int64_t* __restrict__ acceptedPath,
                                       int64_t* __restrict__ acceptLength,
                                       int64_t* __restrict__ bonusToken,
                                       int64_t* __restrict__ kvKeep) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int32_t width = maxDepth + 1;
  const int64_t* par = parents + b * numNodes;
  const int64_t* tok = draftTokens + b * numNodes;
  const int64_t* tgt = targetTokens + b * numNodes;
  int64_t* path = acceptedPath + b * width;
  int64_t* keep = kvKeep + b * width;
  const int64_t past = pastLengths[b];
  startPath(path, keep, width, past);

  int32_t node = 0;
  int32_t depth = 0;
  while (depth < maxDepth) {
    const int64_t want = tgt[node];
    int32_t next = -1;
    for (int32_t c = node + 1; c < numNodes; ++c) {  // children come after their parent
      if (par[c] == node && tok[c] == want) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    node = next;
    ++depth;
    path[depth] = node;
    keep[depth] = past + node;
  }
  acceptLength[b] = depth + 1;
  bonusToken[b] = tgt[node];
}

// Sum of `value` over the block; every thread gets the total. Ends with a barrier, so `scratch`
// may be reused at once and global writes made before the call are visible to the whole block.
__device__ float blockSum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();
  return total;
}

// residual <- row; returns the row's mass.
__device__ float loadRow(const float* row, float* residual, int32_t vocab, float* scratch) {
  float part = 0.f;
  for (int32_t t = threadIdx.x; t < vocab; t += blockDim.x) {
    residual[t] = row[t];
    part += row[t];
  }
  return blockSum(part, scratch);
}

__global__ void treeAcceptSamplingKernel(
    const int64_t* __restrict__ parents, const int64_t* __restrict__ draftTokens,
    const int64_t* __restrict__ pastLengths, const float* __restrict__ targetProbs,
    const float* __restrict__ draftProbs, const float* __restrict__ uniforms, int32_t numNodes,
    int32_t vocab, int32_t maxDepth, float* __restrict__ workspace,
    int64_t* __restrict__ acceptedPath, int64_t* __restrict__ acceptLength,
    int64_t* __restrict__ bonusToken, int64_t* __restrict__ kvKeep) {
  __shared__ float scratch[kSamplingThreads];
  __shared__ float chunkStart[kSamplingThreads];
  __shared__ float bonusThreshold;
  __shared__ int32_t bonusChunk;

  const int64_t b = blockIdx.x;
  const int32_t width = maxDepth + 1;
  const int64_t* par = parents + b * numNodes;
  const int64_t* tok = draftTokens + b * numNodes;
  const float* u = uniforms + b * numNodes;
  const float* p = targetProbs + b * numNodes * static_cast<int64_t>(vocab);
  const float* q = draftProbs + b * numNodes * static_cast<int64_t>(vocab);
  float* residual = workspace + b * vocab;
  int64_t* path = acceptedPath + b * width;
  int64_t* keep = kvKeep + b * width;
  const int64_t past = pastLengths[b];
  if (threadIdx.x == 0) startPath(path, keep, width, past);

  int32_t node = 0;
  int32_t depth = 0;
  float mass = loadRow(p, residual, vocab, scratch);
  while (depth < maxDepth) {
    int32_t accepted = -1;
    for (int32_t c = node + 1; c < numNodes; ++c) {
      if (par[c] != node) continue;
      const int64_t x = tok[c];
      if (x < 0 || x >= vocab) continue;  // outside the contract: never accepted
      const float* qc = q + c * static_cast<int64_t>(vocab);
      const bool accept = u[c] * qc[x] * mass < residual[x];
      __syncthreads();  // all threads have read residual[x] before anyone rewrites the residual
      if (accept) {
        accepted = c;
        break;
      }
      float part = 0.f;
      for (int32_t t = threadIdx.x; t < vocab; t += blockDim.x) {
        part += fmaxf(residual[t] - mass * qc[t], 0.f);
      }
      const float rest = blockSum(part, scratch);
      if (rest > 0.f) {  // otherwise keep the residual (only reachable through rounding)
        for (int32_t t = threadIdx.x; t < vocab; t += blockDim.x) {
          residual[t] = fmaxf(residual[t] - mass * qc[t], 0.f);
        }
        mass = rest;
      }
      __syncthreads();
    }
    if (accepted < 0) break;
    node = accepted;
    ++depth;
    if (threadIdx.x == 0) {
      path[depth] = node;
      keep[depth] = past + node;
    }
    mass = loadRow(p + node * static_cast<int64_t>(vocab), residual, vocab, scratch);
  }

  // Bonus: the first token whose running residual mass exceeds u[0] * total. Each thread sums a
  // contiguous chunk; thread 0 finds the chunk that crosses the threshold; its owner scans it.
  const int32_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int32_t begin = min(vocab, static_cast<int32_t>(threadIdx.x) * chunk);
  const int32_t end = min(vocab, begin + chunk);
  float local = 0.f;
  for (int32_t t = begin; t < end; ++t) local += residual[t];
  scratch[threadIdx.x] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    float running = 0.f;
    for (int k = 0; k < blockDim.x; ++k) {
      chunkStart[k] = running;
      running += scratch[k];
    }
    const float threshold = u[0] * running;
    int32_t chosen = -1;
    for (int k = 0; k < blockDim.x && chosen < 0; ++k) {
      if (chunkStart[k] + scratch[k] > threshold) chosen = k;
    }
    for (int k = blockDim.x - 1; k >= 0 && chosen < 0; --k) {  // rounding with u close to 1
      if (scratch[k] > 0.f) chosen = k;
    }
    bonusChunk = chosen;
    bonusThreshold = threshold;
    acceptLength[b] = depth + 1;
    if (chosen < 0) bonusToken[b] = -1;  // no residual mass: outside the contract
  }
  __syncthreads();
  if (static_cast<int32_t>(threadIdx.x) == bonusChunk) {
    float running = chunkStart[threadIdx.x];
    int64_t token = -1;
    int64_t lastPositive = -1;
    for (int32_t t = begin; t < end && token < 0; ++t) {
      if (residual[t] > 0.f) lastPositive = t;
      running += residual[t];
      if (running > bonusThreshold) token = t;
    }
    bonusToken[b] = token >= 0 ? token : lastPositive;
  }
}

}  // namespace

extern "C" int dspark_tree_accept_greedy(const int64_t* parents, const int64_t* draft_tokens,
                                         const int64_t* past_lengths,
                                         const int64_t* target_tokens, int32_t batch,
                                         int32_t num_nodes, int32_t max_depth,
                                         int64_t* accepted_path, int64_t* accept_length,
                                         int64_t* bonus_token, int64_t* kv_keep, void* stream) {
  if (batch < 0 || num_nodes < 1 || max_depth < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (batch == 0) return static_cast<int>(cudaSuccess);
  const int blocks = (batch + kGreedyThreads - 1) / kGreedyThreads;
  treeAcceptGreedyKernel<<<blocks, kGreedyThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      parents, draft_tokens, past_lengths, target_tokens, batch, num_nodes, max_depth,
      accepted_path, accept_length, bonus_token, kv_keep);
  return static_cast<int>(cudaGetLastError());
}

extern "C" size_t dspark_tree_accept_sampling_workspace_size(int32_t batch, int32_t vocab) {
  if (batch <= 0 || vocab <= 0) return 0;
  return static_cast<size_t>(batch) * static_cast<size_t>(vocab) * sizeof(float);
}

extern "C" int dspark_tree_accept_sampling(const int64_t* parents, const int64_t* draft_tokens,
                                           const int64_t* past_lengths, const float* target_probs,
                                           const float* draft_probs, const float* uniforms,
                                           int32_t batch, int32_t num_nodes, int32_t vocab,
                                           int32_t max_depth, void* workspace,
                                           int64_t* accepted_path, int64_t* accept_length,
                                           int64_t* bonus_token, int64_t* kv_keep, void* stream) {
  if (batch < 0 || num_nodes < 1 || vocab < 1 || max_depth < 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (batch == 0) return static_cast<int>(cudaSuccess);
  if (workspace == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  treeAcceptSamplingKernel<<<batch, kSamplingThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms, num_nodes, vocab,
      max_depth, static_cast<float*>(workspace), accepted_path, accept_length, bonus_token,
      kv_keep);
  return static_cast<int>(cudaGetLastError());
}
