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
from typing import Any, Dict, List, Optional, Tuple

import torch

from .attention import _attention as _call, attention
from .client import Client


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
          kv_offset: int = 0, mask_function: Any = None,
          attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask builder registered next to the attention: hands the 2-D
    padding mask through (None when it has no padding), like transformers'
    flash-attention builder, so that the attention sees padding and refuses
    it instead of it being dropped."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
    return attention_mask


def _mask_causality(mask: torch.Tensor, S: int) -> Optional[bool]:
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


def _documents(position_ids: Optional[torch.Tensor], S: int) -> Optional[List[int]]:
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
    idx: List[int] = torch.nonzero(starts[0]).flatten().tolist()
    if len(idx) <= 1:
        return None
    return idx + [S]


def _attention(opts: Dict[str, Any], module: Any, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Optional[torch.Tensor],
               dropout: float = 0.0, scaling: Optional[float] = None,
               sliding_window: Optional[int] = None, softcap: Optional[float] = None,
               is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
               **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The attention registered with transformers (the signature of its
    AttentionInterface functions).

    Arguments:
        opts: stria.attention's client, layout and ring_size (bound by register).
        module: the model's attention module (its is_causal is read).
        query, key, value: (batch, heads, seqlen, headdim), as transformers passes them.
        attention_mask: None, a 2-D all-ones mask, or a 4-D causal/all-visible mask.
        dropout, softcap, s_aux: must be off (refused otherwise).
        scaling: the softmax scale (None: 1/sqrt(headdim)).
        sliding_window: the model's window W (keys with q - k < W are visible).
        is_causal: overrides module.is_causal when given.
        kwargs: position_ids (packed sequences become documents) and the rest, ignored.
    Returns:
        (out, None): out is (batch, seqlen, heads, headdim); no attention weights.
    """
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


def register(name: str = "stria", *, client: Optional["Client"] = None, layout: str = "auto",
             ring_size: int = 0) -> str:
    """Registers stria as attention implementation `name` with transformers
    (attention and mask builder), so that
    ``attn_implementation=name`` runs the model's attention through the
    service; client, layout and ring_size go to stria.attention.

    Arguments:
        name: the attn_implementation name to register.
        client: the stria.Client the calls use (None: the default client).
        layout: the sequence layout on the ring ("auto", "striped", "contiguous", "zigzag").
        ring_size: workers in the ring (0: the service chooses).
    Returns:
        name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fn = functools.partial(_attention, {"client": client, "layout": layout,
                                        "ring_size": ring_size})
    functools.update_wrapper(fn, _attention)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _mask)
    return name
