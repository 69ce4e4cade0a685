// Python bindings of the kvengine CPU extension; every call releases the GIL.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "paged attention over the block table, [tokens, heads * head_size]",
        py::arg("q"), py::arg("cache"), py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("window"), py::arg("scale"), py::arg("softcap") = 0.0, py::arg("kv_scales") = py::none(), nogil);
  m.def("reshape_and_cache", &reshape_and_cache, "write K/V at the slots the block table gives", py::arg("k"),
        py::arg("v"), py::arg("cache"), py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("kv_scales") = py::none(), nogil);
  m.def("rms_norm", &rms_norm, "weight * x / rms(x) over the last dim", py::arg("x"), py::arg("weight"),
        py::arg("eps"), nogil);
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then rms_norm(x)", py::arg("x"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"), nogil);
  m.def("rotary", &rotary, "rotate-half RoPE of q and k in place", py::arg("q"), py::arg("k"), py::arg("positions"),
        py::arg("cos"), py::arg("sin"), nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :n]) * x[..., n:]", py::arg("x"), nogil);
  m.def("int8_group_linear", &int8_group_linear, "x @ (q * group scales).T, int8 weights read once",
        py::arg("x"), py::arg("q"), py::arg("scale"), nogil);
  m.def("int4_group_linear", &int4_group_linear, "fp32 x @ torch's packed int4 weight.T, [m, n_pad]", py::arg("x"),
        py::arg("packed"), py::arg("scale_min"), py::arg("order"), nogil);
  m.def("int4_dequantize_t", &int4_dequantize_t, "torch's packed int4 weight as its dense transpose [k, n_pad]",
        py::arg("packed"), py::arg("scale_zero"), py::arg("order"), nogil);
  m.def("int8_dequantize", &int8_dequantize, "int8 codes times group scales, [n, k] in dtype", py::arg("q"),
        py::arg("scale"), py::arg("dtype"), nogil);
  m.def("half_pack", &half_pack, "a weight [n, k] as bf16 or fp16 panels for half_linear", py::arg("weight"),
        py::arg("dtype"), nogil);
  m.def("half_linear", &half_linear, "fp32 x @ a bf16 or fp16 packed weight.T, [..., n]", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), nogil);
}
