"""Export all-MiniLM-L6-v2 (a local Hugging Face folder with safetensors weights) to ONNX.

    python scripts/export_minilm.py MODEL_DIR OUT.onnx [--opset 17]

Needs ``torch==2.13.0`` (CPU) and ``transformers==4.57.6``; runs offline (HF_HUB_OFFLINE=1).
Inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64 [batch, sequence], both axes
dynamic); output ``last_hidden_state`` (float32 [batch, sequence, 384], the token embeddings that
sentence-transformers mean-pools). Uses the TorchScript exporter (``dynamo=False``) with eager
attention, so the graph is plain MatMul/Softmax/LayerNormalization/Gelu-as-Erf ops.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def export(model_dir: Path, out: Path, opset: int = 17) -> Path:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager")
    model.eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0]], dtype=torch.int64)
    mask = (ids != 0).to(torch.int64)
    types = torch.zeros_like(ids)
    axes = {0: "batch", 1: "sequence"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Wrapper(model), (ids, mask, types), str(tmp),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                          "last_hidden_state": axes},
            opset_version=opset, do_constant_folding=True, dynamo=False,
        )
    # One self-contained file (the model is 90 MB, under protobuf's 2 GB limit).
    import onnx

    m = onnx.load(str(tmp))
    onnx.save(m, str(out))
    tmp.unlink()
    for extra in out.parent.glob(tmp.name + "*"):
        extra.unlink()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--opset", type=int, default=17)
    a = ap.parse_args(argv)
    export(a.model_dir, a.out, a.opset)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
