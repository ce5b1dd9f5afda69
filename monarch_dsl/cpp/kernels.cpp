// The CPU kernels of the gradient-bucket ops monarch_dsl::flatten_scale and
// monarch_dsl::unflatten_into (defined, with their fake kernels and the CUDA path, in
// runtime/kernels.py). Registered for the CPU dispatch key when this module loads (every worker
// loads it at start), so a worker's runtime calls them without Python: through the Python
// kernel (torch.library.custom_op's) each call cost a CPU worker 60-170 us and the GIL, for a
// bucket of 64 KiB. The passes are runtime/kernels.py's torch path, step for step (copy each
// tensor into its slice, then scale), so the results are the same bits.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace {

void check_bucket(const at::TensorList tensors, const char* what) {
  const auto& first = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK_VALUE(
        t.scalar_type() == first.scalar_type() && t.device() == first.device(), what,
        ": a bucket is one dtype on one device; tensors[0] is ", first.scalar_type(), " on ",
        first.device(), ", tensors[", i, "] is ", t.scalar_type(), " on ", t.device());
  }
}

int64_t total_numel(const at::TensorList tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

at::Tensor flatten_scale(at::TensorList tensors, double scale) {
  TORCH_CHECK_VALUE(!tensors.empty(), "flatten_scale: no tensors");
  check_bucket(tensors, "flatten_scale");
  auto out = at::empty({total_numel(tensors)}, tensors[0].options());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0) out.narrow(0, offset, n).view(t.sizes()).copy_(t);
    offset += n;
  }
  if (scale != 1.0 && offset > 0) {
    // As Python's out.mul_(scale): a wrapped number, multiplied in the buffer's computation
    // type (float for half/bfloat16); a C++ double would be rounded to the dtype first.
    auto factor = at::scalar_tensor(scale, at::kDouble);
    factor.unsafeGetTensorImpl()->set_wrapped_number(true);
    out.mul_(factor);
  }
  return out;
}

void unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const int64_t total = total_numel(tensors);
  TORCH_CHECK_VALUE(
      flat.dim() == 1 && flat.is_contiguous(),
      "flat must be a contiguous 1-D tensor, got shape ", flat.sizes());
  TORCH_CHECK_VALUE(
      flat.numel() == total, "flat has ", flat.numel(), " elements, expected ", total);
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(
        tensors[i].device() == flat.device(), "unflatten_into: flat is on ", flat.device(),
        ", tensors[", i, "] on ", tensors[i].device());
  }
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    if (n > 0) {
      // (a const TensorList: copy_ into a handle of the same tensor, as _foreach_copy_ does)
      at::Tensor into = t;
      into.copy_(flat.narrow(0, offset, n).view(t.sizes()));
      if (scale != 1.0) into.mul_(scale);
    }
    offset += n;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(monarch_dsl, CPU, m) {
  m.impl("flatten_scale", flatten_scale);
  m.impl("unflatten_into", unflatten_into);
}
