// Shared pieces of the dspark TensorRT plugins: logging through TensorRT's logger, attribute
// parsing for creators, and the error type that noexcept entry points catch and report.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dspark::plugin {

constexpr char const* kNamespace = "dspark";
constexpr char const* kVersion = "1";

class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Called by the library's exported setLoggerFinder; until then errors go to stderr.
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

// Reports an error through TensorRT's logger (stderr before setLoggerFinder): "[dspark plugins] <what>".
void logError(char const* what) noexcept;

// Throws PluginError(where + ": " + message) unless `condition` holds.
void check(bool condition, char const* where, std::string const& message);

// One integer attribute: accepts kINT32 or kINT64 fields of length 1 (the ONNX parser passes
// ONNX INT attributes as either, depending on the TensorRT version).
int64_t readInt(nvinfer1::PluginField const& field, char const* where);

// Validates the field names of a creator call: every field must be in `known` or be one of the
// parser's bookkeeping attributes (plugin_namespace, plugin_version), which are ignored.
void checkFieldNames(nvinfer1::PluginFieldCollection const* fc, std::vector<std::string> const& known,
                     char const* where);

// Reports and swallows the exception in flight; use inside catch (...) of noexcept functions.
void reportCurrentException(char const* where) noexcept;

}  // namespace dspark::plugin
