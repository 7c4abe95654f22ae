/* C launcher of the TreeAttentionMask CUDA kernel. Contract: tree_attention_mask/README.md.
 *
 * All pointers are device pointers, row-major and contiguous; `stream` is a cudaStream_t (NULL =
 * the default stream). The launch is asynchronous; the return value is a cudaError_t (0 = success)
 * from argument checks and the launch itself. Inputs are not validated on the device: a parents
 * tensor that breaks the contract gives unspecified (but in-bounds) outputs.
 */
#ifndef DSPARK_TREE_ATTENTION_MASK_LAUNCHER_H
#define DSPARK_TREE_ATTENTION_MASK_LAUNCHER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* parents      [batch, num_nodes] int64: node 0 = root (-1), parent < node, padding -2
 * past_lengths [batch] int64
 * mask         [batch, 1, num_nodes, num_nodes] bool as uint8 (0/1)
 * position_ids [batch, num_nodes] int64
 * packed_mask  [batch, num_nodes, (num_nodes + 31) / 32] int32 */
int dspark_tree_attention_mask(const int64_t* parents, const int64_t* past_lengths, int32_t batch,
                               int32_t num_nodes, uint8_t* mask, int64_t* position_ids,
                               int32_t* packed_mask, void* stream);

/* The same with the mask as int32 0/1: TensorRT plugins cannot output bool tensors. */
int dspark_tree_attention_mask_i32(const int64_t* parents, const int64_t* past_lengths,
                                   int32_t batch, int32_t num_nodes, int32_t* mask,
                                   int64_t* position_ids, int32_t* packed_mask, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* DSPARK_TREE_ATTENTION_MASK_LAUNCHER_H */
