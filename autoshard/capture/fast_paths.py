"""PyTorch's fused inference paths, kept whole so that the stages run the model's kernels.

``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` choose at every call between their
Python code and one fused kernel (``torch._transformer_encoder_layer_fwd``,
``torch._native_multi_head_attention``): in eval mode, without grad, for batch-first inputs and
some settings of the module. A capture that traces through them records the Python code (a traced
value never qualifies: it carries a torch function), so the stages would run other kernels than
the model, slower and equal only to rounding. ``nn.TransformerEncoder`` given a padding mask packs
the batch into a nested tensor and leaves padded positions at zero, which a trace cannot record
at all. So, in eval mode, a module whose settings allow its fused path is kept whole and chooses
its path at each call as in the model (``fused-paths=false`` traces through the layers, for a finer
split equal to rounding; a padded encoder stays whole, as tracing it would change its values); in
training no fused path exists and they are traced through. The settings read are those the
modules' own forwards check that do not depend on the call (torch 2.13, ``nn/modules/activation.py``
and ``transformer.py``): keeping one whole where the call then takes the regular path is still
exact, only coarser.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from torch import nn

from autoshard.capture.leaves import Leaves
from autoshard.capture.result import WrappedLeaf

#: Why such a module is whole, as the capture's record says it.
FUSED_REASON = "kept whole by design: PyTorch's fused inference path (eval mode), so stages run the model's kernel"
PACKED_REASON = ("kept whole by design: in eval mode it packs a padded batch into a nested tensor and leaves padded "
                 "positions at zero, which a trace cannot record")


def _attention_fuses(attention: nn.MultiheadAttention) -> bool:
    return (attention.batch_first and attention._qkv_same_embed_dim and attention.in_proj_bias is not None
            and attention.num_heads % 2 == 0 and attention.bias_k is None and attention.bias_v is None
            and not attention.add_zero_attn)


def has_fused_path(module: nn.Module) -> bool:
    """Whether ``module`` (in eval mode) can take a fused kernel whatever the call's tensors."""
    if module.training:
        return False
    if isinstance(module, nn.TransformerEncoderLayer):
        return (_attention_fuses(module.self_attn) and module.activation_relu_or_gelu
                and module.norm1.eps == module.norm2.eps)
    return isinstance(module, nn.MultiheadAttention) and _attention_fuses(module)


def fused_modules(model: nn.Module, fused_paths: bool = True, calls_unknown: bool = False) -> dict[int, nn.Module]:
    """The submodules of ``model`` to keep whole, outermost only, by id: with ``fused_paths``
    those with a fused path; with ``calls_unknown`` (a front end that cannot see a module's call
    before tracing it, torch.export) every ``nn.TransformerEncoder`` that may pack a padded batch."""
    found: dict[int, nn.Module] = {}
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside:
            continue
        if (fused_paths and has_fused_path(module)) or (calls_unknown and _may_pack(module)):
            found[id(module)] = module
            inside.update(id(m) for m in module.modules())
    return found


def _may_pack(module: nn.Module) -> bool:
    return isinstance(module, nn.TransformerEncoder) and not module.training and module.use_nested_tensor


def packs_padded_batch(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether this call of an ``nn.TransformerEncoder`` in eval mode may pack its batch into a
    nested tensor (its constructor allowed it and a padding mask is given): kept whole then."""
    if not _may_pack(module):
        return False
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError:
        return False
    return bound.get("src_key_padding_mask") is not None


def kept_whole_by_design(leaves: Leaves, kept: Mapping[int, nn.Module]) -> tuple[WrappedLeaf, ...]:
    """The capture's record of the fused modules it kept whole, by their paths in the model."""
    return tuple(WrappedLeaf("module", leaves.paths[key], PACKED_REASON if _may_pack(module) else FUSED_REASON,
                             by_design=True) for key, module in kept.items())
