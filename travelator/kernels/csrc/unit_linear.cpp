// A build unit: the linear-layer kernels and the layer stack and experts that call them, in
// one compiler run (travelator/kernels/__init__.py).
#include "small_m_linear.cpp"
#include "blocked_linear.cpp"
#include "quant_linear.cpp"
#include "quant_dequantize.cpp"
#include "quant_w8a8.cpp"
#include "layer_stack.cpp"
#include "moe_experts.cpp"
#include "panel_linear.cpp"
