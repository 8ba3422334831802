"""Causal language model over a layer pattern of token mixers, Hugging Face compatible."""
from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..hf import AUTO_MAP, write_remote_code
from ..layers import Attention, RMSNorm, ShortConvolution, SwiGLU
from ..layers.recurrent import RecurrentMixer
from ..ops.conv import seq_position
from ..ops.loss import linear_cross_entropy
from .cache import GDNCache
from .config import GDNConfig
from .graph_generate import DecoderSlot, graph_sample, model_key, unsupported, wants_graph
from .registry import mixer
from .static_cache import GraphDecoder


def build_mixer(config: GDNConfig, layer_idx: int) -> nn.Module:
    """The token mixer of layer ``layer_idx``: its ``layer_pattern`` letter's
    :class:`gdn.models.registry.MixerSpec` builds it from the config."""
    return mixer(config.layer_pattern[layer_idx]).build(config, layer_idx)


class GDNBlock(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``. x: [B, T, D] -> [B, T, D]."""

    def __init__(self, config: GDNConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = build_mixer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, attention_mask=None, cu_seqlens=None, state=None, use_cache=False, positions=None,
                context_parallel=None):
        """x: [B, T, D] -> (x [B, T, D], the mixer's new state or None)."""
        x, delta, new_state = self.stream(x, None, attention_mask, cu_seqlens, state, use_cache, positions,
                                          context_parallel)
        return x + delta, new_state

    def stream(self, x, delta=None, attention_mask=None, cu_seqlens=None, state=None, use_cache=False,
               positions=None, context_parallel=None):
        """This block on the residual stream ``x + delta`` (``delta`` the previous block's MLP output,
        not yet added; None for none) -> ``(x, delta, the mixer's new state or None)``: the stream
        after the mixer and this block's MLP output, whose sum is the block's output. Each residual
        add runs with the norm that reads its sum (:meth:`gdn.layers.RMSNorm.forward` with
        ``residual``: one kernel each way on the GPU), so a stack of blocks passes the pair from one
        to the next and the model's last norm adds the last ``delta``."""
        kw = dict(attention_mask=attention_mask, cu_seqlens=cu_seqlens, state=state, use_cache=use_cache)
        if isinstance(self.mixer, Attention):
            kw["positions"] = positions
        if context_parallel is not None:
            kw["context_parallel"] = context_parallel
        if delta is None:
            y = self.mixer_norm(x)
        else:
            x, y = self.mixer_norm(x, residual=delta)
        h, new_state = self.mixer(y, **kw)
        x, y = self.mlp_norm(x, residual=h)
        return x, self.mlp(y), new_state

    def decode_weights(self) -> tuple:
        """The fused projection weights of the decode step: ``(mixer's, MLP's)``
        (:class:`gdn.layers.fused.FusedLinear` each), for :meth:`decode_into`."""
        return self.mixer.decode_weights(), self.mlp.decode_weights()

    def decode_into(self, x, state, slot, positions, weights, delta=None):
        """One decode step of this block updating the preallocated ``state`` in place (see the
        mixers' ``decode_into``; ``slot`` and ``positions`` are for attention; ``weights``:
        :meth:`decode_weights`). x: [B, 1, D], the residual stream before this block, still without
        ``delta`` (the previous block's MLP output, None for none): each residual add runs with the
        norm that reads its sum and the projection that reads the norm
        (:meth:`gdn.layers.RMSNorm.linear_forward`, one kernel for up to four rows on CUDA); the
        mixer and the MLP continue from that projection (``decode_from``). Returns ``(x, delta)``:
        the stream after the mixer and this block's MLP output, which the next norm adds (the
        block's output is their sum)."""
        mixer_w, mlp_w = weights
        x, y = self.mixer_norm.linear_forward(x, delta, self.mixer.decode_input(mixer_w).weight)
        if isinstance(self.mixer, Attention):
            h = self.mixer.decode_from(y, state, slot, positions, mixer_w)
        else:
            h = self.mixer.decode_from(y, state, mixer_w)
        x, y = self.mlp_norm.linear_forward(x, h, mlp_w.weight)
        return x, self.mlp.decode_from(y, mlp_w)

    def mixer_state(self, x, attention_mask=None, state=None, positions=None):
        """The mixer's state after this block's input ``x`` [B, T, D] continuing from ``state`` (no MLP):
        what :meth:`GDNCache.crop` recomputes inside a recorded call."""
        kw = dict(attention_mask=attention_mask, state=state, use_cache=True)
        if isinstance(self.mixer, Attention):
            kw["positions"] = positions
        return self.mixer(self.mixer_norm(x), **kw)[1]


#: Name under which the installed ``transformers`` keeps the cache in model outputs and generate's
#: kwargs (``past_key_values`` up to 5.2x, ``cache`` after the rename).
CACHE_KEY = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


def output_cache(output) -> GDNCache | None:
    """The cache of a model output, whichever name the installed ``transformers`` gives it."""
    return output.get(CACHE_KEY)


class GDNPreTrainedModel(PreTrainedModel):
    """Weight initialisation and Hugging Face plumbing shared by :class:`GDNModel` and :class:`GDNForCausalLM`.

    Linear and embedding weights ~ N(0, ``initializer_range``), biases 0, norms 1, short convolutions
    uniform ±1/sqrt(K), ``A_log``/``dt_bias`` as in :class:`gdn.layers.GatedDeltaNet`.
    """

    config_class = GDNConfig
    config: GDNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GDNBlock"]
    _supports_cache_class = True
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias"]

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Does nothing. A saved gdn folder reaches gdn's classes through its own ``modeling_gdn.py``
        (:mod:`gdn.hf`), which imports the installed package; transformers' copying of a remote class's
        source file into every folder saved afterwards does not apply to a package."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``; the folder is transformers-native: ``config.json`` carries
        the ``auto_map`` and ``modeling_gdn.py`` lies beside it (:mod:`gdn.hf`). The model's own config
        is left as it was."""
        had = getattr(self.config, "auto_map", None)
        self.config.auto_map = dict(AUTO_MAP)
        try:
            out = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.auto_map = had
            if had is None:
                del self.config.auto_map
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory)
        return out

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """``generate`` must not build a ``DynamicCache``: the model brings its own :class:`GDNCache`."""
        return False

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            init.copy_(module.weight, module.init_value())
        if isinstance(module, RecurrentMixer):
            for name, value in module.gate_init_values().items():
                init.copy_(getattr(module, name), value)


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters excluded from weight decay (A_log, dt_bias, norm weights, biases),
    also flagging each with ``param._no_weight_decay = True``."""
    names = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if (getattr(p, "_no_weight_decay", False) or pname in ("A_log", "dt_bias", "bias")
                    or isinstance(module, RMSNorm)):
                p._no_weight_decay = True
                names.add(f"{mname}.{pname}" if mname else pname)
    return names


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: ``[{"params": decayed, "weight_decay": weight_decay},
    {"params": A_log/dt_bias/norms/biases, "weight_decay": 0.0}]`` (trainable parameters only;
    tied weights once)."""
    wd = weight_decay
    if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not 0 <= wd < float("inf"):  # (NaN fails too)
        raise ValueError(f"weight_decay must be a finite non-negative number, got {weight_decay!r}")
    skip = no_weight_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]


def _check_ids(name, x):
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a [B, T] torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got {list(x.shape)}")


class GDNModel(GDNPreTrainedModel):
    """Embedding, ``num_hidden_layers`` :class:`GDNBlock` s, final RMSNorm.

    Forward args:
        input_ids: [B, T] (or ``inputs_embeds`` [B, T, D]).
        attention_mask: [B, T] or [B, past + T] (1 token, 0 padding; pad on the left for generation).
        position_ids: [B, T] RoPE positions (default: count of real tokens before each, continuing the cache).
        past_key_values / cache: a :class:`GDNCache` to continue from (either name).
        use_cache: return the updated cache (default ``config.use_cache`` in eval mode without
            ``cu_seqlens``, False in training).
        cu_seqlens: [N+1] offsets of sequences packed along T (B == 1; no cache).
        context_parallel: a :class:`gdn.distributed.ContextParallel`: the inputs are this rank's
            slice of sequences split along T across its group (the packed offsets, if any, are the
            context's; no attention_mask, cu_seqlens or cache). Every rank of the group calls the
            forward (and the backward) together; see docs/CONTEXT_PARALLEL.md.
        output_hidden_states, return_dict.
    Returns ``transformers``' ``BaseModelOutputWithPast`` (the cache under :data:`CACHE_KEY`).
    """

    def __init__(self, config: GDNConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GDNBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                inputs_embeds=None, use_cache=None, cu_seqlens=None, output_hidden_states=None, return_dict=None,
                context_parallel=None, **kwargs):
        """See the class docstring."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids [B, T] and inputs_embeds [B, T, D]")
        _check_ids("input_ids", input_ids)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if past_key_values is not None and cache is not None and past_key_values is not cache:
            raise ValueError("pass the cache as past_key_values or as cache, not two different ones")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, GDNCache):
            raise TypeError(f"the cache must be a GDNCache, got {type(cache).__name__}")
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        cp = context_parallel
        if cp is not None:
            if cu_seqlens is not None or attention_mask is not None or cache is not None or use_cache:
                raise ValueError("with context_parallel the layout comes from it: no cu_seqlens, attention_mask, "
                                 "cache or use_cache")
            if T != cp.length:
                raise ValueError(f"this rank holds tokens [{cp.start}, {cp.end}) ({cp.length}) of the sequence, but "
                                 f"the input has T = {T}")
            use_cache = False
            if position_ids is None:
                position_ids = cp.positions(x.device)[None].expand(B, T)
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training and cu_seqlens is None)
        use_cache = bool(use_cache)
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens needs batch size 1 (sequences packed along T), got B = {B}")
            if attention_mask is not None:
                raise ValueError("give either cu_seqlens (packing) or attention_mask (padding), not both")
            if use_cache or cache is not None:
                raise ValueError("cu_seqlens is for training and scoring; call with use_cache=False and no cache "
                                 "(use attention_mask with left padding for cached generation)")
        if use_cache and cache is None:
            cache = GDNCache.for_config(self.config, B, device=x.device)
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"the cache holds {cache.batch_size} sequences but the input has B = {B}")
        past = cache.seen if cache is not None else 0

        mask = None
        if attention_mask is not None:
            _check_ids("attention_mask", attention_mask)
            if attention_mask.shape[0] != B or attention_mask.shape[1] not in (T, past + T):
                raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}] or [B, past + T] = "
                                 f"[{B}, {past + T}], got {list(attention_mask.shape)}")
            mask = attention_mask[:, -T:].bool()
            if bool(mask.all()):
                mask = None
        if position_ids is None and (mask is not None or cache is not None):
            start = cache.positions[:, None] if cache is not None else 0
            if mask is not None:
                position_ids = (start + mask.long().cumsum(1) - 1).clamp(min=0)
            else:
                position_ids = start + torch.arange(T, device=x.device)[None]
        if position_ids is None and cu_seqlens is not None:
            position_ids = seq_position(cu_seqlens, T)[0][None]

        hidden = [] if output_hidden_states else None
        if use_cache and cache.recording:
            x, delta = self._recorded_blocks(x, mask, position_ids, cache, hidden), None
        else:
            x, delta = self._blocks(x, mask, cu_seqlens, cache, use_cache, position_ids, checkpointing, hidden,
                                    context_parallel=cp)
            if use_cache:
                cache.advance(T, mask.sum(1) if mask is not None else torch.full((B,), T, device=x.device))
        x = self.norm(x) if delta is None else self.norm(x, residual=delta)[1]
        if hidden is not None:
            hidden.append(x)
        out = BaseModelOutputWithPast(x, cache if use_cache else None, tuple(hidden) if hidden is not None else None)
        return out if return_dict is not False else out.to_tuple()

    def _blocks(self, x, mask, cu_seqlens, cache, use_cache, position_ids, checkpointing, hidden, inputs=None,
                context_parallel=None):
        """Run every block over x [B, T, D], updating ``cache``'s layer states; appends each block's input
        to ``hidden`` and ``inputs`` when they are lists. Returns ``(x, delta)``, the stream after the
        last block as :meth:`GDNBlock.stream` leaves it (its sum is the last block's output; the
        final norm adds it)."""
        cp = context_parallel
        delta = None
        for i, block in enumerate(self.layers):
            if (hidden is not None or inputs is not None) and delta is not None:
                x, delta = x + delta, None  # a block input that is kept is the sum itself
            if hidden is not None:
                hidden.append(x)
            if inputs is not None:
                inputs.append(x)
            state = cache.layers[i] if cache is not None else None
            args = (x, delta, mask, cu_seqlens, state, use_cache, position_ids, cp)
            if checkpointing:
                x, delta, new_state = checkpoint(block.stream, *args, use_reentrant=False)
            else:
                x, delta, new_state = block.stream(*args)
            if use_cache:
                cache.layers[i] = new_state
        return x, delta

    def _recorded_blocks(self, x, mask, position_ids, cache, hidden):
        """The blocks on a recording cache (:meth:`GDNCache.activate_past_recording`): the last
        ``cache.rollback_window`` slots run as their own segment whose block inputs the cache keeps,
        so that :meth:`GDNCache.crop` can recompute a state inside it; a longer head runs before, unrecorded."""
        B, T = x.shape[:2]
        keep = min(T, cache.rollback_window)
        parts, hiddens = [], []
        for lo, hi in ((0, T - keep), (T - keep, T)):
            if hi == lo:
                continue
            seg_mask = None if mask is None else mask[:, lo:hi]
            seg_pos = None if position_ids is None else position_ids[:, lo:hi]
            seg_hidden = [] if hidden is not None else None
            recorded = hi == T
            inputs = [] if recorded else None
            if recorded:
                cache.begin_call()
            start = cache.seen
            part, delta = self._blocks(x[:, lo:hi], seg_mask, None, cache, True, seg_pos, False, seg_hidden, inputs)
            parts.append(part if delta is None else part + delta)
            cache.advance(hi - lo, seg_mask.sum(1) if seg_mask is not None else torch.full((B,), hi - lo,
                                                                                          device=x.device))
            if recorded:
                cache.end_call(start, hi - lo, seg_mask,
                               functools.partial(_replay_layer, weakref.ref(self), inputs, seg_mask, seg_pos))
            hiddens.append(seg_hidden)
        if hidden is not None:
            hidden.extend(torch.cat(hs, 1) for hs in zip(*hiddens))
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _replay_layer(model_ref, inputs, mask, positions, layer: int, state, n: int):
    """Layer ``layer``'s state after the first ``n`` slots of a recorded call, from ``state`` (the
    state at the call's start): the block's mixer on the recorded block inputs."""
    model = model_ref()
    if model is None:
        raise RuntimeError("the model that filled this cache was deleted; the cache cannot be cropped")
    return model.layers[layer].mixer_state(inputs[layer][:, :n], None if mask is None else mask[:, :n], state,
                                           None if positions is None else positions[:, :n])


class GDNForCausalLM(GDNPreTrainedModel, GenerationMixin):
    """:class:`GDNModel` plus a language-model head (optionally tied to the embedding).

    Forward args: those of :class:`GDNModel`, plus ``labels`` [B, T] (next-token targets are
    ``labels`` shifted left inside; ``-100`` is ignored; with ``cu_seqlens`` the last token of a
    sequence is never trained to predict the first of the next) and ``logits_to_keep`` (int n: the
    last n positions, 0 = all; or a 1-D tensor of positions). With ``context_parallel``, ``labels``
    are the whole sequence's [B, total] (so the last token of a slice is trained on the first of the
    next) and ``loss`` is this rank's share: its tokens' summed loss over the whole batch's count
    of targets, so the sum over the group is the mean loss. Returns ``transformers``'
    ``CausalLMOutputWithPast`` (cache under :data:`CACHE_KEY`; logits in fp32 when a loss is computed).
    In training mode with gradients on, a loss comes from :func:`gdn.ops.loss.linear_cross_entropy`
    (head and cross entropy over chunks of tokens, no [B·T, vocab] logits kept) and ``logits`` is None;
    in eval mode or under ``torch.no_grad()`` the full logits come back beside it.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: GDNConfig):
        super().__init__(config)
        self.model = GDNModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self._graph_slot = DecoderSlot()

    @property
    def graph_decoder(self) -> GraphDecoder | None:
        """The :class:`GraphDecoder` that ``generate`` with ``cache_implementation="static"`` decodes on
        (None until the first such call). Set one of your own (e.g. other batch buckets) to have it
        used, or None to free its buffers and graphs."""
        return self._graph_slot.decoder

    @graph_decoder.setter
    def graph_decoder(self, decoder: GraphDecoder | None) -> None:
        if decoder is not None and (not isinstance(decoder, GraphDecoder) or decoder.model is not self):
            raise ValueError("graph_decoder must be None or a GraphDecoder built for this model")
        self._graph_slot = DecoderSlot()
        if decoder is not None:
            self._graph_slot.decoder, self._graph_slot.key = decoder, model_key(self)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, cu_seqlens=None, logits_to_keep=0,
                output_hidden_states=None, return_dict=None, context_parallel=None, **kwargs):
        """See the class docstring."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, cu_seqlens=cu_seqlens, output_hidden_states=output_hidden_states,
                         return_dict=True, context_parallel=context_parallel)
        h = out.last_hidden_state
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("logits_to_keep must be 0 (all positions) when labels are given")
        if isinstance(logits_to_keep, int):
            if logits_to_keep < 0:
                raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
            if logits_to_keep:
                h = h[:, -logits_to_keep:]
        else:
            h = h[:, logits_to_keep]
        loss = logits = None
        if labels is not None and context_parallel is not None:
            loss, logits = self._context_parallel_loss(h, labels, context_parallel)
        elif labels is not None:
            if labels.shape != h.shape[:2]:
                raise ValueError(f"labels must have shape [B, T] = {list(h.shape[:2])}, got {list(labels.shape)}")
            target = F.pad(labels[:, 1:], (0, 1), value=-100)
            if cu_seqlens is not None:
                ends = cu_seqlens.long()[1:-1] - 1  # last token of every sequence but the final one
                target = target.clone()
                target[:, ends] = -100  # (an empty first sequence gives -1: the last column, already -100)
            target = target.reshape(-1).to(h.device)
            if self.training and torch.is_grad_enabled():
                loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, target)
            else:
                logits = self.lm_head(h).float()
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=-100)
        else:
            logits = self.lm_head(h)
        res = CausalLMOutputWithPast(loss, logits, output_cache(out), out.hidden_states)
        return res if return_dict is not False else res.to_tuple()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """``generate``'s cache set-up. The :class:`GDNCache` is normally created on the first step
        (:meth:`prepare_inputs_for_generation`); assisted and prompt-lookup decoding need it before
        that, recording, since they roll back rejected candidate tokens with ``crop``. The same holds
        when this model is the assistant (its drafts are cut back to what the main model accepted)."""
        mode = kwargs.get("generation_mode", args[0] if args else None)
        batch = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
        static = wants_graph(generation_config)
        if static:  # served by this model's graph decoder, not by a transformers cache
            generation_config.cache_implementation = None
        try:
            out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        finally:
            if static:
                generation_config.cache_implementation = "static"
        if static and mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, None):
            warnings.warn(f"cache_implementation='static' (gdn's graph decoder) serves greedy search and sampling; "
                          f"{getattr(mode, 'value', mode)} decodes on the eager GDNCache", stacklevel=3)
        speculative = getattr(generation_config, "is_assistant", False) or mode == GenerationMode.ASSISTED_GENERATION
        if (speculative and isinstance(batch, int) and generation_config.use_cache is not False
                and model_kwargs.get(CACHE_KEY) is None):
            cache = GDNCache.for_config(self.config, batch, device=self.device)
            cache.activate_past_recording()
            model_kwargs[CACHE_KEY] = cache
        return out

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        """``generate``'s greedy search and sampling loop. With ``cache_implementation="static"`` it runs
        on the graph decoder (:mod:`gdn.models.graph_generate`): same tokens, each step one replayed
        CUDA graph. An option that loop cannot honour gets one warning naming it, and the call runs
        transformers' own loop on the eager :class:`GDNCache`."""
        if wants_graph(generation_config) and not getattr(generation_config, "is_assistant", False):
            reason = unsupported(generation_config, synced_gpus, model_kwargs)
            if reason is None:
                return graph_sample(self, self._graph_slot, input_ids, logits_processor, stopping_criteria,
                                    generation_config, streamer, **model_kwargs)
            warnings.warn(f"cache_implementation='static': {reason} is not supported by gdn's graph decoder; this "
                          f"call decodes on the eager GDNCache", stacklevel=3)
        return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    def _context_parallel_loss(self, h, labels, cp):
        """(this rank's share of the mean loss, logits or None) from its hidden states h [B, T_r, D] and
        the whole sequence's labels [B, total]."""
        if labels.shape != (h.shape[0], cp.total):
            raise ValueError(f"with context_parallel, labels must be the whole sequence's [B, total] = "
                             f"{[h.shape[0], cp.total]}, got {list(labels.shape)}")
        target = F.pad(labels[:, 1:], (0, 1), value=-100)
        if cp.cu_seqlens is not None and len(cp.cu_seqlens) > 2:
            target = target.clone()
            target[:, [c - 1 for c in cp.cu_seqlens[1:-1] if c > 0]] = -100
        count = (target != -100).sum().clamp(min=1)  # the whole batch's targets
        target = cp.shard(target).reshape(-1).to(h.device)
        mine = (target != -100).sum()
        flat = h.reshape(-1, h.shape[-1])
        if self.training and torch.is_grad_enabled():
            if int(mine) == 0:  # no target here: a zero that still reaches the head (DDP wants every gradient)
                return (flat.sum() + self.lm_head.weight.sum()) * 0.0, None
            return linear_cross_entropy(flat, self.lm_head.weight, target) * (mine / count.to(h.device)), None
        logits = self.lm_head(h).float()
        nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=-100, reduction="sum")
        return nats / count.to(h.device), logits

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None,
                                      use_cache=True, cache=None, logits_to_keep=None, **kwargs):
        """One step of ``generate``: feed only the tokens the cache has not consumed, creating the
        :class:`GDNCache` on the first step. RoPE positions come from the cache, not from ``position_ids``."""
        cache = cache if cache is not None else past_key_values
        if not isinstance(cache, GDNCache):
            cache = None
        if cache is None and use_cache:
            cache = GDNCache.for_config(self.config, input_ids.shape[0], device=input_ids.device)
        seen = cache.seen if cache is not None else 0
        inputs = {}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
            if cache is not None:
                cache.embeds_prefix = inputs_embeds.shape[1]
        else:
            if cache is not None and seen:
                # input_ids holds the tokens after the embedded prefix: the whole sequence, or only
                # the generated tokens when the prompt came as inputs_embeds. Feed what is new.
                consumed = seen - cache.embeds_prefix
                if attention_mask is not None and 0 < attention_mask.shape[1] - seen <= input_ids.shape[1]:
                    input_ids = input_ids[:, seen - attention_mask.shape[1]:]
                elif input_ids.shape[1] > consumed:
                    input_ids = input_ids[:, consumed:]
            inputs["input_ids"] = input_ids.contiguous()
        inputs.update(attention_mask=attention_mask, past_key_values=cache, use_cache=use_cache)
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        for key in ("output_hidden_states", "return_dict"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs
