#include "moe/reference.h"

#include <algorithm>
#include <cmath>

namespace kt {
namespace reference {

namespace {

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

struct Route {
  std::vector<double> g, u, a, lz[3];  // lz: A_p z for each LoRA projection
};

bool lora(const Spec& s, int p) { return s.rank > 0 && ((s.targets >> p) & 1u); }

int64_t in_dim(const Spec& s, int p) { return p == 2 ? s.I : s.H; }
int64_t out_dim(const Spec& s, int p) { return p == 2 ? s.H : s.I; }

// out = W_eff[e] z + b, with W_eff = W + s B A; lz = A z.
void project(const Spec& s, const Params& P, int p, int64_t e, const double* z, double* out,
             std::vector<double>* lz) {
  const int64_t in = in_dim(s, p), outn = out_dim(s, p), r = s.rank;
  const float* W = P.w[p].data() + e * outn * in;
  for (int64_t o = 0; o < outn; ++o) {
    double acc = s.bias ? P.b[p][static_cast<size_t>(e * outn + o)] : 0.0;
    for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(W[o * in + i]) * z[i];
    out[o] = acc;
  }
  if (!lora(s, p)) return;
  lz->assign(static_cast<size_t>(r), 0.0);
  const float* A = P.la[p].data() + e * r * in;
  const float* B = P.lb[p].data() + e * outn * r;
  for (int64_t q = 0; q < r; ++q) {
    double acc = 0;
    for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(A[q * in + i]) * z[i];
    (*lz)[static_cast<size_t>(q)] = acc;
  }
  for (int64_t o = 0; o < outn; ++o) {
    double acc = 0;
    for (int64_t q = 0; q < r; ++q) acc += static_cast<double>(B[o * r + q]) * (*lz)[static_cast<size_t>(q)];
    out[o] += s.lora_scale * acc;
  }
}

// z-gradient of W_eff^T delta, plus LoRA grads for projection p.
void project_back(const Spec& s, const Params& P, int p, int64_t e, const double* z,
                  const double* delta, const std::vector<double>& lz, double* dz, Grads* G) {
  const int64_t in = in_dim(s, p), outn = out_dim(s, p), r = s.rank;
  const float* W = P.w[p].data() + e * outn * in;
  for (int64_t o = 0; o < outn; ++o)
    for (int64_t i = 0; i < in; ++i) dz[i] += static_cast<double>(W[o * in + i]) * delta[o];
  double* dW = G->dW[p].data() + e * outn * in;
  for (int64_t o = 0; o < outn; ++o)
    for (int64_t i = 0; i < in; ++i) dW[o * in + i] += delta[o] * z[i];
  if (s.bias)
    for (int64_t o = 0; o < outn; ++o) G->db[p][static_cast<size_t>(e * outn + o)] += delta[o];
  if (!lora(s, p)) return;
  const float* A = P.la[p].data() + e * r * in;
  const float* B = P.lb[p].data() + e * outn * r;
  std::vector<double> btd(static_cast<size_t>(r), 0.0);  // B^T delta
  for (int64_t q = 0; q < r; ++q)
    for (int64_t o = 0; o < outn; ++o) btd[static_cast<size_t>(q)] += static_cast<double>(B[o * r + q]) * delta[o];
  for (int64_t q = 0; q < r; ++q)
    for (int64_t i = 0; i < in; ++i)
      dz[i] += s.lora_scale * static_cast<double>(A[q * in + i]) * btd[static_cast<size_t>(q)];
  double* dA = G->dla[p].data() + e * r * in;
  double* dB = G->dlb[p].data() + e * outn * r;
  for (int64_t q = 0; q < r; ++q)
    for (int64_t i = 0; i < in; ++i) dA[q * in + i] += s.lora_scale * btd[static_cast<size_t>(q)] * z[i];
  for (int64_t o = 0; o < outn; ++o)
    for (int64_t q = 0; q < r; ++q) dB[o * r + q] += s.lora_scale * delta[o] * lz[static_cast<size_t>(q)];
}

bool routed(const Params& P, int64_t e) {
  return e >= 0 && (P.skipped.empty() || !P.skipped[static_cast<size_t>(e)]);
}

void clamp_gu(const Spec& s, double* g, double* u, bool* gpass, bool* upass) {
  *gpass = *upass = true;
  if (s.limit > 0) {
    if (*g > s.limit) { *g = s.limit; *gpass = false; }
    if (*u > s.limit) { *u = s.limit; *upass = false; }
    if (*u < -s.limit) { *u = -s.limit; *upass = false; }
  }
}

}  // namespace

double activation(const Spec& s, double g, double u) {
  bool gp, up;
  clamp_gu(s, &g, &u, &gp, &up);
  if (s.activation == KT_ACT_SWIGLU_OAI) return g * sigmoid(s.alpha * g) * (u + 1.0);
  return g * sigmoid(g) * u;
}

std::vector<double> forward(const Spec& s, const Params& P, int64_t T, const std::vector<double>& x,
                            const std::vector<int64_t>& ids, const std::vector<double>& w) {
  std::vector<double> y(static_cast<size_t>(T * s.H), 0.0);
  std::vector<double> g(static_cast<size_t>(s.I)), u(static_cast<size_t>(s.I)), a(static_cast<size_t>(s.I)),
      o(static_cast<size_t>(s.H));
  std::vector<double> lz;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < s.K; ++j) {
      const int64_t e = ids[static_cast<size_t>(t * s.K + j)];
      if (!routed(P, e)) continue;
      const double* xt = x.data() + t * s.H;
      project(s, P, 0, e, xt, g.data(), &lz);
      project(s, P, 1, e, xt, u.data(), &lz);
      for (int64_t i = 0; i < s.I; ++i) a[static_cast<size_t>(i)] = activation(s, g[static_cast<size_t>(i)], u[static_cast<size_t>(i)]);
      project(s, P, 2, e, a.data(), o.data(), &lz);
      for (int64_t h = 0; h < s.H; ++h) y[static_cast<size_t>(t * s.H + h)] += w[static_cast<size_t>(t * s.K + j)] * o[static_cast<size_t>(h)];
    }
  return y;
}

Grads backward(const Spec& s, const Params& P, int64_t T, const std::vector<double>& x,
               const std::vector<int64_t>& ids, const std::vector<double>& w,
               const std::vector<double>& dy) {
  Grads G;
  G.dx.assign(static_cast<size_t>(T * s.H), 0.0);
  G.dw.assign(static_cast<size_t>(T * s.K), 0.0);
  for (int p = 0; p < 3; ++p) {
    const int64_t in = in_dim(s, p), out = out_dim(s, p);
    G.dW[p].assign(static_cast<size_t>(s.E * out * in), 0.0);
    G.db[p].assign(static_cast<size_t>(s.E * out), 0.0);
    if (lora(s, p)) {
      G.dla[p].assign(static_cast<size_t>(s.E * s.rank * in), 0.0);
      G.dlb[p].assign(static_cast<size_t>(s.E * out * s.rank), 0.0);
    }
  }
  const size_t I = static_cast<size_t>(s.I), H = static_cast<size_t>(s.H);
  std::vector<double> g(I), u(I), a(I), o(H), delta(H), da(I), dg(I), du(I), dz(I);
  std::vector<double> lzg, lzu, lzd;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < s.K; ++j) {
      const int64_t e = ids[static_cast<size_t>(t * s.K + j)];
      if (!routed(P, e)) continue;
      const double wt = w[static_cast<size_t>(t * s.K + j)];
      const double* xt = x.data() + t * s.H;
      const double* dyt = dy.data() + t * s.H;
      project(s, P, 0, e, xt, g.data(), &lzg);
      project(s, P, 1, e, xt, u.data(), &lzu);
      for (size_t i = 0; i < I; ++i) a[i] = activation(s, g[i], u[i]);
      project(s, P, 2, e, a.data(), o.data(), &lzd);
      double dwv = 0;
      for (size_t h = 0; h < H; ++h) dwv += dyt[h] * o[h];
      G.dw[static_cast<size_t>(t * s.K + j)] = dwv;
      for (size_t h = 0; h < H; ++h) delta[h] = wt * dyt[h];
      std::fill(da.begin(), da.end(), 0.0);
      project_back(s, P, 2, e, a.data(), delta.data(), lzd, da.data(), &G);
      for (size_t i = 0; i < I; ++i) {
        double gc = g[i], uc = u[i];
        bool gp, up;
        clamp_gu(s, &gc, &uc, &gp, &up);
        double dadg, dadu;
        if (s.activation == KT_ACT_SWIGLU_OAI) {
          const double sg = sigmoid(s.alpha * gc);
          dadg = (sg + gc * s.alpha * sg * (1 - sg)) * (uc + 1);
          dadu = gc * sg;
        } else {
          const double sg = sigmoid(gc);
          dadg = sg * (1 + gc * (1 - sg)) * uc;
          dadu = gc * sg;
        }
        dg[i] = gp ? da[i] * dadg : 0.0;
        du[i] = up ? da[i] * dadu : 0.0;
      }
      double* dxt = G.dx.data() + t * s.H;
      project_back(s, P, 0, e, xt, dg.data(), lzg, dxt, &G);
      project_back(s, P, 1, e, xt, du.data(), lzu, dxt, &G);
    }
  return G;
}

}  // namespace reference
}  // namespace kt
