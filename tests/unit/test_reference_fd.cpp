// The reference itself, checked by central finite differences in double:
// every gradient it returns against d<dy, y>/dparam of its own forward.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "moe/reference.h"

namespace {

using kt::reference::Grads;
using kt::reference::Params;
using kt::reference::Spec;

struct Problem {
  Spec s;
  Params p;
  int64_t T = 3;
  std::vector<double> x, w, dy;
  std::vector<int64_t> ids;
};

Problem make(kt_activation act, double limit, bool bias, int64_t rank) {
  Problem q;
  q.s.E = 3; q.s.K = 2; q.s.H = 6; q.s.I = 5;
  q.s.activation = act;
  q.s.limit = limit;
  q.s.bias = bias;
  q.s.rank = rank;
  q.s.lora_scale = 0.7;
  std::mt19937 rng(11);
  std::normal_distribution<double> nd;
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == 2 ? q.s.I : q.s.H, out = p == 2 ? q.s.H : q.s.I;
    for (int64_t i = 0; i < q.s.E * in * out; ++i) q.p.w[p].push_back(static_cast<float>(0.5 * nd(rng)));
    for (int64_t i = 0; i < q.s.E * out; ++i) q.p.b[p].push_back(static_cast<float>(0.2 * nd(rng)));
    for (int64_t i = 0; i < q.s.E * rank * in; ++i) q.p.la[p].push_back(static_cast<float>(0.5 * nd(rng)));
    for (int64_t i = 0; i < q.s.E * out * rank; ++i) q.p.lb[p].push_back(static_cast<float>(0.5 * nd(rng)));
  }
  for (int64_t i = 0; i < q.T * q.s.H; ++i) {
    q.x.push_back(nd(rng));
    q.dy.push_back(nd(rng));
  }
  q.ids = {0, 2, 1, -1, 2, 1};
  q.w = {0.6, 0.4, 0.9, 0.3, 0.5, 0.5};
  return q;
}

double loss(const Problem& q) {
  std::vector<double> y = kt::reference::forward(q.s, q.p, q.T, q.x, q.ids, q.w);
  double l = 0;
  for (size_t i = 0; i < y.size(); ++i) l += y[i] * q.dy[i];
  return l;
}

// Central difference of the loss in one float parameter.
using Field = std::vector<float> (Params::*)[3];

double fd_float(Problem q, Field field, int p, size_t i) {
  std::vector<float>* v = &(q.p.*field)[p];
  const float h = 1e-3f;
  const float orig = (*v)[i];
  (*v)[i] = orig + h;
  const double lp = loss(q);
  (*v)[i] = orig - h;
  const double lm = loss(q);
  const double step = (static_cast<double>(orig + h) - static_cast<double>(orig - h));
  return (lp - lm) / step;
}

void expect_fd(double analytic, double numeric, const std::string& what) {
  // h = 1e-3 in float parameters (1e-6 in double inputs): the O(h^2)
  // truncation of a smooth function with O(1) third derivatives stays far
  // below this bound; the steps are small enough not to cross a clamp kink
  // at these points.
  EXPECT_NEAR(analytic, numeric, 2e-4 * (1.0 + std::fabs(numeric))) << what;
}

class ReferenceFd : public ::testing::TestWithParam<int> {};

TEST_P(ReferenceFd, GradientsMatchFiniteDifferences) {
  const int variant = GetParam();
  const kt_activation act = variant == 2 ? KT_ACT_SWIGLU_OAI : KT_ACT_SILU;
  const double limit = variant == 0 ? 0.0 : (variant == 1 ? 1.3 : 2.0);
  Problem q = make(act, limit, true, 2);
  Grads g = kt::reference::backward(q.s, q.p, q.T, q.x, q.ids, q.w, q.dy);
  for (size_t i = 0; i < q.x.size(); ++i) {
    Problem a = q, b = q;
    a.x[i] += 1e-6;
    b.x[i] -= 1e-6;
    expect_fd(g.dx[i], (loss(a) - loss(b)) / 2e-6, "dx " + std::to_string(i));
  }
  for (size_t i = 0; i < q.w.size(); ++i) {
    if (q.ids[i] < 0) {
      EXPECT_EQ(g.dw[i], 0.0);
      continue;
    }
    Problem a = q, b = q;
    a.w[i] += 1e-6;
    b.w[i] -= 1e-6;
    expect_fd(g.dw[i], (loss(a) - loss(b)) / 2e-6, "dw " + std::to_string(i));
  }
  for (int p = 0; p < 3; ++p) {
    for (size_t i = 0; i < q.p.w[p].size(); i += 3)
      expect_fd(g.dW[p][i], fd_float(q, &Params::w, p, i), "dW" + std::to_string(p));
    for (size_t i = 0; i < q.p.b[p].size(); ++i)
      expect_fd(g.db[p][i], fd_float(q, &Params::b, p, i), "db" + std::to_string(p));
    for (size_t i = 0; i < q.p.la[p].size(); ++i)
      expect_fd(g.dla[p][i], fd_float(q, &Params::la, p, i), "dA" + std::to_string(p));
    for (size_t i = 0; i < q.p.lb[p].size(); ++i)
      expect_fd(g.dlb[p][i], fd_float(q, &Params::lb, p, i), "dB" + std::to_string(p));
  }
}

std::string variant_name(const ::testing::TestParamInfo<int>& info) {
  static const char* const names[] = {"silu", "silu_limit", "swiglu_oai"};
  return names[info.param];
}

INSTANTIATE_TEST_SUITE_P(Activations, ReferenceFd, ::testing::Values(0, 1, 2), variant_name);

}  // namespace
