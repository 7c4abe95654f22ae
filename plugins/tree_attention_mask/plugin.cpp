#include "plugin.h"

#include "launcher.h"

namespace dspark::plugin {
namespace {

constexpr char const* kName = "TreeAttentionMask";
constexpr int32_t kNbInputs = 2;
constexpr int32_t kNbOutputs = 3;

void checkIo(int32_t nbInputs, int32_t nbOutputs, char const* where) {
  check(nbInputs == kNbInputs, where, "expects 2 inputs (parents, past_lengths)");
  check(nbOutputs == kNbOutputs, where, "produces 3 outputs (mask, position_ids, packed_mask)");
}

void checkRanks(nvinfer1::Dims const& parents, nvinfer1::Dims const& pastLengths, char const* where) {
  check(parents.nbDims == 2, where, "parents must be [batch, num_nodes]");
  check(pastLengths.nbDims == 1, where, "past_lengths must be [batch]");
}

}  // namespace

nvinfer1::IPluginCapability* TreeAttentionMaskPlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE:
      return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD:
      return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME:
      return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

nvinfer1::IPluginV3* TreeAttentionMaskPlugin::clone() noexcept {
  try {
    return new TreeAttentionMaskPlugin();
  } catch (...) {
    reportCurrentException("TreeAttentionMask::clone");
  }
  return nullptr;
}

char const* TreeAttentionMaskPlugin::getPluginName() const noexcept { return kName; }
char const* TreeAttentionMaskPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* TreeAttentionMaskPlugin::getPluginNamespace() const noexcept { return kNamespace; }
int32_t TreeAttentionMaskPlugin::getNbOutputs() const noexcept { return kNbOutputs; }

int32_t TreeAttentionMaskPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                                                    nvinfer1::DataType const* inputTypes,
                                                    int32_t nbInputs) const noexcept {
  try {
    char const* where = "TreeAttentionMask::getOutputDataTypes";
    checkIo(nbInputs, nbOutputs, where);
    check(inputTypes[0] == nvinfer1::DataType::kINT64 && inputTypes[1] == nvinfer1::DataType::kINT64, where,
          "parents and past_lengths must be int64");
    outputTypes[0] = nvinfer1::DataType::kINT32;
    outputTypes[1] = nvinfer1::DataType::kINT64;
    outputTypes[2] = nvinfer1::DataType::kINT32;
    return 0;
  } catch (...) {
    reportCurrentException("TreeAttentionMask::getOutputDataTypes");
  }
  return -1;
}

int32_t TreeAttentionMaskPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                                                 nvinfer1::DimsExprs const* /*shapeInputs*/,
                                                 int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
                                                 int32_t nbOutputs,
                                                 nvinfer1::IExprBuilder& exprBuilder) noexcept {
  try {
    char const* where = "TreeAttentionMask::getOutputShapes";
    checkIo(nbInputs, nbOutputs, where);
    check(inputs[0].nbDims == 2 && inputs[1].nbDims == 1, where,
          "parents must be [batch, num_nodes] and past_lengths [batch]");
    nvinfer1::IDimensionExpr const* batch = inputs[0].d[0];
    nvinfer1::IDimensionExpr const* nodes = inputs[0].d[1];
    outputs[0].nbDims = 4;
    outputs[0].d[0] = batch;
    outputs[0].d[1] = exprBuilder.constant(1);
    outputs[0].d[2] = nodes;
    outputs[0].d[3] = nodes;
    outputs[1].nbDims = 2;
    outputs[1].d[0] = batch;
    outputs[1].d[1] = nodes;
    outputs[2].nbDims = 3;
    outputs[2].d[0] = batch;
    outputs[2].d[1] = nodes;
    outputs[2].d[2] = exprBuilder.operation(nvinfer1::DimensionOperation::kCEIL_DIV, *nodes,
                                            *exprBuilder.constant(32));
    return 0;
  } catch (...) {
    reportCurrentException("TreeAttentionMask::getOutputShapes");
  }
  return -1;
}

bool TreeAttentionMaskPlugin::supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                                        int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs) return false;
  // positions: 0 parents, 1 past_lengths, 2 mask, 3 position_ids, 4 packed_mask
  nvinfer1::DataType const expected[] = {nvinfer1::DataType::kINT64, nvinfer1::DataType::kINT64,
                                         nvinfer1::DataType::kINT32, nvinfer1::DataType::kINT64,
                                         nvinfer1::DataType::kINT32};
  nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
  return desc.format == nvinfer1::TensorFormat::kLINEAR && desc.type == expected[pos];
}

int32_t TreeAttentionMaskPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                 nvinfer1::DynamicPluginTensorDesc const* /*out*/,
                                                 int32_t nbOutputs) noexcept {
  try {
    char const* where = "TreeAttentionMask::configurePlugin";
    checkIo(nbInputs, nbOutputs, where);
    checkRanks(in[0].desc.dims, in[1].desc.dims, where);
    return 0;
  } catch (...) {
    reportCurrentException("TreeAttentionMask::configurePlugin");
  }
  return -1;
}

int32_t TreeAttentionMaskPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                                               nvinfer1::PluginTensorDesc const* /*out*/,
                                               int32_t nbOutputs) noexcept {
  try {
    char const* where = "TreeAttentionMask::onShapeChange";
    checkIo(nbInputs, nbOutputs, where);
    checkRanks(in[0].dims, in[1].dims, where);
    check(in[1].dims.d[0] == in[0].dims.d[0], where, "past_lengths must have one entry per request");
    check(in[0].dims.d[1] >= 1 && in[0].dims.d[1] <= INT32_MAX, where, "num_nodes must be in [1, 2^31)");
    return 0;
  } catch (...) {
    reportCurrentException("TreeAttentionMask::onShapeChange");
  }
  return -1;
}

int32_t TreeAttentionMaskPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                                         nvinfer1::PluginTensorDesc const* /*outputDesc*/,
                                         void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                         cudaStream_t stream) noexcept {
  try {
    int32_t const batch = static_cast<int32_t>(inputDesc[0].dims.d[0]);
    int32_t const nodes = static_cast<int32_t>(inputDesc[0].dims.d[1]);
    int const status = dspark_tree_attention_mask_i32(
        static_cast<int64_t const*>(inputs[0]), static_cast<int64_t const*>(inputs[1]), batch, nodes,
        static_cast<int32_t*>(outputs[0]), static_cast<int64_t*>(outputs[1]), static_cast<int32_t*>(outputs[2]),
        stream);
    check(status == 0, "TreeAttentionMask::enqueue", "kernel launch failed with CUDA error " + std::to_string(status));
    return 0;
  } catch (...) {
    reportCurrentException("TreeAttentionMask::enqueue");
  }
  return -1;
}

nvinfer1::IPluginV3* TreeAttentionMaskPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
  return clone();
}

nvinfer1::PluginFieldCollection const* TreeAttentionMaskPlugin::getFieldsToSerialize() noexcept { return &mNoFields; }

char const* TreeAttentionMaskCreator::getPluginName() const noexcept { return kName; }
char const* TreeAttentionMaskCreator::getPluginVersion() const noexcept { return kVersion; }
char const* TreeAttentionMaskCreator::getPluginNamespace() const noexcept { return kNamespace; }
nvinfer1::PluginFieldCollection const* TreeAttentionMaskCreator::getFieldNames() noexcept { return &mNoFields; }

nvinfer1::IPluginV3* TreeAttentionMaskCreator::createPlugin(char const* /*name*/,
                                                            nvinfer1::PluginFieldCollection const* fc,
                                                            nvinfer1::TensorRTPhase /*phase*/) noexcept {
  try {
    checkFieldNames(fc, {}, "TreeAttentionMask::createPlugin");
    return new TreeAttentionMaskPlugin();
  } catch (...) {
    reportCurrentException("TreeAttentionMask::createPlugin");
  }
  return nullptr;
}

}  // namespace dspark::plugin
