// Interval gather / scatter over flat buffers, CPU.
//
// Python twin: realscale/parallel/intervals.py (gather_fallback / scatter_fallback).
// The resharder moves many [start, start + length) element intervals of a GPU's flat
// parameter buffer into one contiguous send buffer (gather) and out of a received buffer
// into the destination flat buffer (scatter). A row-parallel weight sliced by rows gives
// one interval per outer row (thousands), so a per-interval Python loop is slow; here
// each interval is one memcpy, intervals split across threads by their output offset.
//
// Works on raw bytes, so any dtype is fine; starts/lengths are in elements (int64).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

void check_args(const torch::Tensor& flat, const torch::Tensor& starts, const torch::Tensor& lengths,
                const torch::Tensor& packed) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "interval_copy: flat buffer must be 1-D contiguous");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous(), "interval_copy: packed buffer must be 1-D contiguous");
  TORCH_CHECK(flat.scalar_type() == packed.scalar_type(), "interval_copy: flat and packed buffers differ in dtype (",
              flat.scalar_type(), " vs ", packed.scalar_type(), ")");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64,
              "interval_copy: starts and lengths must be int64");
  TORCH_CHECK(starts.dim() == 1 && lengths.dim() == 1 && starts.numel() == lengths.numel(),
              "interval_copy: starts and lengths must be 1-D of equal length");
  TORCH_CHECK(flat.device().is_cpu() && packed.device().is_cpu(), "interval_copy: CPU tensors only (see the CUDA kernel)");
}

// Output offsets of each interval in the packed buffer, with bounds checks.
std::vector<int64_t> packed_offsets(const int64_t* s, const int64_t* n, int64_t count, int64_t flat_numel,
                                    int64_t packed_numel) {
  std::vector<int64_t> off(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(n[i] >= 0 && s[i] >= 0 && s[i] + n[i] <= flat_numel, "interval_copy: interval ", i, " [", s[i], ", ",
                s[i] + n[i], ") is outside the flat buffer of ", flat_numel, " elements");
    off[i + 1] = off[i] + n[i];
  }
  TORCH_CHECK(off[count] <= packed_numel, "interval_copy: intervals hold ", off[count],
              " elements but the packed buffer has ", packed_numel);
  return off;
}

template <bool kGather>
void copy_intervals(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor packed) {
  check_args(flat, starts, lengths, packed);
  auto s_c = starts.contiguous();
  auto n_c = lengths.contiguous();
  const int64_t* s = s_c.data_ptr<int64_t>();
  const int64_t* n = n_c.data_ptr<int64_t>();
  const int64_t count = s_c.numel();
  const auto off = packed_offsets(s, n, count, flat.numel(), packed.numel());
  const int64_t es = flat.element_size();
  char* fb = static_cast<char*>(flat.data_ptr());
  char* pb = static_cast<char*>(packed.data_ptr());
  // Small copies are not worth a thread; grain keeps each task around >= 256 KiB.
  const int64_t avg = count ? std::max<int64_t>(1, off[count] * es / count) : 1;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / avg);
  at::parallel_for(0, count, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (kGather) {
        std::memcpy(pb + off[i] * es, fb + s[i] * es, n[i] * es);
      } else {
        std::memcpy(fb + s[i] * es, pb + off[i] * es, n[i] * es);
      }
    }
  });
}

void gather(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor out) {
  copy_intervals<true>(flat, starts, lengths, out);
}

void scatter(torch::Tensor flat, torch::Tensor starts, torch::Tensor lengths, torch::Tensor packed) {
  copy_intervals<false>(flat, starts, lengths, packed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Copy many [start, start+length) intervals of a flat buffer into / out of a packed buffer.";
  m.def("gather", &gather, "out[packed] <- flat[intervals]", py::arg("flat"), py::arg("starts"), py::arg("lengths"),
        py::arg("out"));
  m.def("scatter", &scatter, "flat[intervals] <- packed", py::arg("flat"), py::arg("starts"), py::arg("lengths"),
        py::arg("packed"));
}
