// vLLM's runtime LoRA updates: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (on only when the
// server is started with --allow-runtime-lora, or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True as in vLLM).
// An adapter is read and checked on the caller's thread, then put into the model on the engine thread
// between steps. Ids are never reused: an unloaded adapter's id stays empty, so a request that chose
// it just before the unload is refused instead of getting another adapter.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "server/api_request.h"

namespace serval {

class Model;
class EngineLoop;
class Engine;

class LoraAdmin {
 public:
  // `model` is the one `loop` runs; `list` is what requests are checked against (updated here).
  LoraAdmin(Model& model, EngineLoop& loop, AdapterList& list, std::string base_name, size_t max_loaded);
  // The bodies' handlers: the reply text (vLLM answers plain text); throw ApiError.
  std::string load(const json& body);
  std::string unload(const json& body);

 private:
  Model& model_;
  EngineLoop& loop_;
  AdapterList& list_;
  const std::string base_name_;
  const size_t max_loaded_;
  std::mutex mu_;                 // one load or unload at a time
  std::vector<int32_t> retired_;  // unloaded, but requests still used them: freed once they are done

  // On the engine thread: empties the model's slot of `id` (-1: none) and of earlier unloaded ids
  // that no request uses any more; ids still in use wait in retired_ for the next load or unload.
  void release(Engine& engine, int32_t id);
};

}  // namespace serval
