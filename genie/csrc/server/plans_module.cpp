// genie._C_plans: the server's native plan runner (genie.server.plans), its one bindings file. The parts:
// native_plan.h (a plan), runner.h/.cpp (the loop that runs a batch by them), runner_binding.h/.cpp (all it
// reads of the Python core, genie.server.runner_api), command_key.h (keys, shared with genie._C_keys),
// graph_program.h/.cpp (an admitted graph replay's nodes, genie.server.graphs).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "server/graph_program.h"
#include "server/native_plan.h"
#include "server/runner.h"
#include "server/runner_binding.h"

namespace py = pybind11;

PYBIND11_MODULE(_C_plans, m) {
  m.doc() = "The server's native plan runner (genie.server.plans).";
  py::class_<genie_plans::NativePlan, std::shared_ptr<genie_plans::NativePlan>>(m, "NativePlan")
      .def(py::init<py::handle>(), py::arg("spec"));
  py::class_<genie_plans::Runner>(m, "Runner")
      .def(py::init<size_t, Py_ssize_t>(), py::arg("max_keyed"), py::arg("max_freed"))
      .def("add", &genie_plans::Runner::add)
      .def("clear", &genie_plans::Runner::clear)
      .def("__len__", &genie_plans::Runner::size)
      .def("set_clock", &genie_plans::Runner::set_clock)
      .def("bind", &genie_plans::Runner::bind, py::arg("binding"))
      .def("run", &genie_plans::Runner::run)
      .def("take_grown", &genie_plans::Runner::take_grown)
      .def("set_wire", &genie_plans::Runner::set_wire)
      .def("serve", &genie_plans::Runner::serve)
      .def("served", &genie_plans::Runner::served)
      .def("take_reply", &genie_plans::Runner::take_reply);
  py::class_<genie_plans::GraphProgram>(m, "GraphProgram")
      .def(py::init<py::list, size_t, py::handle, py::object, bool>(), py::arg("nodes"), py::arg("inputs"),
           py::arg("ref_type"), py::arg("python_node"), py::arg("cpu"))
      .def("run", &genie_plans::GraphProgram::run, py::arg("env"), py::arg("held"), py::arg("wanted"))
      .def("python_nodes", &genie_plans::GraphProgram::python_nodes)
      .def("failed_node", &genie_plans::GraphProgram::failed_node)
      .def("failed_arguments", &genie_plans::GraphProgram::failed_arguments);
  m.def("use_serial", &genie_plans::set_threads, py::arg("serial"),
        "One intra-op thread on this thread (True) or its own count (False); a change only calls torch.");
  m.def("tensor_over", &genie_plans::tensor_over, py::arg("storage"), py::arg("dtype"), py::arg("offset"),
        py::arg("sizes"), py::arg("strides"), "A tensor over a storage (bounds already checked): Descriptor.over.");
  m.attr("SERIAL_BELOW") = genie_plans::kSerialBelow;
  genie_plans::export_field_names(m);
  m.attr("GRAPH_NODE_FIELDS") = genie_plans::graph_node_fields();
}
