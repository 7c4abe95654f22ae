/* C launchers of the TreeAccept (greedy) and TreeAcceptSampling CUDA kernels.
 * Contract: tree_accept/README.md.
 *
 * All pointers are device pointers, row-major and contiguous; `stream` is a cudaStream_t (NULL =
 * the default stream). Launches are asynchronous; the return value is a cudaError_t (0 = success)
 * from argument checks and the launch itself. Inputs are not validated on the device: inputs that
 * break the contract give unspecified (but in-bounds) outputs.
 *
 * Outputs, D = max_depth:
 * accepted_path [batch, D + 1] int64 (node indices from the root, -1 padded)
 * accept_length [batch] int64 (accepted draft nodes + 1)
 * bonus_token   [batch] int64
 * kv_keep       [batch, D + 1] int64 (past_lengths[b] + accepted_path, -1 padded)
 */
#ifndef DSPARK_TREE_ACCEPT_LAUNCHER_H
#define DSPARK_TREE_ACCEPT_LAUNCHER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* parents, draft_tokens, target_tokens [batch, num_nodes] int64; past_lengths [batch] int64 */
int dspark_tree_accept_greedy(const int64_t* parents, const int64_t* draft_tokens,
                              const int64_t* past_lengths, const int64_t* target_tokens,
                              int32_t batch, int32_t num_nodes, int32_t max_depth,
                              int64_t* accepted_path, int64_t* accept_length, int64_t* bonus_token,
                              int64_t* kv_keep, void* stream);

/* Bytes of device workspace dspark_tree_accept_sampling needs (one float residual per token). */
size_t dspark_tree_accept_sampling_workspace_size(int32_t batch, int32_t vocab);

/* parents, draft_tokens [batch, num_nodes] int64; past_lengths [batch] int64;
 * target_probs, draft_probs [batch, num_nodes, vocab] float32; uniforms [batch, num_nodes] float32;
 * workspace: at least dspark_tree_accept_sampling_workspace_size(batch, vocab) bytes. */
int dspark_tree_accept_sampling(const int64_t* parents, const int64_t* draft_tokens,
                                const int64_t* past_lengths, const float* target_probs,
                                const float* draft_probs, const float* uniforms, int32_t batch,
                                int32_t num_nodes, int32_t vocab, int32_t max_depth,
                                void* workspace, int64_t* accepted_path, int64_t* accept_length,
                                int64_t* bonus_token, int64_t* kv_keep, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* DSPARK_TREE_ACCEPT_LAUNCHER_H */
