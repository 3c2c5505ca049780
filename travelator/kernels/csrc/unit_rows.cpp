// A build unit: the row-wise kernels in one compiler run, so that torch's headers (most of a
// small source's compile time) are parsed once for all of them (travelator/kernels/__init__.py).
#include "norm.cpp"
#include "activation.cpp"
#include "rope.cpp"
#include "kv_write.cpp"
#include "sampling.cpp"
