// The stream threads' setup and error reports (see streams.h).

#include "streams.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <sys/resource.h>

#include <optional>
#include <system_error>

namespace md::exec {

void start_stream_thread(const c10::Device& device) {
  // OpenMP's and MKL's thread counts are per thread: a new thread starts at one per core,
  // whatever the worker set (runtime/worker.py _limit_threads). Without this a stream
  // thread's matmuls ran 2 OpenMP threads per worker on 2 cores, whose spin-waits took the
  // core from the other rank (the tiny DDP step: 9 ms instead of 0.8 ms).
  at::init_num_threads();
  if (device.is_cuda()) {
    // Each stream thread issues its work on a CUDA stream of its own (current for this
    // thread only), so streams overlap on the GPU as they do on the host.
    c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    cuda.setDevice(device);
    cuda.exchangeStream(cuda.getStreamFromGlobalPool(device));
  }
}

namespace {
thread_local bool kept_thread_state = false;  // (keep_python_thread_state)
}  // namespace

void keep_python_thread_state() {
  if (kept_thread_state) return;
  pybind11::gil_scoped_acquire again;  // the same thread state, one count more...
  again.inc_ref();                     // ...and one more, which its end does not take back
  kept_thread_state = true;
}

void end_stream_thread() {
  if (!kept_thread_state) return;
  kept_thread_state = false;
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (!Py_IsInitialized() || finalizing) return;  // (the interpreter frees thread states)
  pybind11::gil_scoped_acquire gil;
  gil.dec_ref();  // the kept count: the thread state is deleted when this acquire ends
}

std::optional<rlim_t> grow_data_limit(size_t room) {
  struct rlimit limit;
  if (getrlimit(RLIMIT_DATA, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_cur + room > limit.rlim_max)
    return std::nullopt;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur += room;
  if (setrlimit(RLIMIT_DATA, &limit) != 0) return std::nullopt;
  return before;
}

void set_data_limit(rlim_t soft) {
  struct rlimit limit;
  if (getrlimit(RLIMIT_DATA, &limit) != 0) return;
  limit.rlim_cur = soft;
  setrlimit(RLIMIT_DATA, &limit);
}

std::thread start_thread(std::function<void()> body) {
  try {
    return std::thread(body);
  } catch (const std::system_error&) {
    size_t stack = 0;
    pthread_attr_t attr;
    if (pthread_getattr_default_np(&attr) == 0) {
      pthread_attr_getstacksize(&attr, &stack);
      pthread_attr_destroy(&attr);
    }
    // The stack (glibc's default: RLIMIT_STACK, 8 MiB) and its guard page, with room to spare.
    if (!grow_data_limit((stack > 0 ? stack : size_t{8} << 20) + (size_t{1} << 20))) throw;
    return std::thread(body);
  }
}

void report_internal_error(const std::exception& e) {
  pybind11::gil_scoped_acquire gil;
  PySys_WriteStderr("monarch_dsl executor: internal error: %s\n", e.what());
}

}  // namespace md::exec
