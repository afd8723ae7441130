// genie._C_keys: the server's command signatures (a plain CPython extension; no torch, compiles in a second).
//
// command_key(data) returns (key, ids, floats), or None when the bytes cannot be keyed: see command_key.h, which
// genie._C_plans (the native plan runner) shares.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "server/command_key.h"

namespace {

PyObject* command_key(PyObject*, PyObject* arg) {
  if (!PyBytes_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "command_key takes bytes");
    return nullptr;
  }
  std::string key;
  std::vector<uint64_t> found;
  std::vector<double> values;
  if (!genie_keys::key_of(reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(arg)),
                          static_cast<size_t>(PyBytes_GET_SIZE(arg)), &key, &found, &values))
    Py_RETURN_NONE;
  size_t count = found.size();
  PyObject* ids = PyTuple_New(static_cast<Py_ssize_t>(count));
  if (ids == nullptr) return nullptr;
  for (size_t i = 0; i < count; ++i) {
    PyObject* id = PyLong_FromUnsignedLongLong(found[i]);
    if (id == nullptr) {
      Py_DECREF(ids);
      return nullptr;
    }
    PyTuple_SET_ITEM(ids, static_cast<Py_ssize_t>(i), id);
  }
  PyObject* floats = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (floats == nullptr) {
    Py_DECREF(ids);
    return nullptr;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* value = PyFloat_FromDouble(values[i]);
    if (value == nullptr) {
      Py_DECREF(ids);
      Py_DECREF(floats);
      return nullptr;
    }
    PyTuple_SET_ITEM(floats, static_cast<Py_ssize_t>(i), value);
  }
  PyObject* key_bytes = PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
  if (key_bytes == nullptr) {
    Py_DECREF(ids);
    Py_DECREF(floats);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(3, key_bytes, ids, floats);
  Py_DECREF(key_bytes);
  Py_DECREF(ids);
  Py_DECREF(floats);
  return out;
}
PyMethodDef methods[] = {
    {"command_key", command_key, METH_O,
     "command_key(data: bytes) -> (key: bytes, ids: tuple[int, ...], floats: tuple[float, ...]) | None: a "
     "command's signature with its storage ids and floats taken out, the ids and the floats; None when the "
     "bytes cannot be keyed."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "genie._C_keys",
                      "The server's command signatures (genie.server.plans).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C_keys() { return PyModule_Create(&module); }
