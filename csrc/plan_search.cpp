// Simulated annealing over role placements, CPU.
//
// Python twin: realscale/planner/search.py (evaluate, sync_seconds, anneal_py). The
// evaluator below is the same formula line by line: a list schedule of the roles (a role
// starts when its dependencies are done and the GPUs of its mesh are free), the weight
// move from the training to the generation layout, offloading of training state when its
// mesh is shared, and for the disaggregated mode the overlap rule of the staleness bound.
// Options of all roles are flat arrays; offsets[r]..offsets[r+1] are role r's.
//
// Why C++: a 70B model on 1,024 GPUs has ~10^5 placements per role; annealing needs
// ~10^5-10^6 evaluations, which is seconds in Python and milliseconds here.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

namespace {

constexpr double kInfeasible = 1e18;

struct Instance {
  std::vector<int64_t> off, lo, hi, tp, div, kinds;
  std::vector<double> secs, state, consts;
  std::vector<std::vector<int64_t>> deps;
  int64_t gen, train, mode, eta, R;
};

inline int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}

double sync_seconds(const Instance& I, int64_t gi, int64_t ti) {
  const double w = I.consts[0], nvl = I.consts[1], ib = I.consts[2], link = I.consts[3], ovh = I.consts[4];
  const int64_t g = static_cast<int64_t>(I.consts[6]);
  const int64_t glo = I.lo[gi], ghi = I.hi[gi], tlo = I.lo[ti], thi = I.hi[ti];
  const double frac = double(overlap(glo, ghi, tlo, thi)) / double(ghi - glo);
  const double gen_tp = double(I.tp[gi]);
  const double held = frac >= 1.0 ? std::min(1.0, gen_tp / double(I.div[ti])) : 0.0;
  const bool same_nodes = glo / g >= tlo / g && (ghi - 1) / g <= (thi - 1) / g;
  const double bw = same_nodes ? nvl : ib;
  return w / gen_tp * (1.0 - held) / (bw * 1e9 * link) + (frac > 0 ? 0.0 : ovh);
}

// choice[r] is an index into role r's options (global index = off[r] + choice[r]).
double evaluate(const Instance& I, const std::vector<int64_t>& choice, std::vector<double>& t,
                std::vector<double>& end) {
  const int64_t R = I.R;
  auto gidx = [&](int64_t r) { return I.off[r] + choice[r]; };
  for (int64_t r = 0; r < R; ++r) t[r] = I.secs[gidx(r)];
  const double pcie = I.consts[5];
  for (int64_t r = 0; r < R; ++r) {
    if (I.kinds[r] != 1) continue;
    bool shared = false;
    for (int64_t q = 0; q < R && !shared; ++q)
      shared = q != r && overlap(I.lo[gidx(r)], I.hi[gidx(r)], I.lo[gidx(q)], I.hi[gidx(q)]) > 0;
    if (shared) t[r] += 2.0 * I.state[gidx(r)] / pcie;
  }
  const double sync = sync_seconds(I, gidx(I.gen), gidx(I.train));
  const int64_t g = gidx(I.gen);
  if (I.mode == 1) {
    for (int64_t q = 0; q < R; ++q)
      if (q != I.gen && overlap(I.lo[g], I.hi[g], I.lo[gidx(q)], I.hi[gidx(q)]) > 0) return kInfeasible;
  }
  for (int64_t r = 0; r < R; ++r) {
    end[r] = 0.0;
    if (I.mode == 1 && r == I.gen) continue;
    double start = (I.mode == 0 && r == I.gen) ? sync : 0.0;
    for (int64_t d : I.deps[r])
      if (!(I.mode == 1 && d == I.gen)) start = std::max(start, end[d]);
    for (int64_t q = 0; q < r; ++q)
      if (overlap(I.lo[gidx(r)], I.hi[gidx(r)], I.lo[gidx(q)], I.hi[gidx(q)]) > 0 && !(I.mode == 1 && q == I.gen))
        start = std::max(start, end[q]);
    end[r] = start + t[r];
  }
  if (I.mode == 0) return *std::max_element(end.begin(), end.end());
  double t_train = 0.0;
  for (int64_t r = 0; r < R; ++r)
    if (r != I.gen) t_train = std::max(t_train, end[r]);
  const double t_gen = t[I.gen];
  return I.eta == 0 ? t_gen + t_train + sync : std::max(t_gen, t_train) + sync;
}

template <typename T>
std::vector<T> vec(const torch::Tensor& x) {
  auto c = x.contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

std::tuple<torch::Tensor, double> anneal(torch::Tensor offsets, torch::Tensor lo, torch::Tensor hi,
                                         torch::Tensor secs, torch::Tensor state, torch::Tensor tp,
                                         torch::Tensor div, torch::Tensor kinds, torch::Tensor deps, int64_t gen,
                                         int64_t train, int64_t mode, int64_t eta, torch::Tensor consts,
                                         torch::Tensor init, int64_t iters, int64_t seed) {
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && lo.scalar_type() == torch::kInt64 &&
                  hi.scalar_type() == torch::kInt64 && tp.scalar_type() == torch::kInt64 &&
                  div.scalar_type() == torch::kInt64 && kinds.scalar_type() == torch::kInt64 &&
                  deps.scalar_type() == torch::kInt64 && init.scalar_type() == torch::kInt64,
              "plan_search.anneal: index arrays must be int64");
  TORCH_CHECK(secs.scalar_type() == torch::kFloat64 && state.scalar_type() == torch::kFloat64 &&
                  consts.scalar_type() == torch::kFloat64,
              "plan_search.anneal: seconds, state and consts must be float64");
  Instance I;
  I.off = vec<int64_t>(offsets);
  I.R = static_cast<int64_t>(I.off.size()) - 1;
  TORCH_CHECK(I.R >= 1 && init.numel() == I.R && kinds.numel() == I.R, "plan_search.anneal: ", I.R,
              " roles but init/kinds have ", init.numel(), "/", kinds.numel(), " entries");
  TORCH_CHECK(deps.dim() == 2 && deps.size(0) == I.R && deps.size(1) == I.R, "plan_search.anneal: deps must be RxR");
  TORCH_CHECK(consts.numel() == 7, "plan_search.anneal: consts must have 7 entries");
  I.lo = vec<int64_t>(lo);
  I.hi = vec<int64_t>(hi);
  I.tp = vec<int64_t>(tp);
  I.div = vec<int64_t>(div);
  I.kinds = vec<int64_t>(kinds);
  I.secs = vec<double>(secs);
  I.state = vec<double>(state);
  I.consts = vec<double>(consts);
  TORCH_CHECK(static_cast<int64_t>(I.lo.size()) == I.off.back(), "plan_search.anneal: option arrays have ",
              I.lo.size(), " entries, offsets say ", I.off.back());
  auto dm = vec<int64_t>(deps);
  I.deps.assign(I.R, {});
  for (int64_t r = 0; r < I.R; ++r)
    for (int64_t d = 0; d < I.R; ++d)
      if (dm[r * I.R + d]) I.deps[r].push_back(d);
  I.gen = gen;
  I.train = train;
  I.mode = mode;
  I.eta = eta;
  std::vector<int64_t> cur = vec<int64_t>(init);
  for (int64_t r = 0; r < I.R; ++r)
    TORCH_CHECK(cur[r] >= 0 && cur[r] < I.off[r + 1] - I.off[r], "plan_search.anneal: init choice ", cur[r],
                " out of range for role ", r);
  std::vector<double> t(I.R), end(I.R);
  double cur_c = evaluate(I, cur, t, end);
  std::vector<int64_t> best = cur;
  double best_c = cur_c;
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double t0 = 0.05 * std::min(cur_c, 1e6);
  for (int64_t it = 0; it < iters; ++it) {
    const double temp = t0 * std::pow(1e-4, double(it) / double(std::max<int64_t>(1, iters - 1)));
    const int64_t r = static_cast<int64_t>(rng() % static_cast<uint64_t>(I.R));
    const int64_t n = I.off[r + 1] - I.off[r];
    const int64_t old = cur[r];
    if (unit(rng) < 0.5) {
      cur[r] = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    } else {
      const int64_t step = static_cast<int64_t>(rng() % 17) - 8;
      cur[r] = std::min(n - 1, std::max<int64_t>(0, old + step));
    }
    const double c = evaluate(I, cur, t, end);
    if (c <= cur_c || unit(rng) < std::exp(-(c - cur_c) / std::max(temp, 1e-12))) {
      cur_c = c;
      if (c < best_c) {
        best_c = c;
        best = cur;
      }
    } else {
      cur[r] = old;
    }
  }
  return {torch::tensor(best, torch::kInt64), best_c};
}

double evaluate_one(torch::Tensor offsets, torch::Tensor lo, torch::Tensor hi, torch::Tensor secs,
                    torch::Tensor state, torch::Tensor tp, torch::Tensor div, torch::Tensor kinds, torch::Tensor deps,
                    int64_t gen, int64_t train, int64_t mode, int64_t eta, torch::Tensor consts,
                    torch::Tensor choice) {
  auto res = anneal(offsets, lo, hi, secs, state, tp, div, kinds, deps, gen, train, mode, eta, consts, choice, 0, 0);
  return std::get<1>(res);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Simulated annealing over RL role placements (see realscale/planner/search.py).";
  m.def("anneal", &anneal, "best (choice, step seconds) found from init");
  m.def("evaluate", &evaluate_one, "step seconds of one joint choice");
}
