#include "plugin.h"

#include <cstring>
#include <string>

#include "launcher.h"

namespace dspark::plugin {
namespace {

constexpr int32_t kNbOutputs = 4;
constexpr int32_t kGreedyInputs = 4;
constexpr int32_t kSamplingInputs = 6;
constexpr char const* kMaxDepthField = "max_depth";

char const* modeName(TreeAcceptMode mode) {
  return mode == TreeAcceptMode::kGreedy ? "TreeAccept" : "TreeAcceptSampling";
}

// Input pos (0-based) of the sampling form that holds float32 data: target_probs, draft_probs, uniforms.
bool isFloatInput(TreeAcceptMode mode, int32_t pos) { return mode == TreeAcceptMode::kSampling && pos >= 3; }

}  // namespace

TreeAcceptPlugin::TreeAcceptPlugin(TreeAcceptMode mode, int32_t maxDepth)
    : mMode(mode),
      mMaxDepth(maxDepth),
      mField(kMaxDepthField, &mMaxDepth, nvinfer1::PluginFieldType::kINT32, 1),
      mFields{1, &mField} {}

// The serialized field must point at this object's own max_depth, not the source's.
TreeAcceptPlugin::TreeAcceptPlugin(TreeAcceptPlugin const& other) : TreeAcceptPlugin(other.mMode, other.mMaxDepth) {}

int32_t TreeAcceptPlugin::nbInputs() const {
  return mMode == TreeAcceptMode::kGreedy ? kGreedyInputs : kSamplingInputs;
}

void TreeAcceptPlugin::checkIo(int32_t nbIn, int32_t nbOut, char const* where) const {
  check(nbIn == nbInputs(), where,
        mMode == TreeAcceptMode::kGreedy
            ? "expects 4 inputs (parents, draft_tokens, past_lengths, target_tokens)"
            : "expects 6 inputs (parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms)");
  check(nbOut == kNbOutputs, where, "produces 4 outputs (accepted_path, accept_length, bonus_token, kv_keep)");
}

void TreeAcceptPlugin::checkShapes(nvinfer1::Dims const* in, char const* where) const {
  check(in[0].nbDims == 2, where, "parents must be [batch, num_nodes]");
  check(in[1].nbDims == 2, where, "draft_tokens must be [batch, num_nodes]");
  check(in[2].nbDims == 1, where, "past_lengths must be [batch]");
  if (mMode == TreeAcceptMode::kGreedy) {
    check(in[3].nbDims == 2, where, "target_tokens must be [batch, num_nodes]");
  } else {
    check(in[3].nbDims == 3 && in[4].nbDims == 3, where, "target_probs and draft_probs must be [batch, num_nodes, vocab]");
    check(in[5].nbDims == 2, where, "uniforms must be [batch, num_nodes]");
  }
}

nvinfer1::IPluginCapability* TreeAcceptPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
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

nvinfer1::IPluginV3* TreeAcceptPlugin::clone() noexcept {
  try {
    return new TreeAcceptPlugin(*this);
  } catch (...) {
    reportCurrentException("TreeAccept::clone");
  }
  return nullptr;
}

char const* TreeAcceptPlugin::getPluginName() const noexcept { return modeName(mMode); }
char const* TreeAcceptPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* TreeAcceptPlugin::getPluginNamespace() const noexcept { return kNamespace; }
int32_t TreeAcceptPlugin::getNbOutputs() const noexcept { return kNbOutputs; }

int32_t TreeAcceptPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                                             nvinfer1::DataType const* inputTypes,
                                             int32_t nbInputs) const noexcept {
  try {
    char const* where = "TreeAccept::getOutputDataTypes";
    checkIo(nbInputs, nbOutputs, where);
    for (int32_t i = 0; i < nbInputs; ++i) {
      auto const expected = isFloatInput(mMode, i) ? nvinfer1::DataType::kFLOAT : nvinfer1::DataType::kINT64;
      check(inputTypes[i] == expected, where, "input " + std::to_string(i) + " has the wrong data type");
    }
    for (int32_t i = 0; i < nbOutputs; ++i) outputTypes[i] = nvinfer1::DataType::kINT64;
    return 0;
  } catch (...) {
    reportCurrentException("TreeAccept::getOutputDataTypes");
  }
  return -1;
}

int32_t TreeAcceptPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                                          nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/,
                                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                                          nvinfer1::IExprBuilder& exprBuilder) noexcept {
  try {
    char const* where = "TreeAccept::getOutputShapes";
    checkIo(nbInputs, nbOutputs, where);
    check(inputs[0].nbDims == 2, where, "parents must be [batch, num_nodes]");
    nvinfer1::IDimensionExpr const* batch = inputs[0].d[0];
    nvinfer1::IDimensionExpr const* width = exprBuilder.constant(static_cast<int64_t>(mMaxDepth) + 1);
    for (int32_t k : {0, 3}) {  // accepted_path, kv_keep: [batch, max_depth + 1]
      outputs[k].nbDims = 2;
      outputs[k].d[0] = batch;
      outputs[k].d[1] = width;
    }
    for (int32_t k : {1, 2}) {  // accept_length, bonus_token: [batch]
      outputs[k].nbDims = 1;
      outputs[k].d[0] = batch;
    }
    return 0;
  } catch (...) {
    reportCurrentException("TreeAccept::getOutputShapes");
  }
  return -1;
}

bool TreeAcceptPlugin::supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                                 int32_t nbIn, int32_t nbOut) noexcept {
  if (nbIn != nbInputs() || nbOut != kNbOutputs || pos < 0 || pos >= nbIn + nbOut) return false;
  nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
  auto const expected = isFloatInput(mMode, pos) && pos < nbIn ? nvinfer1::DataType::kFLOAT
                                                               : nvinfer1::DataType::kINT64;
  return desc.format == nvinfer1::TensorFormat::kLINEAR && desc.type == expected;
}

int32_t TreeAcceptPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbIn,
                                          nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOut) noexcept {
  try {
    char const* where = "TreeAccept::configurePlugin";
    checkIo(nbIn, nbOut, where);
    nvinfer1::Dims dims[kSamplingInputs];
    for (int32_t i = 0; i < nbIn; ++i) dims[i] = in[i].desc.dims;
    checkShapes(dims, where);
    return 0;
  } catch (...) {
    reportCurrentException("TreeAccept::configurePlugin");
  }
  return -1;
}

size_t TreeAcceptPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbIn,
                                          nvinfer1::DynamicPluginTensorDesc const* /*outputs*/,
                                          int32_t /*nbOutputs*/) const noexcept {
  if (mMode != TreeAcceptMode::kSampling || nbIn != kSamplingInputs || inputs[3].max.nbDims != 3) return 0;
  // one float residual per (request, token), sized for the largest batch and vocabulary
  int64_t const batch = inputs[3].max.d[0];
  int64_t const vocab = inputs[3].max.d[2];
  if (batch <= 0 || vocab <= 0) return 0;
  return static_cast<size_t>(batch) * static_cast<size_t>(vocab) * sizeof(float);
}

int32_t TreeAcceptPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbIn,
                                        nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOut) noexcept {
  try {
    char const* where = "TreeAccept::onShapeChange";
    checkIo(nbIn, nbOut, where);
    nvinfer1::Dims dims[kSamplingInputs];
    for (int32_t i = 0; i < nbIn; ++i) dims[i] = in[i].dims;
    checkShapes(dims, where);
    int64_t const batch = dims[0].d[0];
    int64_t const nodes = dims[0].d[1];
    check(nodes >= 1 && nodes <= INT32_MAX && batch <= INT32_MAX, where, "num_nodes must be >= 1 and sizes < 2^31");
    check(dims[1].d[0] == batch && dims[1].d[1] == nodes, where, "draft_tokens must match parents");
    check(dims[2].d[0] == batch, where, "past_lengths must have one entry per request");
    if (mMode == TreeAcceptMode::kGreedy) {
      check(dims[3].d[0] == batch && dims[3].d[1] == nodes, where, "target_tokens must match parents");
    } else {
      check(dims[3].d[0] == batch && dims[3].d[1] == nodes && dims[3].d[2] >= 1 && dims[3].d[2] <= INT32_MAX,
            where, "target_probs must be [batch, num_nodes, vocab]");
      for (int32_t d = 0; d < 3; ++d) check(dims[4].d[d] == dims[3].d[d], where, "draft_probs must match target_probs");
      check(dims[5].d[0] == batch && dims[5].d[1] == nodes, where, "uniforms must match parents");
    }
    return 0;
  } catch (...) {
    reportCurrentException("TreeAccept::onShapeChange");
  }
  return -1;
}

int32_t TreeAcceptPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                                  nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs,
                                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  try {
    int32_t const batch = static_cast<int32_t>(inputDesc[0].dims.d[0]);
    int32_t const nodes = static_cast<int32_t>(inputDesc[0].dims.d[1]);
    auto const* parents = static_cast<int64_t const*>(inputs[0]);
    auto const* tokens = static_cast<int64_t const*>(inputs[1]);
    auto const* past = static_cast<int64_t const*>(inputs[2]);
    auto* path = static_cast<int64_t*>(outputs[0]);
    auto* length = static_cast<int64_t*>(outputs[1]);
    auto* bonus = static_cast<int64_t*>(outputs[2]);
    auto* keep = static_cast<int64_t*>(outputs[3]);
    int status = 0;
    if (mMode == TreeAcceptMode::kGreedy) {
      status = dspark_tree_accept_greedy(parents, tokens, past, static_cast<int64_t const*>(inputs[3]), batch, nodes,
                                         mMaxDepth, path, length, bonus, keep, stream);
    } else {
      int32_t const vocab = static_cast<int32_t>(inputDesc[3].dims.d[2]);
      status = dspark_tree_accept_sampling(parents, tokens, past, static_cast<float const*>(inputs[3]),
                                           static_cast<float const*>(inputs[4]), static_cast<float const*>(inputs[5]),
                                           batch, nodes, vocab, mMaxDepth, workspace, path, length, bonus, keep,
                                           stream);
    }
    check(status == 0, "TreeAccept::enqueue", "kernel launch failed with CUDA error " + std::to_string(status));
    return 0;
  } catch (...) {
    reportCurrentException("TreeAccept::enqueue");
  }
  return -1;
}

nvinfer1::IPluginV3* TreeAcceptPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
  return clone();
}

nvinfer1::PluginFieldCollection const* TreeAcceptPlugin::getFieldsToSerialize() noexcept { return &mFields; }

TreeAcceptCreator::TreeAcceptCreator(TreeAcceptMode mode)
    : mMode(mode), mField(kMaxDepthField, nullptr, nvinfer1::PluginFieldType::kINT32, 1), mFields{1, &mField} {}

char const* TreeAcceptCreator::getPluginName() const noexcept { return modeName(mMode); }
char const* TreeAcceptCreator::getPluginVersion() const noexcept { return kVersion; }
char const* TreeAcceptCreator::getPluginNamespace() const noexcept { return kNamespace; }
nvinfer1::PluginFieldCollection const* TreeAcceptCreator::getFieldNames() noexcept { return &mFields; }

nvinfer1::IPluginV3* TreeAcceptCreator::createPlugin(char const* /*name*/, nvinfer1::PluginFieldCollection const* fc,
                                                     nvinfer1::TensorRTPhase /*phase*/) noexcept {
  try {
    char const* where = "TreeAccept::createPlugin";
    checkFieldNames(fc, {kMaxDepthField}, where);
    bool found = false;
    int64_t maxDepth = 0;
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      if (std::strcmp(fc->fields[i].name, kMaxDepthField) != 0) continue;
      check(!found, where, "field 'max_depth' given twice");
      maxDepth = readInt(fc->fields[i], where);
      found = true;
    }
    check(found, where, "missing required field 'max_depth'");
    check(maxDepth >= 0 && maxDepth <= kMaxDepthLimit, where,
          "max_depth must be in [0, " + std::to_string(kMaxDepthLimit) + "], got " + std::to_string(maxDepth));
    return new TreeAcceptPlugin(mMode, static_cast<int32_t>(maxDepth));
  } catch (...) {
    reportCurrentException("TreeAccept::createPlugin");
  }
  return nullptr;
}

}  // namespace dspark::plugin
