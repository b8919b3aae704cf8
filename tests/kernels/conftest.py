"""Kernel tests run the Triton kernels on CPU tensors, in Triton's interpreter. Interpreter mode must
be on before triton is first imported (this file is loaded before the test modules here import it);
dspark.kernels also turns it on by itself on a machine without CUDA. Set here too, so the tests run
in the interpreter on a GPU machine as well."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
