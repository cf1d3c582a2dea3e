// `serval chat-template`: renders a chat template for a conversation (to check a template, or to see
// the exact prompt a chat request becomes).
#include <fmt/core.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/commands.h"
#include "base/error.h"
#include "base/file_util.h"
#include "model/model.h"
#include "server/jinja.h"

namespace serval::cli {
namespace {

struct TemplateOptions {
  std::string model, template_file, messages, bos, eos;
  bool no_generation_prompt = false;
};

void run_template(const TemplateOptions& o) {
  std::string source = o.template_file.empty() ? "" : read_text_file(o.template_file);
  nlohmann::ordered_json ctx{{"bos_token", o.bos}, {"eos_token", o.eos}, {"add_generation_prompt", !o.no_generation_prompt}};
  if (!o.model.empty()) {
    auto m = Model::load(resolve_model_path(o.model));
    const auto& v = m->tokenizer().vocab();
    if (source.empty()) source = v.chat_template;
    if (o.bos.empty() && v.bos >= 0) ctx["bos_token"] = v.tokens[v.bos];
    if (o.eos.empty() && v.eos >= 0) ctx["eos_token"] = v.tokens[v.eos];
  }
  check(!source.empty(), "no chat template (give --template FILE or a model that has one)");
  try {
    ctx["messages"] = nlohmann::ordered_json::parse(o.messages.rfind("@", 0) == 0 ? read_text_file(o.messages.substr(1)) : o.messages);
  } catch (const nlohmann::json::exception& e) {
    fail("--messages is not valid JSON: {}", e.what());
  }
  fmt::print("{}", jinja::Template(source).render(ctx));
}

}  // namespace

void add_template(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat-template", "Render a chat template for a conversation");
  auto o = std::make_shared<TemplateOptions>();
  cmd->add_option("-m,--model,model", o->model, "take the template and BOS/EOS from this model");
  cmd->add_option("--template", o->template_file, "Jinja template file");
  cmd->add_option("--messages", o->messages, "JSON list of {role, content}, or @FILE")->required();
  cmd->add_option("--bos", o->bos, "bos_token");
  cmd->add_option("--eos", o->eos, "eos_token");
  cmd->add_flag("--no-generation-prompt", o->no_generation_prompt, "add_generation_prompt = false");
  cmd->callback([o] { run_template(*o); });
}

}  // namespace serval::cli
