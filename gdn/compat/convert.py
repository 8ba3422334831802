"""Qwen3.5 / Qwen3-Next checkpoints to gdn models and back (``gdn convert hf-qwen3.5 SRC DST``).

A dense Qwen3.5 text model (or Qwen3-Next with dense MLPs) is a stack of pre-norm blocks whose
mixers are Gated DeltaNet layers and gated full-attention layers, which is a gdn model with the
layer pattern ``G…A…``. The conversion maps, per tensor:

========================================  =================================================
Qwen (transformers)                        gdn
========================================  =================================================
``linear_attn.in_proj_qkv`` (Qwen3.5)      ``mixer.q_proj`` / ``k_proj`` / ``v_proj`` (split rows)
``linear_attn.in_proj_qkvz`` / ``_ba``     the same plus ``g_proj`` / ``b_proj`` / ``a_proj``
(Qwen3-Next, grouped per key head)         (de-interleaved per key head)
``linear_attn.conv1d`` over [q; k; v]      ``q_conv`` / ``k_conv`` / ``v_conv`` (depthwise: split channels)
``in_proj_z`` / ``in_proj_b`` / ``_a``     ``g_proj`` / ``b_proj`` / ``a_proj``
``A_log``, ``dt_bias``, ``norm``, ``out_proj``  ``A_log``, ``dt_bias``, ``o_norm``, ``o_proj``
``self_attn.q_proj`` ([q | gate] per head)  ``mixer.q_proj`` + ``mixer.g_proj`` (attention output gate)
``self_attn.q_norm`` / ``k_norm``           ``mixer.q_norm`` / ``k_norm`` (weight 1 + w)
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``  ``mixer_norm``, ``mlp_norm``, ``model.norm`` (1 + w)
``mlp.*``, ``embed_tokens``, ``lm_head``    the same names
========================================  =================================================

Qwen's RMSNorms are zero-centred (they scale by ``1 + w``); gdn's scale by ``w``, so those
weights are offset by one, in fp32 (kept in fp32 in the converted checkpoint, since
``1 + w`` in bf16 would round). The attention layers are :class:`gdn.layers.Attention` with
the gdn config options ``attention_output_gate``, ``attention_qk_norm`` and ``partial_rotary_factor``
(q/k norm, partial rotary, sigmoid output gate), so a converted folder loads with
``GDNForCausalLM.from_pretrained`` (or ``AutoModelForCausalLM`` after ``import gdn``).
Mixture-of-experts layers, attention biases and non-default RoPE scaling are refused.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `gdn --help` loads no torch
    import torch


logger = logging.getLogger(__name__)

#: Families on the command line -> (transformers model types accepted, config class name, causal LM class name).
FAMILIES = {
    "hf-qwen3.5": (("qwen3_5_text", "qwen3_5"), "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "hf-qwen3-next": (("qwen3_next",), "Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
#: Files copied along with the weights (tokenizer, generation settings).
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "generation_config.json", "chat_template.jinja", "chat_template.json")
_LETTER = {"linear_attention": "G", "full_attention": "A"}


# ----------------------------------------------------------------------------------------- files

def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a saved model folder (``model.safetensors`` or a sharded index) or one ``.safetensors`` file."""
    from safetensors.torch import load_file
    path = Path(path)
    if path.is_file():
        return load_file(str(path))
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(str(path / shard)))
        return out
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(f"SRC {path} holds no model.safetensors (or sharded index); save the model with "
                         "save_pretrained(..., safe_serialization=True)")
    return load_file(str(single))


def _read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.exists():
        raise ValueError(f"SRC {path} has no config.json")
    return json.loads(f.read_text())


# ------------------------------------------------------------------------------ configurations

def _text_config(hf_cfg):
    return hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg


def hf_config_to_gdn(hf_cfg, family: str):
    """A :class:`gdn.models.GDNConfig` equivalent to a Qwen3.5 / Qwen3-Next (dense) config.

    Raises ``ValueError`` for what gdn cannot represent (MoE, biases, RoPE scaling, other activations)."""
    from ..models import GDNConfig

    c = _text_config(hf_cfg)
    if c.model_type not in FAMILIES[family][0]:
        raise ValueError(f"SRC is a {c.model_type!r} model, not {family} (model types {FAMILIES[family][0]})")
    if getattr(c, "num_experts", 0):
        raise ValueError(f"SRC has mixture-of-experts layers (num_experts={c.num_experts}); only dense MLPs convert")
    if c.hidden_act != "silu":
        raise ValueError(f"SRC uses hidden_act={c.hidden_act!r}; gdn's MLP and convolutions use silu")
    if getattr(c, "attention_bias", False):
        raise ValueError("SRC has attention biases (attention_bias=True); gdn's attention has none")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"SRC uses RoPE type {rope.get('rope_type')!r}; only the default RoPE converts")
    bad = sorted({t for t in c.layer_types if t not in _LETTER})
    if bad:
        raise ValueError(f"SRC has layer types {bad}; gdn converts {sorted(_LETTER)}")
    return GDNConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        layer_pattern="".join(_LETTER[t] for t in c.layer_types), num_heads=c.linear_num_key_heads,
        head_dim=c.linear_key_head_dim, num_v_heads=c.linear_num_value_heads,
        expand_v=c.linear_value_head_dim / c.linear_key_head_dim, use_short_conv=True,
        conv_size=c.linear_conv_kernel_dim, use_gate=True, allow_neg_eigval=False,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        attention_head_dim=c.head_dim, window_size=None, rope_theta=float(rope.get("rope_theta", 10000.0)),
        intermediate_size=c.intermediate_size, norm_eps=c.rms_norm_eps, initializer_range=c.initializer_range,
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False) or c.tie_word_embeddings),
        max_position_embeddings=c.max_position_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, attention_output_gate=True,
        attention_qk_norm=True, partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        architectures=["GDNForCausalLM"],
    )


def _token_ids(cfg) -> dict:
    """bos/eos/pad ids of a config; a gdn config saved without them (``save_pretrained`` of a model
    built from a preset, checkpoints written before gdn recorded them) has None."""
    return {name: getattr(cfg, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def gdn_config_to_hf(cfg, family: str):
    """The transformers config of ``family`` equivalent to a :class:`gdn.models.GDNConfig`.

    Raises ``ValueError`` when the gdn model has something the Qwen layers cannot express."""
    import transformers

    pat = cfg.layer_pattern
    if set(pat) - {"G", "A"}:
        raise ValueError(f"layer_pattern {pat!r}: {family} has only Gated DeltaNet (G) and full attention (A) layers")
    if not (cfg.use_short_conv and cfg.use_gate) or cfg.allow_neg_eigval:
        raise ValueError(f"{family}'s Gated DeltaNet needs use_short_conv=True, use_gate=True, allow_neg_eigval=False")
    if "A" in pat and not (cfg.attention_output_gate and cfg.attention_qk_norm):
        raise ValueError(f"{family}'s attention has q/k norms and an output gate: the gdn config needs "
                         "attention_output_gate=True and attention_qk_norm=True")
    V = int(round(cfg.head_dim * cfg.expand_v))
    cls = getattr(transformers, FAMILIES[family][1])
    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.resolved_attention_head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        linear_conv_kernel_dim=cfg.conv_size, linear_key_head_dim=cfg.head_dim, linear_value_head_dim=V,
        linear_num_key_heads=cfg.num_heads, linear_num_value_heads=cfg.num_v_heads,
        layer_types=["linear_attention" if c == "G" else "full_attention" for c in pat],
        **_token_ids(cfg), architectures=[FAMILIES[family][2]],
    )
    if family == "hf-qwen3-next":
        kw["num_experts"] = 0
    return cls(**kw)


# -------------------------------------------------------------------------------- state dicts

def _offset(w: torch.Tensor, sign: float) -> torch.Tensor:
    """Zero-centred norm weight <-> plain weight: ``w + sign`` in fp32."""
    return w.float() + sign


def _hf_prefix(sd: dict) -> str:
    return "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."


def _linear_in(sd, P, c, family, take):
    """Gated DeltaNet projections of one Qwen layer -> gdn names (without the block prefix)."""
    H, HV, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    m = HV // H
    out = {}
    if family == "hf-qwen3-next":
        qkvz = take(P + "in_proj_qkvz.weight")
        D = qkvz.shape[-1]
        q, k, v, z = qkvz.view(H, 2 * K + 2 * m * V, D).split([K, K, m * V, m * V], dim=1)
        ba = take(P + "in_proj_ba.weight").view(H, 2 * m, D)
        b, a = ba.split([m, m], dim=1)
        out.update({"q_proj.weight": q.reshape(H * K, D), "k_proj.weight": k.reshape(H * K, D),
                    "v_proj.weight": v.reshape(HV * V, D), "g_proj.weight": z.reshape(HV * V, D),
                    "b_proj.weight": b.reshape(HV, D), "a_proj.weight": a.reshape(HV, D)})
    else:
        q, k, v = take(P + "in_proj_qkv.weight").split([H * K, H * K, HV * V], dim=0)
        out.update({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
                    "g_proj.weight": take(P + "in_proj_z.weight"), "b_proj.weight": take(P + "in_proj_b.weight"),
                    "a_proj.weight": take(P + "in_proj_a.weight")})
    conv = take(P + "conv1d.weight").squeeze(1)
    qc, kc, vc = conv.split([H * K, H * K, HV * V], dim=0)
    out.update({"q_conv.weight": qc, "k_conv.weight": kc, "v_conv.weight": vc, "A_log": take(P + "A_log"),
                "dt_bias": take(P + "dt_bias"), "o_norm.weight": take(P + "norm.weight"),
                "o_proj.weight": take(P + "out_proj.weight")})
    return out


def hf_to_gdn_state(sd: dict, hf_cfg, family: str) -> dict[str, torch.Tensor]:
    """Map a Qwen3.5 / Qwen3-Next state dict to gdn's names (see the module docstring).

    Raises ``ValueError`` naming any tensor it would otherwise drop or miss."""
    c = _text_config(hf_cfg)
    pre = _hf_prefix(sd)
    pool = dict(sd)

    def take(name):
        if name not in pool:
            raise ValueError(f"SRC lacks tensor {name!r} (is it a {family} checkpoint?)")
        return pool.pop(name)

    out = {"model.embed_tokens.weight": take(pre + "embed_tokens.weight"),
           "model.norm.weight": _offset(take(pre + "norm.weight"), 1.0)}
    if "lm_head.weight" in pool:
        out["lm_head.weight"] = pool.pop("lm_head.weight")
    hd, HQ = c.head_dim, c.num_attention_heads
    for i, kind in enumerate(c.layer_types):
        P, G = f"{pre}layers.{i}.", f"model.layers.{i}."
        out[G + "mixer_norm.weight"] = _offset(take(P + "input_layernorm.weight"), 1.0)
        out[G + "mlp_norm.weight"] = _offset(take(P + "post_attention_layernorm.weight"), 1.0)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{G}mlp.{proj}.weight"] = take(f"{P}mlp.{proj}.weight")
        if kind == "linear_attention":
            for name, t in _linear_in(sd, P + "linear_attn.", c, family, take).items():
                out[G + "mixer." + name] = t
        else:
            A = P + "self_attn."
            qg = take(A + "q_proj.weight")
            qg = qg.view(HQ, 2, hd, qg.shape[-1])
            out[G + "mixer.q_proj.weight"] = qg[:, 0].reshape(HQ * hd, -1)
            out[G + "mixer.g_proj.weight"] = qg[:, 1].reshape(HQ * hd, -1)
            for name in ("k_proj", "v_proj", "o_proj"):
                out[f"{G}mixer.{name}.weight"] = take(f"{A}{name}.weight")
            out[G + "mixer.q_norm.weight"] = _offset(take(A + "q_norm.weight"), 1.0)
            out[G + "mixer.k_norm.weight"] = _offset(take(A + "k_norm.weight"), 1.0)
    skipped = sorted(k for k in pool if k.startswith(("mtp.", "model.visual.", "visual.")))
    if skipped:
        logger.info("not converted (multi-token prediction / vision tensors): %d tensors, e.g. %s", len(skipped),
                    skipped[0])
    rest = sorted(k for k in pool if k not in skipped)
    if rest:
        raise ValueError(f"SRC has tensors gdn cannot place: {rest[:8]}{' …' if len(rest) > 8 else ''}")
    return {k: v.contiguous() for k, v in out.items()}


def gdn_to_hf_state(sd: dict, cfg, family: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Map a gdn state dict (of a model :func:`gdn_config_to_hf` accepts) to Qwen3.5 / Qwen3-Next names.

    ``dtype``: the dtype of the zero-centred norm weights (default: that of the embedding)."""
    import torch
    pool = dict(sd)
    dtype = dtype or pool["model.embed_tokens.weight"].dtype

    def take(name):
        if name not in pool:
            raise ValueError(f"SRC lacks tensor {name!r} (is it a gdn checkpoint of this config?)")
        return pool.pop(name)

    def norm(name):
        return _offset(take(name), -1.0).to(dtype)

    out = {"model.embed_tokens.weight": take("model.embed_tokens.weight"), "model.norm.weight": norm("model.norm.weight")}
    if "lm_head.weight" in pool:
        lm = pool.pop("lm_head.weight")
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = lm
    H, HV, K = cfg.num_heads, cfg.num_v_heads, cfg.head_dim
    V, m = int(round(K * cfg.expand_v)), HV // H
    hd, HQ = cfg.resolved_attention_head_dim, cfg.num_attention_heads
    for i, letter in enumerate(cfg.layer_pattern):
        G, P = f"model.layers.{i}.", f"model.layers.{i}."
        out[P + "input_layernorm.weight"] = norm(G + "mixer_norm.weight")
        out[P + "post_attention_layernorm.weight"] = norm(G + "mlp_norm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{P}mlp.{proj}.weight"] = take(f"{G}mlp.{proj}.weight")
        M, L = G + "mixer.", P + "linear_attn."
        if letter == "G":
            q, k, v = take(M + "q_proj.weight"), take(M + "k_proj.weight"), take(M + "v_proj.weight")
            z, b, a = take(M + "g_proj.weight"), take(M + "b_proj.weight"), take(M + "a_proj.weight")
            D = q.shape[-1]
            if family == "hf-qwen3-next":
                out[L + "in_proj_qkvz.weight"] = torch.cat(
                    [q.view(H, K, D), k.view(H, K, D), v.view(H, m * V, D), z.view(H, m * V, D)], 1).reshape(-1, D)
                out[L + "in_proj_ba.weight"] = torch.cat([b.view(H, m, D), a.view(H, m, D)], 1).reshape(-1, D)
            else:
                out[L + "in_proj_qkv.weight"] = torch.cat([q, k, v], 0)
                out[L + "in_proj_z.weight"], out[L + "in_proj_b.weight"], out[L + "in_proj_a.weight"] = z, b, a
            conv = [take(M + f"{x}_conv.weight") for x in "qkv"]
            out[L + "conv1d.weight"] = torch.cat(conv, 0).unsqueeze(1)
            out[L + "A_log"], out[L + "dt_bias"] = take(M + "A_log"), take(M + "dt_bias")
            out[L + "norm.weight"], out[L + "out_proj.weight"] = take(M + "o_norm.weight"), take(M + "o_proj.weight")
        else:
            A = P + "self_attn."
            q, g = take(M + "q_proj.weight"), take(M + "g_proj.weight")
            D = q.shape[-1]
            out[A + "q_proj.weight"] = torch.stack([q.view(HQ, hd, D), g.view(HQ, hd, D)], 1).reshape(-1, D)
            for name in ("k_proj", "v_proj", "o_proj"):
                out[f"{A}{name}.weight"] = take(f"{M}{name}.weight")
            out[A + "q_norm.weight"] = norm(M + "q_norm.weight")
            out[A + "k_norm.weight"] = norm(M + "k_norm.weight")
    if pool:
        raise ValueError(f"SRC has tensors {family} cannot place: {sorted(pool)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- whole folders

def load_gdn(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """``GDNForCausalLM.from_pretrained(path)`` on ``device``, in eval mode: a model of a folder written
    by :func:`convert` (or ``save_pretrained``). ``dtype``: that of the weights (default: as saved)."""
    from ..models import GDNForCausalLM

    return GDNForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def _cast(sd: dict, dtype: torch.dtype | None, keep_fp32: set[str] = frozenset()) -> dict:
    if dtype is None:
        return sd
    return {k: v if k in keep_fp32 or not v.is_floating_point() else v.to(dtype) for k, v in sd.items()}


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d:
        raise ValueError("DST must differ from SRC")
    if s.is_relative_to(d):
        raise ValueError(f"SRC {src} is inside DST {dst}: replacing DST would delete SRC; choose another DST")
    if Path.cwd().resolve().is_relative_to(d):
        raise ValueError(f"DST {dst} holds the current folder; choose another DST")
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())) and not force:
        raise ValueError(f"DST {dst} already exists and is not an empty folder; pass --force (force=True) to "
                         "replace it")


def convert(family: str, src: str | Path, dst: str | Path, dtype: torch.dtype | None = None,
            force: bool = False) -> str:
    """Convert the saved model in ``src`` into ``dst``, in the direction ``src`` tells.

    ``src`` a transformers checkpoint of ``family`` -> a gdn checkpoint (``GDNForCausalLM.from_pretrained``,
    and after :func:`gdn.hf.save_for_transformers`'s files ``trust_remote_code`` loading too);
    ``src`` a gdn checkpoint (one ``gdn train`` wrote, or ``save_pretrained``) -> a transformers
    checkpoint of ``family`` (``AutoModelForCausalLM``). ``dtype``: cast weights (default: keep).

    ``dst`` must not exist or be an empty folder, unless ``force``: then it is replaced (its old
    contents deleted). The folder is assembled beside ``dst`` and renamed into place, so a failed
    conversion leaves ``dst`` as it was. Returns ``"to-gdn"`` or ``"to-hf"``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    _check_destination(Path(src), Path(dst), force)
    src, dst = Path(src), Path(dst).resolve()
    raw = _read_config(src)
    sd = load_state_dict(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        direction, n = _convert_into(family, src, raw, sd, tmp, dtype)
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s (%s, %d tensors) -> %s", src, direction, n, dst)
    return direction


def _convert_into(family: str, src: Path, raw: dict, sd: dict, dst: Path, dtype) -> tuple[str, int]:
    """Write the converted folder into the (new, empty) ``dst``; (direction, number of tensors)."""
    from safetensors.torch import save_file
    if raw.get("model_type") == "gdn":
        from ..models import GDNConfig

        cfg = GDNConfig.from_pretrained(str(src))
        hf_cfg = gdn_config_to_hf(cfg, family)
        out = _cast(gdn_to_hf_state(sd, cfg, family, dtype), dtype)
        hf_cfg.save_pretrained(str(dst))
        direction = "to-hf"
    else:
        import transformers

        hf_cfg = transformers.AutoConfig.from_pretrained(str(src))
        cfg = hf_config_to_gdn(hf_cfg, family)
        out = hf_to_gdn_state(sd, hf_cfg, family)
        norms = {k for k in out if k.endswith("norm.weight") and not k.endswith("o_norm.weight")}
        out = _cast(out, dtype, keep_fp32=norms)
        from ..hf import save_for_transformers

        save_for_transformers(dst, cfg)  # config.json with auto_map, modeling_gdn.py
        direction = "to-gdn"
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in AUX_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return direction, len(out)


# ------------------------------------------------------------------------------------------ CLI

#: --dtype choices: None keeps the weights' dtypes, else the name of a torch dtype.
_DTYPES = {"keep": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add ``convert`` to an ``argparse`` subparsers object (``gdn convert FAMILY SRC DST``)."""
    p = subparsers.add_parser("convert", help="convert Qwen3.5 / Qwen3-Next checkpoints to gdn and back",
                              description="Convert a saved transformers model of FAMILY into a gdn model, or a gdn "
                                          "model into FAMILY's transformers layout (the direction follows SRC).")
    p.add_argument("family", choices=sorted(FAMILIES), help="the transformers architecture on the other side")
    p.add_argument("src", help="folder with config.json and model.safetensors (or a sharded index)")
    p.add_argument("dst", help="output folder (created)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="keep", help="cast the weights")
    p.add_argument("--force", action="store_true",
                   help="replace DST when it exists (its old contents are deleted); without it an existing, "
                        "non-empty DST is an error")
    p.set_defaults(func=run_from_args)
    return p


def run_from_args(args) -> int:
    """Run a parsed ``convert`` command (``args.family``, ``args.src``, ``args.dst``, ``args.dtype``,
    ``args.force``); returns 0."""
    import torch

    dtype = None if _DTYPES[args.dtype] is None else getattr(torch, _DTYPES[args.dtype])
    direction = convert(args.family, args.src, args.dst, dtype, force=getattr(args, "force", False))
    print(f"{args.src} -> {args.dst} ({direction})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gdn.compat.convert FAMILY SRC DST [--dtype …] [--force]``: the same as ``gdn convert``."""
    parser = argparse.ArgumentParser(prog="gdn")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subparser(sub)
    args = parser.parse_args(["convert", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
