// GAE (generalised advantage estimation) on packed sequences, CPU.
//
// Python twin: realscale/algo/gae.py (gae_torch, a vectorised scan; gae_reference, a loop).
// Inputs are 1-D tensors of all tokens of many sequences concatenated; cu_seqlens
// (int64, B+1) gives the offsets. For each sequence, backwards over its tokens:
//     delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
// where "next" is the next token of the same sequence whose mask is set (masked-out
// tokens, e.g. prompt or tool-output tokens, are skipped: they get A = R = 0), and after
// the last token V_next = bootstrap[s] (0 for a finished sequence), A_next = 0.
//
// Why it is fast: one pass, no padding, sequences split across threads with
// at::parallel_for. The recurrence is latency-bound (one FMA chain per sequence), so
// accumulating in double for float inputs costs nothing measurable and removes the
// drift of long float32 sums.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

template <typename scalar_t, bool kHasMask>
void gae_sequences(const scalar_t* __restrict__ r, const scalar_t* __restrict__ v,
                   const bool* __restrict__ m, const int64_t* __restrict__ cu,
                   const scalar_t* __restrict__ boot, double gamma, double gl,
                   scalar_t* __restrict__ adv, scalar_t* __restrict__ ret, int64_t s_begin,
                   int64_t s_end) {
  for (int64_t s = s_begin; s < s_end; ++s) {
    double next_v = boot ? static_cast<double>(boot[s]) : 0.0;
    double a = 0.0;
    for (int64_t t = cu[s + 1] - 1; t >= cu[s]; --t) {
      if (kHasMask && !m[t]) {
        adv[t] = 0;
        ret[t] = 0;
        continue;
      }
      const double vt = static_cast<double>(v[t]);
      a = (static_cast<double>(r[t]) + gamma * next_v - vt) + gl * a;
      next_v = vt;
      adv[t] = static_cast<scalar_t>(a);
      ret[t] = static_cast<scalar_t>(a + vt);
    }
  }
}

void check_inputs(const at::Tensor& rewards, const at::Tensor& values,
                  const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& mask,
                  const std::optional<at::Tensor>& bootstrap) {
  TORCH_CHECK(rewards.device().is_cpu(), "gae: rewards must be on the CPU, got ", rewards.device());
  TORCH_CHECK(rewards.dim() == 1, "gae: rewards must be 1-D (packed tokens), got shape ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes(), "gae: values shape ", values.sizes(),
              " != rewards shape ", rewards.sizes());
  TORCH_CHECK(values.scalar_type() == rewards.scalar_type(), "gae: values dtype ", values.scalar_type(),
              " != rewards dtype ", rewards.scalar_type());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1 && cu_seqlens.scalar_type() == at::kLong,
              "gae: cu_seqlens must be a 1-D int64 tensor of B+1 offsets");
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "gae: mask must be bool, got ", mask->scalar_type());
    TORCH_CHECK(mask->sizes() == rewards.sizes(), "gae: mask shape ", mask->sizes(), " != rewards shape ",
                rewards.sizes());
  }
  if (bootstrap) {
    TORCH_CHECK(bootstrap->dim() == 1 && bootstrap->numel() == cu_seqlens.numel() - 1,
                "gae: bootstrap must hold one value per sequence (", cu_seqlens.numel() - 1, "), got shape ",
                bootstrap->sizes());
    TORCH_CHECK(bootstrap->scalar_type() == rewards.scalar_type(), "gae: bootstrap dtype ",
                bootstrap->scalar_type(), " != rewards dtype ", rewards.scalar_type());
  }
  // Offsets: start at 0, end at N, never decrease. B+1 reads, cheap next to the scan.
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t b = cu_seqlens.numel() - 1;
  TORCH_CHECK(cu[0] == 0, "gae: cu_seqlens[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[b] == rewards.numel(), "gae: cu_seqlens[-1] (", cu[b], ") != number of tokens (",
              rewards.numel(), ")");
  for (int64_t s = 0; s < b; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "gae: cu_seqlens must be non-decreasing, but cu_seqlens[", s + 1,
                "] = ", cu[s + 1], " < cu_seqlens[", s, "] = ", cu[s]);
  }
}

// Returns (advantages, returns), both shaped and typed like rewards.
std::vector<at::Tensor> gae(const at::Tensor& rewards_in, const at::Tensor& values_in,
                            const at::Tensor& cu_in, double gamma, double lam,
                            const std::optional<at::Tensor>& mask_in,
                            const std::optional<at::Tensor>& bootstrap_in) {
  const at::Tensor rewards = rewards_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor cu_seqlens = cu_in.contiguous();
  std::optional<at::Tensor> mask, bootstrap;
  if (mask_in) mask = mask_in->contiguous();
  if (bootstrap_in) bootstrap = bootstrap_in->contiguous();
  check_inputs(rewards, values, cu_seqlens, mask, bootstrap);

  at::Tensor adv = at::empty_like(rewards);
  at::Tensor ret = at::empty_like(rewards);
  const int64_t b = cu_seqlens.numel() - 1;
  const int64_t n = rewards.numel();
  if (b == 0) return {adv, ret};
  // Split over threads by tokens, not by sequences: lengths are long-tailed, so equal
  // sequence counts would leave one thread with most of the work. Chunk k takes the
  // sequences that start in tokens [k*n/c, (k+1)*n/c). Small inputs stay on one thread.
  const int64_t chunks = n < (1 << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), b);
  const double gl = gamma * lam;
  const int64_t* cu_ptr = cu_seqlens.data_ptr<int64_t>();
  auto first_seq_at = [&](int64_t k) -> int64_t {  // first sequence starting at token >= k*n/c
    const int64_t tok = (n / chunks) * k + std::min<int64_t>(k, n % chunks);
    return std::lower_bound(cu_ptr, cu_ptr + b, tok) - cu_ptr;
  };

  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae", [&] {
    const scalar_t* r = rewards.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
    const bool* m = mask ? mask->data_ptr<bool>() : nullptr;
    const scalar_t* boot = bootstrap ? bootstrap->data_ptr<scalar_t>() : nullptr;
    scalar_t* a = adv.data_ptr<scalar_t>();
    scalar_t* rt = ret.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
      const int64_t s0 = first_seq_at(k0);
      const int64_t s1 = k1 == chunks ? b : first_seq_at(k1);
      if (m) {
        gae_sequences<scalar_t, true>(r, v, m, cu, boot, gamma, gl, a, rt, s0, s1);
      } else {
        gae_sequences<scalar_t, false>(r, v, m, cu, boot, gamma, gl, a, rt, s0, s1);
      }
    });
  });
  return {adv, ret};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "GAE on packed sequences (CPU); see realscale/algo/gae.py";
  m.def("gae", &gae, "(rewards, values, cu_seqlens, gamma, lam, mask, bootstrap) -> [advantages, returns]",
        pybind11::arg("rewards"), pybind11::arg("values"), pybind11::arg("cu_seqlens"), pybind11::arg("gamma"),
        pybind11::arg("lam"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("bootstrap") = pybind11::none());
}
