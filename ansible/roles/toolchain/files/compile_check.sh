#!/bin/sh
# Build a one-function CPython extension with gcc against Python.h and import it; this is the
# path Triton takes when it JIT-compiles its launcher stubs. Leaves nothing behind.
set -eu
python=${1:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/launchcheck.c" <<'C'
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "launchcheck", NULL, -1, methods};
PyMODINIT_FUNC PyInit_launchcheck(void) { return PyModule_Create(&module); }
C
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -shared -fPIC -O0 -I"$include" "$work/launchcheck.c" -o "$work/launchcheck$suffix"
cd "$work"
"$python" -c 'import launchcheck; assert launchcheck.answer() == 42; print("toolchain ok: gcc + Python.h")'
