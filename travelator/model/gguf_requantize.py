"""Write a copy of a GGUF file with its linear layers in F16, Q8_0, Q4_0 or Q4_1 (the gguf
package's own quantizers), everything else as it was: how the tests and the benchmarks make quantized files
of a model to compare against (llama.cpp's ``llama-quantize`` does the same, when it is built).

    python -m travelator.model.gguf_requantize model.gguf model-q4_0.gguf Q4_0

A linear tensor whose input size is not a multiple of 32 (the block) stays as it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
          "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a mixture's stacked experts too
KINDS = ("F16", "Q8_0", "Q4_0", "Q4_1")


def requantize_gguf(src: str | Path, dst: str | Path, kind: str) -> int:
    """Write ``dst``; the number of tensors quantized."""
    import gguf

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype,
                             sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    quantized = 0
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        parts = t.name.split(".")
        linear = parts[0] == "blk" and len(parts) > 3 and parts[2] in LINEAR and shape[-1] % 32 == 0
        float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                       gguf.GGMLQuantizationType.BF16)
        if not linear or t.tensor_type not in float_types:
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
            else:  # BF16 or already quantized: its bytes as they are
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        quantized += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("kind", choices=KINDS)
    a = ap.parse_args()
    n = requantize_gguf(a.src, a.dst, a.kind)
    print(f"wrote {a.dst}: {n} linear tensors in {a.kind}")


if __name__ == "__main__":
    main()
