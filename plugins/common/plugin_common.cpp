#include "plugin_common.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>

namespace dspark::plugin {
namespace {

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder = nullptr;

}  // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept {
  std::lock_guard<std::mutex> lock(gLoggerMutex);
  if (gLoggerFinder == nullptr) gLoggerFinder = finder;
}

void logError(char const* what) noexcept {
  try {
    std::string const message = std::string("[dspark plugins] ") + what;
    nvinfer1::ILogger* logger = nullptr;
    {
      std::lock_guard<std::mutex> lock(gLoggerMutex);
      if (gLoggerFinder != nullptr) logger = gLoggerFinder->findLogger();
    }
    if (logger != nullptr) {
      logger->log(nvinfer1::ILogger::Severity::kERROR, message.c_str());
    } else {
      std::fprintf(stderr, "%s\n", message.c_str());
    }
  } catch (...) {
    std::fprintf(stderr, "[dspark plugins] (error while reporting an error)\n");
  }
}

void check(bool condition, char const* where, std::string const& message) {
  if (!condition) throw PluginError(std::string(where) + ": " + message);
}

int64_t readInt(nvinfer1::PluginField const& field, char const* where) {
  check(field.data != nullptr && field.length == 1, where,
        std::string("field '") + field.name + "' must hold exactly one integer");
  if (field.type == nvinfer1::PluginFieldType::kINT32) {
    return *static_cast<int32_t const*>(field.data);
  }
  check(field.type == nvinfer1::PluginFieldType::kINT64, where,
        std::string("field '") + field.name + "' must be kINT32 or kINT64");
  return *static_cast<int64_t const*>(field.data);
}

void checkFieldNames(nvinfer1::PluginFieldCollection const* fc, std::vector<std::string> const& known,
                     char const* where) {
  check(fc != nullptr, where, "null PluginFieldCollection");
  check(fc->nbFields == 0 || fc->fields != nullptr, where, "PluginFieldCollection without fields");
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    char const* name = fc->fields[i].name;
    check(name != nullptr, where, "field without a name");
    if (std::strcmp(name, "plugin_namespace") == 0 || std::strcmp(name, "plugin_version") == 0) continue;
    bool found = false;
    for (auto const& k : known) found = found || k == name;
    check(found, where, std::string("unknown field '") + name + "'");
  }
}

void reportCurrentException(char const* where) noexcept {
  try {
    throw;
  } catch (PluginError const& e) {  // the message already starts with its entry point
    logError(e.what());
  } catch (std::exception const& e) {
    logError((std::string(where) + ": " + e.what()).c_str());
  } catch (...) {
    logError((std::string(where) + ": unknown exception").c_str());
  }
}

}  // namespace dspark::plugin
