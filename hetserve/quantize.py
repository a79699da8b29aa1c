"""`hetserve quantize`: write a model's linear layers in an MX weight format once, as a directory
`--model` reads back (gpu_model/weight_format.py: the packed file and its metadata)."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from server.config import WEIGHT_FORMATS, WEIGHT_ROTATIONS


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write a packed copy of a model in an MX weight format",
                       description="Convert the linear layers (and the LM head, unless --weight-format-head dense) "
                                   "to an OCP MX format and write a model directory that `--model DIR` loads: "
                                   "config and tokenizer files, the other tensors dense, the linears packed.")
    p.add_argument("--weight-format", required=True,
                   help=f"mxfp8, mxfp6, mxfp6_e3m2, mxfp4 or mxint8 (of {', '.join(WEIGHT_FORMATS)}, the MX ones)")
    p.add_argument("--out", required=True, help="output directory (created; files of the same names are replaced)")
    p.add_argument("--model", help="GGUF file or safetensors directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache-dir", default="~/.cache/hetserve/models",
                   help="where dequantized GGUF weights are cached")
    p.add_argument("--weight-rotation", default="none",
                   help=f"{' or '.join(WEIGHT_ROTATIONS)}: a block Hadamard rotation of the input dimension "
                        "folded into the weights (for mxfp4; default: none)")
    p.add_argument("--weight-format-head", default="same",
                   help="same (the LM head takes the format too) or dense (default: same)")
    p.set_defaults(run=quantize_command)


def quantize_command(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from gpu_model.config import ModelConfig
    from gpu_model.loader import read_dense, resolve_model_dir
    from gpu_model.weight_format import (HEAD, MX_FILE, WeightFormat, WeightFormatError, convert, linear_names,
                                         save_packed)

    try:
        wf = WeightFormat(args.weight_format, args.weight_rotation, args.weight_format_head)
    except WeightFormatError as exc:
        raise SystemExit(f"hetserve quantize: {exc}")
    if not wf.is_mx:
        raise SystemExit(f"hetserve quantize: --weight-format must be an MX format (mxfp8, mxfp6, mxfp6_e3m2, mxfp4, "
                         f"mxint8), not {wf.name}")
    model_dir = resolve_model_dir(args.model, Path(args.model_cache_dir).expanduser())
    if (model_dir / MX_FILE).exists():
        raise SystemExit(f"hetserve quantize: {model_dir} is already packed; quantize its source model")
    out = Path(args.out)
    if out.resolve() == model_dir.resolve():
        raise SystemExit("hetserve quantize: --out must differ from the model directory")
    cfg = ModelConfig.from_dir(model_dir)
    sd = read_dense(model_dir)
    names = linear_names(cfg.num_layers, with_head=wf.head == "same")
    dense = {**sd, HEAD: sd["model.embed_tokens.weight"]} if cfg.tie_word_embeddings else sd
    weights = convert(dense, names, wf)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    save_file({k: v.contiguous() for k, v in sd.items() if k not in weights}, out / "model.safetensors")
    save_packed(weights, out / MX_FILE, wf)
    packed = sum(w.nbytes for w in weights.values())
    count = sum(w.shape[0] * w.shape[1] for w in weights.values())
    print(f"wrote {out}: {len(weights)} {wf.variant} tensors, {packed / 2**20:.1f} MiB "
          f"({8 * packed / count:.2f} bits per weight), from {model_dir}")
