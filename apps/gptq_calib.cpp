#include "apps/gptq_calib.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "base/error.h"
#include "apps/commands.h"
#include "model/session.h"

namespace serval::cli {
namespace {

constexpr double kWindowBytes = 4.0 * (1 << 30);

// "blk.12.attn_q.weight" -> 12; -1 for weights outside the layers.
int layer_of(const std::string& name) {
  if (!name.starts_with("blk.")) return -1;
  return std::atoi(name.c_str() + 4);
}

class WindowedHessians {
 public:
  WindowedHessians(const GptqCalibration& c, std::vector<int> order) : c_(c), order_(std::move(order)) {
    check(c.ctx >= 16 && c.chunks >= 1, "--calib-ctx must be at least 16 and --calib-chunks at least 1");
    check(c.layers_per_pass >= 0, "--gptq-layers must not be negative");
    model_ = Model::load(c.model);
    chunks_ = text_chunks(model_->tokenizer(), c.text, c.ctx, c.chunks, "--calib-ctx");
    per_pass_ = c.layers_per_pass > 0 ? size_t(c.layers_per_pass) : size_t(std::max(1.0, kWindowBytes / layer_bytes()));
  }

  std::shared_ptr<const Hessian> get(const std::string& name) {
    const int layer = layer_of(name);
    if (layer < 0 || name == "output.weight") return nullptr;
    if (!window_.count(layer)) measure(layer);
    const auto it = set_.find(name);
    return it == set_.end() ? nullptr : it->second;
  }

 private:
  // The most a layer's Hessians take: one per distinct input (q/k/v, output, gate/up, down), floats.
  double layer_bytes() const {
    double most = 1;
    for (const auto& L : model_->weights().layers) {
      double n2 = 0;
      for (const auto* m : {&L.wq, &L.wo, &L.w_gate, &L.w_down}) n2 += double(m->cols) * double(m->cols);
      most = std::max(most, 4 * n2);
    }
    return most;
  }

  // One run over the text, summing the Hessians of the window of layers that starts at `layer`.
  void measure(int layer) {
    const auto at = std::find(order_.begin(), order_.end(), layer);
    check(at != order_.end(), "internal: layer {} is not in the quantization order", layer);
    window_ = std::set<int>(at, at + std::min<ptrdiff_t>(ptrdiff_t(per_pass_), order_.end() - at));
    set_.clear();  // the previous window's Hessians are done with
    std::shared_ptr<Hessian> last;
    const float* last_x = nullptr;
    model_->set_matmul_observer([&](const std::string& name, const float* x, int64_t n_tok, int64_t cols) {
      if (!window_.count(layer_of(name)) || name == "output.weight") return;
      const bool follower = name.ends_with("attn_k.weight") || name.ends_with("attn_v.weight") || name.ends_with("ffn_up.weight");
      auto& h = set_[name];
      if (follower && x == last_x && last) return void(h = last);  // the same input as the weight before
      if (!h) h = std::make_shared<Hessian>(cols);
      h->add(x, n_tok);
      last = h, last_x = x;
    });
    SingleSequence seq(*model_, c_.ctx);
    for (size_t i = 0; i < chunks_.size(); ++i) {
      seq.reset();
      seq.eval(chunks_[i], false, c_.ctx);
      last_x = nullptr;
      fmt::print(stderr, "serval quantize: gptq calibration of {} layers (blk.{} ...): chunk {}/{}\n", window_.size(),
                 layer, i + 1, chunks_.size());
    }
    model_->set_matmul_observer(nullptr);
  }

  GptqCalibration c_;
  std::vector<int> order_;
  std::unique_ptr<Model> model_;
  std::vector<std::vector<int32_t>> chunks_;
  size_t per_pass_ = 1;
  std::set<int> window_;
  HessianSet set_;
};

}  // namespace

HessianSource gptq_hessians(const GptqCalibration& c, const std::vector<TensorChoice>& choices) {
  std::vector<int> order;  // the layers in the order quantize_file writes (and asks for) their weights
  for (const auto& t : choices)
    if (const int layer = layer_of(t.name); layer >= 0 && std::find(order.begin(), order.end(), layer) == order.end())
      order.push_back(layer);
  auto w = std::make_shared<WindowedHessians>(c, std::move(order));
  return [w](const std::string& name) { return w->get(name); };
}

}  // namespace serval::cli
