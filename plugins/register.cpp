// Entry points TensorRT looks up when it loads libdspark_plugins_trt.so as a plugin library
// (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins, builder config plugin paths).
#include <NvInferRuntime.h>

#include "plugin_common.h"
#include "tree_accept/plugin.h"
#include "tree_attention_mask/plugin.h"

extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  dspark::plugin::setLoggerFinder(finder);
}

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static dspark::plugin::TreeAttentionMaskCreator maskCreator;
  static dspark::plugin::TreeAcceptCreator greedyCreator(dspark::plugin::TreeAcceptMode::kGreedy);
  static dspark::plugin::TreeAcceptCreator samplingCreator(dspark::plugin::TreeAcceptMode::kSampling);
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&maskCreator, &greedyCreator,
                                                                &samplingCreator};
  nbCreators = 3;
  return creators;
}
