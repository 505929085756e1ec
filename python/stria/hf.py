"""Hugging Face transformers: stria as an attention implementation.

    import stria.hf
    stria.hf.register()               # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="stria")

Packed sequences (position_ids that restart) become documents (cu_seqlens);
a model's sliding_window W becomes window_size (W - 1, 0), since transformers
lets a query see the keys with q - k < W. Padding masks are refused (pack the
sequences instead); a None, all-ones or plain causal mask is accepted.
"""

import functools

import torch

from .attention import _attention as _call, attention


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
          attention_mask=None, **kwargs):
    """The mask builder registered next to the attention: hands the 2-D
    padding mask through (None when it has no padding), like transformers'
    flash-attention builder, so that the attention sees padding and refuses
    it instead of it being dropped."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
    return attention_mask


def _mask_causality(mask, S):
    """True for a plain causal mask, False for an all-visible one; raises for
    anything else (padding, custom patterns)."""
    if mask.dim() == 2:
        if bool(mask.bool().all()):
            return None
        raise ValueError("stria: padding masks are not supported; pack the sequences (documents "
                         "from position_ids) instead of padding them")
    if mask.dim() != 4 or mask.shape[-2:] != (S, S):
        raise ValueError(f"stria: an attention mask of shape {tuple(mask.shape)} is not "
                         f"supported (None, all-ones or plain causal only)")
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    tril = torch.ones(S, S, dtype=torch.bool, device=mask.device).tril()
    if bool((visible == tril).all()):
        return True
    if bool(visible.all()):
        return False
    raise ValueError("stria: only plain causal or all-visible attention masks are supported; "
                     "this one hides other keys (padding?): pack the sequences instead")


def _documents(position_ids, S):
    """cu_seqlens from position_ids that restart (packed sequences), or None
    for one sequence per row. Every batch row must split the same way (the
    service takes one list for the batch)."""
    if position_ids is None:
        return None
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[-1] != S:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool((starts == starts[:1]).all()):
        raise ValueError("stria: packed sequences must split every batch row at the same tokens "
                         "(the service takes one cu_seqlens for the batch); use batch 1")
    idx = torch.nonzero(starts[0]).flatten().tolist()
    if len(idx) <= 1:
        return None
    return idx + [S]


def _attention(opts, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    if dropout:
        raise NotImplementedError(f"stria: attention dropout ({dropout}) is not supported; set "
                                  f"the config's attention_dropout to 0")
    if softcap:
        raise NotImplementedError("stria: logit softcapping is not supported")
    if s_aux is not None:
        raise NotImplementedError("stria: attention sinks (s_aux) are not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    S = query.shape[2]
    if attention_mask is not None:
        from_mask = _mask_causality(attention_mask, S)
        if from_mask is not None:
            causal = from_mask
    window = (-1, -1)
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError("stria: a sliding window on a non-causal model")
        window = (int(sliding_window) - 1, 0)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    position_ids = kwargs.get("position_ids")
    if torch.compiler.is_compiling() and position_ids is not None:
        # the documents depend on the values: the op finds them when it runs
        out = _call(q, k, v, causal, scaling, window, None, opts["layout"],
                    opts["ring_size"], False, opts["client"],
                    positions=position_ids.reshape(-1, position_ids.shape[-1]))
    else:
        out = attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window,
                        cu_seqlens=_documents(position_ids, S), **opts)
    return out, None


def register(name="stria", *, client=None, layout="auto", ring_size=0):
    """Registers stria as attention implementation `name` with transformers
    (attention and mask builder), so that
    ``attn_implementation=name`` runs the model's attention through the
    service; client, layout and ring_size go to stria.attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fn = functools.partial(_attention, {"client": client, "layout": layout,
                                        "ring_size": ring_size})
    functools.update_wrapper(fn, _attention)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _mask)
    return name
