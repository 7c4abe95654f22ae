// TensorRT IPluginV3 of TreeAccept (greedy) and TreeAcceptSampling (contract: README.md beside
// this file). One class serves both; the creator's mode picks the name and the inputs.
// Greedy inputs:   parents, draft_tokens, past_lengths, target_tokens            (int64)
// Sampling inputs: parents, draft_tokens, past_lengths (int64), target_probs, draft_probs,
//                  uniforms (float32)
// Outputs: accepted_path [B, D+1], accept_length [B], bonus_token [B], kv_keep [B, D+1] (int64)
// Attribute: max_depth = D (int, 0 <= D <= kMaxDepthLimit).
#pragma once

#include <NvInferRuntime.h>

#include "plugin_common.h"

namespace dspark::plugin {

enum class TreeAcceptMode : int32_t { kGreedy = 0, kSampling = 1 };

constexpr int64_t kMaxDepthLimit = 65535;

class TreeAcceptPlugin : public nvinfer1::IPluginV3,
                         public nvinfer1::IPluginV3OneCore,
                         public nvinfer1::IPluginV3OneBuild,
                         public nvinfer1::IPluginV3OneRuntime {
 public:
  TreeAcceptPlugin(TreeAcceptMode mode, int32_t maxDepth);
  TreeAcceptPlugin(TreeAcceptPlugin const& other);
  TreeAcceptPlugin& operator=(TreeAcceptPlugin const&) = delete;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                          nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                 int32_t nbInputs, int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs,
                          int32_t nbOutputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 private:
  int32_t nbInputs() const;
  void checkIo(int32_t nbInputs, int32_t nbOutputs, char const* where) const;
  void checkShapes(nvinfer1::Dims const* in, char const* where) const;

  TreeAcceptMode mMode;
  int32_t mMaxDepth;
  nvinfer1::PluginField mField;
  nvinfer1::PluginFieldCollection mFields;
};

class TreeAcceptCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  explicit TreeAcceptCreator(TreeAcceptMode mode);
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;

 private:
  TreeAcceptMode mMode;
  nvinfer1::PluginField mField;
  nvinfer1::PluginFieldCollection mFields;
};

}  // namespace dspark::plugin
