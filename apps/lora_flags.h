// LoRA adapter flags, spelled as llama.cpp and vLLM spell them: `--lora NAME=FILE` or `--lora FILE`
// (named after its file), `--lora-scaled FILE SCALE`, and vLLM's `--enable-lora --lora-modules
// NAME=PATH` (or its JSON form). FILE is a GGUF adapter or a PEFT directory. Shared by serve,
// generate and score.
#pragma once
#include <CLI/CLI.hpp>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "model/model.h"

namespace serval::cli {

struct LoraFlags {
  std::vector<std::string> lora, modules;
  std::vector<std::pair<std::string, double>> scaled;
  bool enable = false;

  void add_to(CLI::App* cmd) {
    cmd->add_option("--lora", lora, "a LoRA adapter: NAME=FILE or FILE (a GGUF adapter or a PEFT directory; repeatable)");
    cmd->add_option("--lora-scaled", scaled, "llama.cpp's: a LoRA adapter FILE and its SCALE (repeatable)");
    cmd->add_flag("--enable-lora", enable, "vLLM's: accept --lora-modules");
    cmd->add_option("--lora-modules", modules, "vLLM's: NAME=PATH or {\"name\": ..., \"path\": ...} (repeatable)");
  }

  // (name, path, scale) of every adapter asked for, in order (their ids).
  struct Spec {
    std::string name, path;
    float scale = 1.0f;
  };
  std::vector<Spec> specs() const {
    check(modules.empty() || enable, "--lora-modules needs --enable-lora (as in vLLM)");
    std::vector<Spec> out;
    auto stem = [](const std::string& p) { return std::filesystem::path(p).lexically_normal().filename().stem().string(); };
    for (const auto& a : lora) {
      const auto eq = a.find('=');
      if (eq == std::string::npos) out.push_back({stem(a), a, 1.0f});
      else out.push_back({a.substr(0, eq), a.substr(eq + 1), 1.0f});
    }
    for (const auto& [path, scale] : scaled) out.push_back({stem(path), path, float(scale)});
    for (const auto& m : modules) {
      if (!m.empty() && m[0] == '{') {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(m);
        } catch (const std::exception&) {
          fail("--lora-modules: '{}' is not valid JSON", m);
        }
        check(j.contains("name") && j["name"].is_string() && j.contains("path") && j["path"].is_string(),
              "--lora-modules: the JSON form needs string 'name' and 'path'");
        out.push_back({j["name"], j["path"], 1.0f});
      } else {
        const auto eq = m.find('=');
        check(eq != std::string::npos, "--lora-modules expects NAME=PATH, got '{}'", m);
        out.push_back({m.substr(0, eq), m.substr(eq + 1), 1.0f});
      }
    }
    for (size_t i = 0; i < out.size(); ++i) {
      check(!out[i].name.empty(), "a LoRA adapter needs a name ('{}')", out[i].path);
      for (size_t j = 0; j < i; ++j) check(out[j].name != out[i].name, "two LoRA adapters are named '{}'", out[i].name);
    }
    return out;
  }

  // Loads the adapters onto `model` (checked against it); returns how many.
  size_t load(Model& model) const {
    std::vector<std::shared_ptr<const LoraAdapter>> adapters;
    for (const auto& s : specs()) adapters.push_back(load_lora(s.path, model.config(), s.name, s.scale));
    model.set_adapters(adapters);
    return adapters.size();
  }
};

}  // namespace serval::cli
