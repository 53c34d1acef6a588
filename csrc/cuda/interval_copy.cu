// Interval gather / scatter over flat buffers, CUDA.  NOT RUN on the development machine
// (no GPU there): tests/parallel/test_intervals.py::test_cuda_kernel_matches_fallback is
// marked `gpu` and compares it with the Python fallback on a CUDA machine.
//
// Same contract as csrc/interval_copy.cpp. One thread block per interval (grid-stride over
// blocks when there are more intervals than blocks); threads copy 16-byte words when both
// ends are aligned, bytes otherwise. Output offsets come from an exclusive scan of the
// lengths computed with torch on the device (no host round trip).

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace {

template <bool kGather>
__global__ void copy_kernel(char* __restrict__ flat, char* __restrict__ packed, const int64_t* __restrict__ starts,
                            const int64_t* __restrict__ lengths, const int64_t* __restrict__ offsets,
                            int64_t count, int64_t es) {
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    char* f = flat + starts[i] * es;
    char* p = packed + offsets[i] * es;
    const int64_t nbytes = lengths[i] * es;
    char* dst = kGather ? p : f;
    const char* src = kGather ? f : p;
    const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
    if (aligned) {
      const int64_t words = nbytes / 16;
      auto* d4 = reinterpret_cast<int4*>(dst);
      const auto* s4 = reinterpret_cast<const int4*>(src);
      for (int64_t w = threadIdx.x; w < words; w += blockDim.x) d4[w] = s4[w];
      for (int64_t b = words * 16 + threadIdx.x; b < nbytes; b += blockDim.x) dst[b] = src[b];
    } else {
      for (int64_t b = threadIdx.x; b < nbytes; b += blockDim.x) dst[b] = src[b];
    }
  }
}

template <bool kGather>
void copy_intervals(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor packed) {
  TORCH_CHECK(flat.is_cuda() && packed.is_cuda() && starts.is_cuda() && lengths.is_cuda(),
              "interval_copy_cuda: all tensors must be on the GPU");
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous() && packed.dim() == 1 && packed.is_contiguous(),
              "interval_copy_cuda: flat and packed buffers must be 1-D contiguous");
  TORCH_CHECK(flat.scalar_type() == packed.scalar_type(), "interval_copy_cuda: flat and packed dtypes differ");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64,
              "interval_copy_cuda: starts and lengths must be int64");
  const int64_t count = starts.numel();
  if (count == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  auto offsets = torch::cumsum(lengths, 0) - lengths;  // exclusive scan, on the device
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(count, 65535);
  auto stream = at::cuda::getCurrentCUDAStream();
  copy_kernel<kGather><<<blocks, threads, 0, stream>>>(
      static_cast<char*>(flat.data_ptr()), static_cast<char*>(packed.data_ptr()), starts.data_ptr<int64_t>(),
      lengths.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), count, flat.element_size());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor out) {
  copy_intervals<true>(flat, starts.contiguous(), lengths.contiguous(), out);
}

void scatter(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor packed) {
  copy_intervals<false>(flat, starts.contiguous(), lengths.contiguous(), packed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather", &gather, "out[packed] <- flat[intervals] (CUDA)");
  m.def("scatter", &scatter, "flat[intervals] <- packed (CUDA)");
}
