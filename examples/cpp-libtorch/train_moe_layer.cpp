// Trains the LoRA factors of one MoE layer whose routed experts run in kt,
// through the torch.ops.kt operators: the layer learns to match a teacher
// whose expert weights differ by a low-rank update. The optimizer is kt's
// fused AdamW over the layer (kt_torch::LayerOptimizer, the default) or
// libtorch's torch::optim::AdamW; both compute the same numbers.
//
//   kt_libtorch_train [steps] [kt|torch]
//       prints "step <i> loss <value>"; exits 0 when the mean of the last 5
//       losses is below a fifth of the first (batches are random, so one
//       step alone is noisy).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kt_torch.h"

using LayerPtr = c10::intrusive_ptr<kt_torch::MoeLayer>;

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 60;
  const bool kt_optimizer = argc <= 2 || std::strcmp(argv[2], "torch") != 0;
  const int64_t E = 8, k = 2, H = 64, I = 48, T = 96, rank = 4;
  torch::manual_seed(0);

  // The op as any libtorch program reaches it: through the dispatcher.
  auto moe = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("kt::moe", "")
                 .typed<at::Tensor(const LayerPtr&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&)>();

  const auto gate = torch::randn({E, I, H}) / std::sqrt(double(H));
  const auto up = torch::randn({E, I, H}) / std::sqrt(double(H));
  const auto down = torch::randn({E, H, I}) / std::sqrt(double(I));
  // The teacher's gate projection carries a rank-2 change per expert.
  const auto delta = torch::matmul(torch::randn({E, I, 2}), torch::randn({E, 2, H})) * 0.1;

  auto teacher = c10::make_intrusive<kt_torch::MoeLayer>(E, k, H, I, "silu", 0.0, "inference",
                                                         1, 1.0, T, 0);
  teacher->load_weights(gate + delta, up, down);
  auto student = c10::make_intrusive<kt_torch::MoeLayer>(E, k, H, I, "silu", 0.0, "lora", rank,
                                                         8.0, T, 0);
  student->load_weights(gate, up, down);

  const double lr = 2e-2, weight_decay = 0;
  std::unique_ptr<torch::optim::AdamW> torch_opt;
  c10::intrusive_ptr<kt_torch::LayerOptimizer> kt_opt;
  if (!kt_optimizer)
    torch_opt = std::make_unique<torch::optim::AdamW>(
        student->parameters(), torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  double first = 0, tail = 0;
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn({T, H});
    auto scores = torch::softmax(torch::randn({T, E}), -1);
    auto top = torch::topk(scores, k, -1);
    auto weights = std::get<0>(top);
    auto ids = std::get<1>(top);
    at::Tensor target;
    {
      torch::NoGradGuard no_grad;
      target = moe.call(teacher, x, ids, weights);
    }
    for (auto& p : student->parameters()) p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
    auto y = moe.call(student, x, ids, weights);
    auto loss = torch::mse_loss(y, target);
    loss.backward();
    if (torch_opt) {
      torch_opt->step();
    } else {
      // Made at the first step: kt's optimizer reads the gradients kt has bound.
      if (!kt_opt)
        kt_opt = c10::make_intrusive<kt_torch::LayerOptimizer>(student, "adamw", lr, weight_decay, 0.9,
                                                               0.999, 1e-8, 0.0, false);
      kt_opt->step(1.0, 1.0);
    }
    const double value = loss.item<double>();
    if (step == 0) first = value;
    if (step >= steps - 5) tail += value / 5;
    std::printf("step %d loss %.9f\n", step, value);
  }
  const bool ok = steps >= 5 && tail < 0.2 * first;
  std::printf("%s AdamW: first %.6f last-5 mean %.6f: %s\n", kt_optimizer ? "kt" : "libtorch", first, tail,
              ok ? "trained" : "did not train");
  return ok ? 0 : 1;
}
