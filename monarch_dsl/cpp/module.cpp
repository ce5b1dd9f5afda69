// monarch_dsl._core: the C++ runtime's Python module. Each part binds itself here.

#include <torch/extension.h>

namespace py = pybind11;

void bind_executor(py::module& m);
void bind_program(py::module& m);
void bind_shm(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "monarch_dsl's C++ runtime (see monarch_dsl/_core.pyi)";
  bind_executor(m);
  bind_program(m);
  bind_shm(m);
}
