#include "server/lora_admin.h"

#include <fmt/core.h>

#include <algorithm>

#include "base/error.h"
#include "engine/engine_loop.h"
#include "model/lora.h"
#include "model/model.h"

namespace serval {
namespace lora_admin {

// Refuses fields other than `allowed`, and a `lora_name` that is missing, empty or too long.
std::string checked_name(const json& body, std::initializer_list<const char*> allowed) {
  for (const auto& [key, value] : body.items())
    if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; }))
      bad_request(fmt::format("unknown field '{}'", key), key);
  if (!body.contains("lora_name") || !body["lora_name"].is_string() || body["lora_name"].get<std::string>().empty())
    bad_request("'lora_name' must be a non-empty string", "lora_name");
  const std::string name = body["lora_name"].get<std::string>();
  if (name.size() > 256) bad_request("'lora_name' is longer than 256 bytes", "lora_name");
  return name;
}

}  // namespace lora_admin

LoraAdmin::LoraAdmin(Model& model, EngineLoop& loop, AdapterList& list, std::string base_name, size_t max_loaded)
    : model_(model), loop_(loop), list_(list), base_name_(std::move(base_name)), max_loaded_(max_loaded) {}

std::string LoraAdmin::load(const json& body) {
  const std::string name = lora_admin::checked_name(body, {"lora_name", "lora_path", "load_inplace"});
  if (!body.contains("lora_path") || !body["lora_path"].is_string() || body["lora_path"].get<std::string>().empty())
    bad_request("'lora_path' must be a non-empty string", "lora_path");
  if (body.contains("load_inplace") && !body["load_inplace"].is_boolean())
    bad_request("'load_inplace' must be a boolean", "load_inplace");
  const bool inplace = body.value("load_inplace", false);
  if (name == base_name_) bad_request(fmt::format("'{}' is the base model's name", name), "lora_name");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<AdapterList::Adapter> list = *list_.get();
  const int32_t old = AdapterList::find(list, name);
  if (old >= 0 && !inplace)
    bad_request(fmt::format("The lora adapter '{}' has already been loaded (send load_inplace to replace it)", name), "lora_name");
  if (old < 0 && AdapterList::loaded(list) >= max_loaded_)
    bad_request(fmt::format("{} LoRA adapters are loaded, the most --max-loras allows; unload one first", max_loaded_));
  if (list.size() >= size_t(INT16_MAX) - 1) bad_request("this server has loaded as many LoRA adapters as it can");
  std::shared_ptr<const LoraAdapter> adapter;
  try {
    adapter = load_lora(body["lora_path"].get<std::string>(), model_.config(), name, 1.0f);
  } catch (const Error& e) {
    bad_request(e.what(), "lora_path");
  }
  const auto id = int32_t(list.size());
  loop_.run_on_engine([&](Engine& e) {
    model_.set_adapter(size_t(id), adapter);
    release(e, old);
  });
  if (old >= 0) list[size_t(old)].name.clear();
  list.push_back({name, adapter->path, adapter->scale, adapter->rank});
  list_.set(std::move(list));
  return fmt::format("Success: LoRA adapter '{}' added successfully.", name);
}

std::string LoraAdmin::unload(const json& body) {
  const std::string name = lora_admin::checked_name(body, {"lora_name", "lora_int_id"});
  if (body.contains("lora_int_id") && !body["lora_int_id"].is_number_integer() && !body["lora_int_id"].is_null())
    bad_request("'lora_int_id' must be an integer", "lora_int_id");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<AdapterList::Adapter> list = *list_.get();
  const int32_t id = AdapterList::find(list, name);
  if (id < 0) throw ApiError{404, fmt::format("The lora adapter '{}' cannot be found.", name), "NotFoundError", "lora_name"};
  list[size_t(id)].name.clear();
  list_.set(std::move(list));  // new requests can no longer choose it
  loop_.run_on_engine([&](Engine& e) { release(e, id); });
  return fmt::format("Success: LoRA adapter '{}' removed successfully.", name);
}

void LoraAdmin::release(Engine& engine, int32_t id) {
  if (id >= 0) retired_.push_back(id);
  std::vector<int32_t> still_used;
  for (int32_t r : retired_) {
    if (engine.adapter_in_use(r)) still_used.push_back(r);
    else model_.set_adapter(size_t(r), nullptr);  // its memory goes with the last reference
  }
  retired_ = std::move(still_used);
}

}  // namespace serval
