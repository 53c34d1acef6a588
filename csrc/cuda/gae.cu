// GAE on packed sequences, CUDA. Same contract as csrc/gae.cpp (read that first).
//
// NOT RUN in the development environment (no GPU there): it is exercised by the `gpu`
// tests in tests/algo/test_gae.py, which compare it with the CPU kernel and the Python
// reference on a CUDA machine.
//
// Layout: one thread per sequence walks its tokens backwards. That keeps the kernel
// obviously equal to the CPU one; GAE is a tiny part of a step on a GPU (a few ms for
// millions of tokens), so a warp-level segmented scan was not worth its risk untested.

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

namespace {

template <typename scalar_t, bool kHasMask>
__global__ void gae_kernel(const scalar_t* __restrict__ r, const scalar_t* __restrict__ v,
                           const bool* __restrict__ m, const int64_t* __restrict__ cu,
                           const scalar_t* __restrict__ boot, double gamma, double gl,
                           scalar_t* __restrict__ adv, scalar_t* __restrict__ ret, int64_t b) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= b) return;
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

std::vector<at::Tensor> gae(const at::Tensor& rewards_in, const at::Tensor& values_in,
                            const at::Tensor& cu_in, double gamma, double lam,
                            const std::optional<at::Tensor>& mask_in,
                            const std::optional<at::Tensor>& bootstrap_in) {
  TORCH_CHECK(rewards_in.is_cuda(), "gae_cuda: rewards must be on a CUDA device, got ", rewards_in.device());
  TORCH_CHECK(rewards_in.dim() == 1, "gae_cuda: rewards must be 1-D (packed tokens), got shape ",
              rewards_in.sizes());
  TORCH_CHECK(values_in.sizes() == rewards_in.sizes() && values_in.scalar_type() == rewards_in.scalar_type(),
              "gae_cuda: values must match rewards in shape and dtype");
  TORCH_CHECK(cu_in.dim() == 1 && cu_in.numel() >= 1 && cu_in.scalar_type() == at::kLong,
              "gae_cuda: cu_seqlens must be a 1-D int64 tensor of B+1 offsets");
  const c10::cuda::CUDAGuard guard(rewards_in.device());
  const at::Tensor rewards = rewards_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor cu = cu_in.to(rewards.device()).contiguous();
  std::optional<at::Tensor> mask, bootstrap;
  if (mask_in) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool && mask_in->sizes() == rewards.sizes(),
                "gae_cuda: mask must be bool and shaped like rewards");
    mask = mask_in->to(rewards.device()).contiguous();
  }
  if (bootstrap_in) {
    TORCH_CHECK(bootstrap_in->dim() == 1 && bootstrap_in->numel() == cu.numel() - 1 &&
                    bootstrap_in->scalar_type() == rewards.scalar_type(),
                "gae_cuda: bootstrap must hold one value per sequence, typed like rewards");
    bootstrap = bootstrap_in->to(rewards.device()).contiguous();
  }
  at::Tensor adv = at::empty_like(rewards);
  at::Tensor ret = at::empty_like(rewards);
  const int64_t b = cu.numel() - 1;
  if (b == 0) return {adv, ret};
  const int threads = 128;
  const int blocks = static_cast<int>((b + threads - 1) / threads);
  const double gl = gamma * lam;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae_cuda", [&] {
    const bool* m = mask ? mask->data_ptr<bool>() : nullptr;
    const scalar_t* boot = bootstrap ? bootstrap->data_ptr<scalar_t>() : nullptr;
    if (m) {
      gae_kernel<scalar_t, true><<<blocks, threads, 0, stream>>>(
          rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), m, cu.data_ptr<int64_t>(), boot, gamma,
          gl, adv.data_ptr<scalar_t>(), ret.data_ptr<scalar_t>(), b);
    } else {
      gae_kernel<scalar_t, false><<<blocks, threads, 0, stream>>>(
          rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), m, cu.data_ptr<int64_t>(), boot, gamma,
          gl, adv.data_ptr<scalar_t>(), ret.data_ptr<scalar_t>(), b);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {adv, ret};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "GAE on packed sequences (CUDA); see realscale/algo/gae.py";
  m.def("gae", &gae, "(rewards, values, cu_seqlens, gamma, lam, mask, bootstrap) -> [advantages, returns]",
        pybind11::arg("rewards"), pybind11::arg("values"), pybind11::arg("cu_seqlens"), pybind11::arg("gamma"),
        pybind11::arg("lam"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("bootstrap") = pybind11::none());
}
