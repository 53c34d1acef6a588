// The (decoupled) PPO loss, its gradient w.r.t. logp, and its statistics in one pass, CPU.
//
// Python twin: the torch path of realscale/algo/losses.py (see its docstring for the
// maths). The torch path runs ~40 elementwise ops and reductions over the tokens (each a
// full pass over memory); here each token is read once and its loss, gradient and
// statistics computed in registers.
//
// Determinism: the tokens are cut into a fixed number of chunks (independent of the
// thread count); each chunk sums in double, and the chunks are added in order, so the
// result does not depend on how many threads ran.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Order of the statistics vector returned to Python (keep in sync with losses.py).
enum Stat : int {
  kLoss = 0,      // sum of coef * w * l
  kValid,         // valid tokens
  kClipped,       // valid tokens whose gradient the (1 - eps, 1 + eps_high) clip stopped
  kDual,          // valid tokens bounded by the dual clip
  kRatioSum,      // sum of r
  kApproxKlSum,   // sum of logp_prox - logp
  kWeightSum,     // sum of w (after the cap)
  kCapped,        // tokens whose w exceeded the cap
  kBehavKlSum,    // sum of logp_prox - logp_behav
  kNumStats
};

using Acc = std::array<double, kNumStats>;

struct Params {
  double coef;  // per-token coefficient when no coef tensor is given (1 / normalizer)
  double lo, hi, dual, cap;
  bool clamp_mode;
};

template <typename scalar_t, bool kDecoupled, bool kCoefTensor>
void ppo_chunk(const scalar_t* __restrict__ logp, const scalar_t* __restrict__ prox,
               const scalar_t* __restrict__ behav, const scalar_t* __restrict__ adv,
               const bool* __restrict__ mask, const scalar_t* __restrict__ coef_t, const Params& p,
               scalar_t* __restrict__ grad, int64_t begin, int64_t end, Acc& out) {
  // Local sums: the compiler keeps them in registers (the output slot could alias grad).
  Acc acc{};
  for (int64_t t = begin; t < end; ++t) {
    if (!mask[t]) {
      grad[t] = 0;
      continue;
    }
    const scalar_t d = logp[t] - prox[t];
    const scalar_t r = std::exp(d);
    scalar_t w = 1;
    if (kDecoupled) {
      const scalar_t lw = prox[t] - behav[t];
      w = std::exp(lw);
      if (!std::isfinite(w)) w = 0;  // a broken log-prob: drop the token
      if (p.cap > 0 && w > p.cap) {
        acc[kCapped] += 1;
        w = p.clamp_mode ? static_cast<scalar_t>(p.cap) : scalar_t(0);
      }
      acc[kWeightSum] += w;
      acc[kBehavKlSum] += lw;
    }
    const scalar_t c = (kCoefTensor ? coef_t[t] : static_cast<scalar_t>(p.coef)) * w;
    const scalar_t neg_a = -adv[t];
    const scalar_t l1 = neg_a * r;
    const scalar_t rc = std::min(std::max(r, static_cast<scalar_t>(p.lo)), static_cast<scalar_t>(p.hi));
    const scalar_t l2 = neg_a * rc;
    bool active = l1 >= l2;
    scalar_t l = active ? l1 : l2;
    if (p.dual > 0 && adv[t] < 0 && l > neg_a * static_cast<scalar_t>(p.dual)) {
      l = neg_a * static_cast<scalar_t>(p.dual);
      active = false;
      acc[kDual] += 1;
    } else if (!active) {
      acc[kClipped] += 1;
    }
    grad[t] = active ? c * l1 : scalar_t(0);
    acc[kLoss] += static_cast<double>(c) * static_cast<double>(l);
    acc[kValid] += 1;
    acc[kRatioSum] += r;
    acc[kApproxKlSum] -= d;
  }
  out = acc;
}

void check(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "ppo_loss: ", name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 1 && x.numel() == like.numel(), "ppo_loss: ", name, " must be 1-D with ",
              like.numel(), " elements, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), "ppo_loss: ", name, " dtype ", x.scalar_type(),
              " != logp dtype ", like.scalar_type());
}

// Returns (grad w.r.t. logp [N], stats [kNumStats] float64).
std::vector<at::Tensor> ppo_loss_fwd(const at::Tensor& logp_in, const at::Tensor& prox_in,
                                     const std::optional<at::Tensor>& behav_in, const at::Tensor& adv_in,
                                     const at::Tensor& mask_in, const std::optional<at::Tensor>& coef_in,
                                     double coef, double lo, double hi, double dual, double cap,
                                     bool clamp_mode) {
  const at::Tensor logp = logp_in.contiguous();
  const at::Tensor prox = prox_in.contiguous();
  const at::Tensor adv = adv_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  check(logp, logp, "logp");
  check(prox, logp, "logp_prox");
  check(adv, logp, "advantages");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == logp.numel() && mask.dim() == 1,
              "ppo_loss: loss_mask must be a 1-D bool tensor with ", logp.numel(), " elements");
  std::optional<at::Tensor> behav, coef_t;
  if (behav_in) {
    behav = behav_in->contiguous();
    check(*behav, logp, "logp_behav");
  }
  if (coef_in) {
    coef_t = coef_in->contiguous();
    check(*coef_t, logp, "coef");
  }
  const Params p{coef, lo, hi, dual, cap, clamp_mode};
  const int64_t n = logp.numel();
  at::Tensor grad = at::empty_like(logp);
  // Fixed chunking (see the header); small inputs make one chunk.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(64, n / 4096));
  std::vector<Acc> partial(static_cast<size_t>(chunks));
  for (auto& a : partial) a.fill(0.0);

  AT_DISPATCH_FLOATING_TYPES(logp.scalar_type(), "ppo_loss_fwd", [&] {
    const scalar_t* lp = logp.data_ptr<scalar_t>();
    const scalar_t* px = prox.data_ptr<scalar_t>();
    const scalar_t* bh = behav ? behav->data_ptr<scalar_t>() : nullptr;
    const scalar_t* ad = adv.data_ptr<scalar_t>();
    const bool* mk = mask.data_ptr<bool>();
    const scalar_t* ct = coef_t ? coef_t->data_ptr<scalar_t>() : nullptr;
    scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = n * c / chunks, e = n * (c + 1) / chunks;
        Acc& acc = partial[static_cast<size_t>(c)];
        if (bh && ct) ppo_chunk<scalar_t, true, true>(lp, px, bh, ad, mk, ct, p, g, b, e, acc);
        else if (bh) ppo_chunk<scalar_t, true, false>(lp, px, bh, ad, mk, ct, p, g, b, e, acc);
        else if (ct) ppo_chunk<scalar_t, false, true>(lp, px, bh, ad, mk, ct, p, g, b, e, acc);
        else ppo_chunk<scalar_t, false, false>(lp, px, bh, ad, mk, ct, p, g, b, e, acc);
      }
    });
  });
  at::Tensor stats = at::zeros({kNumStats}, at::kDouble);
  double* s = stats.data_ptr<double>();
  for (const Acc& a : partial)
    for (int i = 0; i < kNumStats; ++i) s[i] += a[i];
  return {grad, stats};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused (decoupled) PPO loss forward + gradient + statistics (CPU); see realscale/algo/losses.py";
  m.def("ppo_loss_fwd", &ppo_loss_fwd,
        "(logp, logp_prox, logp_behav|None, advantages, mask, coef|None, coef_scalar, lo, hi, dual, cap, "
        "clamp_mode) -> [grad_logp, stats(float64: loss, valid, clipped, dual, ratio_sum, approx_kl_sum, "
        "weight_sum, capped, behav_kl_sum)]");
}
