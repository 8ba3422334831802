"""``model.generate()`` on the static cache: transformers' greedy search and sampling, with the
model's decode forward replaced by the fixed-shape step of a :class:`GraphDecoder` (CUDA graphs on a
GPU, the same step eagerly elsewhere).

It is asked for with ``cache_implementation="static"``, set once on ``model.generation_config`` or
given per call. transformers still does everything around the token loop: it merges the generation
config, sets up the special tokens, infers the attention mask from padding, repeats rows for
``num_return_sequences``, fixes ``max_length`` and builds the logits processors and stopping
criteria. Only the loop itself (``GenerationMixin._sample``) runs here: the prompt goes through the
model's ordinary forward (the eager path's prefill and its :class:`GDNCache`), that cache is copied
into the decoder's static buffers, and each further token is one replayed step. The processors and
criteria are applied at every step as transformers' loop applies them, so the options they carry
(penalties, min lengths, eos lists, stop strings, ...) behave the same on both paths.

The decoder is kept on the model between calls (:attr:`GDNForCausalLM.graph_decoder`), so a batch
size's graph is captured once; it is replaced when the model's weights, dtype or device change, and
a batch size's buffers are rebuilt when a global attention layer needs more slots than they hold.
"""
from __future__ import annotations

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from .static_cache import GraphDecoder

#: The ``cache_implementation`` value that selects the graph decoder.
STATIC = "static"

#: Model keyword arguments of a plain ``generate`` call that the graph loop handles (the mask is
#: used by the prefill; position ids are recomputed from it, as on the eager path).
_PLAIN_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache", "past_key_values",
                 "output_attentions", "output_hidden_states", "return_dict"}


def wants_graph(generation_config) -> bool:
    """Whether this generation config asks for the static cache (and so for the graph decoder)."""
    return getattr(generation_config, "cache_implementation", None) == STATIC


def unsupported(generation_config, synced_gpus, model_kwargs: dict) -> str | None:
    """The first option of a ``_sample`` call that the graph loop cannot honour, named for the
    warning (None when it can run the call)."""
    if synced_gpus:
        return "synced_gpus=True"
    if generation_config.return_dict_in_generate:
        for name in ("output_attentions", "output_hidden_states"):
            if getattr(generation_config, name, False):
                return f"{name}=True"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size"
    for key, value in model_kwargs.items():
        if key not in _PLAIN_KWARGS:
            return key
        if key in ("cache", "past_key_values") and value is not None:
            return f"a cache passed as {key}"
        if key == "use_cache" and value is False:
            return "use_cache=False"
    return None


class DecoderSlot:
    """The model's :class:`GraphDecoder` between ``generate`` calls, with what it was built for.

    Copies and pickles of a model start with an empty slot: captured graphs and static buffers belong
    to one model's parameters."""

    def __init__(self):
        self.decoder: GraphDecoder | None = None
        self.key: tuple | None = None

    def __deepcopy__(self, memo):
        return DecoderSlot()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


def model_key(model) -> tuple:
    """What a decoder's graphs and buffers depend on: device, dtype and the storage of every parameter
    (a graph replays with the pointers it was captured with)."""
    emb = model.get_input_embeddings().weight
    return emb.device, emb.dtype, tuple(p.data_ptr() for p in model.parameters())


def decoder_for(model, slot: DecoderSlot, batch_size: int, max_length: int, max_cache_len: int | None) -> GraphDecoder:
    """The slot's decoder (a new one when there is none or the model's weights, dtype or device
    changed), with a bucket ready for ``batch_size`` rows.

    Global attention layers need ``max(max_length, max_cache_len)`` slots, transformers' sizing of a
    static cache: a bucket that holds that many is reused, a shorter one is rebuilt at that length."""
    key = model_key(model)
    need = max(max_length, max_cache_len or 0)
    if slot.decoder is None or slot.decoder.model is not model or slot.key != key:
        slot.decoder = None  # free the old buffers and graphs before allocating new ones
        slot.decoder, slot.key = GraphDecoder(model, max_length=need), key
    slot.decoder.reserve(batch_size, need)
    return slot.decoder


class _StopFlag:
    """Whether every row has finished, read on the host one step late on CUDA: the flag is copied to
    pinned memory behind the step's sampling, the next decode step is queued, and only then does the
    host wait, for the copy alone, so the GPU never idles on the check. Elsewhere it is read at once."""

    def __init__(self, device: torch.device):
        self.deferred = device.type == "cuda"
        self.value = False
        if self.deferred:
            self.host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self.event = torch.cuda.Event()

    def post(self, unfinished: torch.Tensor) -> None:
        done = unfinished.max() == 0
        if self.deferred:
            self.host.copy_(done, non_blocking=True)
            self.event.record()
        else:
            self.value = bool(done)

    def read(self) -> bool:
        if self.deferred:
            self.event.synchronize()
            return bool(self.host)
        return self.value


@torch.no_grad()
def graph_sample(model, slot: DecoderSlot, input_ids: torch.Tensor, logits_processor, stopping_criteria,
                 generation_config, streamer=None, **model_kwargs):
    """transformers' greedy search / multinomial sampling loop (the arguments of ``_sample``) with the
    prefill on the model's forward and every later step on the slot's :class:`GraphDecoder`.

    Returns the sequences [B, T + n], or a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``
    (``scores`` / ``logits`` when asked for; no attentions, hidden states or cache)."""
    B, T = input_ids.shape
    device = input_ids.device
    total = max(int(generation_config.max_length), T + 1)  # transformers' loop always adds one token
    pad = getattr(generation_config, "_pad_token_tensor", None)
    pad = pad.to(device) if pad is not None else None
    eos_stop = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    keep = generation_config.return_dict_in_generate
    scores = () if keep and generation_config.output_scores else None
    raw_logits = () if keep and generation_config.output_logits else None

    inputs = model.prepare_inputs_for_generation(input_ids, **model_kwargs)
    cache = inputs.get("past_key_values", inputs.get("cache"))
    out = model(**inputs, return_dict=True)
    logits = out.logits[:, -1].to(dtype=torch.float32, copy=True)
    del out, inputs

    seqs = input_ids.new_empty(B, total)
    seqs[:, :T] = input_ids
    unfinished = torch.ones(B, dtype=torch.long, device=device)
    flag = _StopFlag(device)
    dec = None
    cur = T
    while True:
        step_scores = logits_processor(seqs[:, :cur], logits)
        if scores is not None:
            scores += (step_scores,)
        if raw_logits is not None:
            raw_logits += (logits,)
        if generation_config.do_sample:
            tok = torch.multinomial(step_scores.softmax(-1), num_samples=1).squeeze(1)
        else:
            tok = step_scores.argmax(-1)
        if eos_stop:  # finished rows continue with padding
            tok = tok * unfinished + pad * (1 - unfinished)
        seqs[:, cur] = tok
        cur += 1
        if streamer is not None:
            streamer.put(tok.cpu())
        unfinished = unfinished & ~stopping_criteria(seqs[:, :cur], scores)
        flag.post(unfinished)
        if cur >= total or (not flag.deferred and flag.read()):
            break
        if dec is None:  # only when a second token is wanted: a one-token call never touches the decoder
            dec = decoder_for(model, slot, B, total, getattr(generation_config, "max_cache_len", None))
            dec.start(cache)
            cache = None
        logits = dec.step(tok)  # on CUDA queued before the host reads the flag: on a stop it is unused
        if flag.deferred and flag.read():
            break
    if streamer is not None:
        streamer.end()
    seqs = seqs[:, :cur]
    if keep:
        return GenerateDecoderOnlyOutput(sequences=seqs, scores=scores, logits=raw_logits)
    return seqs
