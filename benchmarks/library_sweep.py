"""Models from libraries beyond Transformers and diffusers: does ``shard_model`` take them?

    python benchmarks/library_sweep.py              # every model whose library is installed
    python benchmarks/library_sweep.py timm/resnet18d pyg/gcn

torchvision, timm, x-transformers, MONAI, PyTorch Geometric, vit-pytorch, open_clip and
pytorch-tabnet models with random weights, each sharded into 3 stages from a batch-2 example and
then called on a later input of batch 3
(and another image side, sequence length or graph size where the model lets it vary), compared
with the model exactly, as ``architecture_sweep.py`` does. ``-train`` rows run in training mode
(dropout, stochastic depth) under the same seed. A library that is not installed is skipped
with a note: none of them is a dependency (torchvision publishes no CPU wheel for this torch on
the project's index, so it was measured with a build whose compiled operators do not load:
detection models, which need them, are left out).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import torch
from torch import nn

from architecture_sweep import check, sweep

Build = Callable[[], nn.Module]
Inputs = Callable[[int, int], dict[str, Any]]


def image(sides: tuple[int, int], name: str = "x") -> Inputs:
    """An image batch; the second call argument picks the example's side (0) or the later one (1)."""
    return lambda batch, later: {name: torch.randn(batch, 3, sides[later], sides[later])}


def volume(sides: tuple[int, int], name: str = "x") -> Inputs:
    return lambda batch, later: {name: torch.randn(batch, 1, sides[later], sides[later], sides[later])}


def tokens(lengths: tuple[int, int], name: str = "x") -> Inputs:
    return lambda batch, later: {name: torch.randint(0, 100, (batch, lengths[later]))}


def graph(nodes: tuple[int, int]) -> Inputs:
    return lambda batch, later: {"x": torch.randn(nodes[later] * batch, 8),
                                 "edge_index": torch.randint(0, nodes[later] * batch, (2, 3 * nodes[later] * batch))}


def torchvision_models() -> dict[str, tuple[Build, Inputs, bool]]:
    models = importlib.import_module("torchvision.models")
    plain = ["resnet18", "resnext50_32x4d", "mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf", "densenet121",
             "shufflenet_v2_x0_5", "mnasnet0_5", "squeezenet1_0", "vgg11", "convnext_tiny", "swin_t", "swin_v2_t"]
    entries: dict[str, tuple[Build, Inputs, bool]] = {
        name: (functools.partial(models.get_model, name, weights=None), image((64, 96)), False) for name in plain}
    entries["vit_b_16"] = (functools.partial(models.VisionTransformer, image_size=32, patch_size=8, num_layers=2,
                                             num_heads=2, hidden_dim=32, mlp_dim=64), image((32, 32)), False)
    entries["googlenet-train"] = (functools.partial(models.googlenet, init_weights=False), image((64, 96)), True)
    for name, argument in (("fcn_resnet50", "x"), ("lraspp_mobilenet_v3_large", "input")):
        entries[name] = (functools.partial(models.get_model, name, weights=None, weights_backbone=None, num_classes=5),
                         image((64, 96), argument), False)
    entries["r3d_18"] = (models.video.r3d_18, lambda b, later: {"x": torch.randn(b, 3, 4, 64 + 32 * later, 64)}, False)
    entries["swin3d_t"] = (models.video.swin3d_t, lambda b, later: {"x": torch.randn(b, 3, 4, 64 + 32 * later, 64)},
                           False)
    entries["raft_small"] = (functools.partial(models.optical_flow.raft_small, weights=None),
                             lambda b, later: {"image1": torch.randn(b, 3, 128 + 32 * later, 128),
                                               "image2": torch.randn(b, 3, 128 + 32 * later, 128)}, False)
    return entries


def timm_models() -> dict[str, tuple[Build, Inputs, bool]]:
    timm = importlib.import_module("timm")
    names = ["vit_tiny_patch16_224", "resnet18d", "convnext_atto", "mobilevit_xxs", "levit_128s", "pvt_v2_b0",
             "xcit_nano_12_p16_224", "cait_xxs24_224", "fastvit_t8", "eva02_tiny_patch14_224", "hiera_tiny_224",
             "mobilenetv4_conv_small", "nfnet_f0", "hrnet_w18_small"]
    entries: dict[str, tuple[Build, Inputs, bool]] = {
        name: (functools.partial(timm.create_model, name, pretrained=False), image((224, 224)), False)
        for name in names}
    for name in ("efficientnet_b0", "swin_tiny_patch4_window7_224"):
        entries[f"{name}-train"] = (functools.partial(timm.create_model, name, pretrained=False, drop_rate=0.1,
                                                      drop_path_rate=0.1), image((224, 224)), True)
    return entries


def x_transformers_models() -> dict[str, tuple[Build, Inputs, bool]]:
    xt = importlib.import_module("x_transformers")

    def wrapper(**layers: Any) -> Build:
        kind = xt.Decoder if layers.pop("causal") else xt.Encoder
        return lambda: xt.TransformerWrapper(num_tokens=100, max_seq_len=64,
                                             attn_layers=kind(dim=32, depth=3, heads=2, **layers))
    return {"decoder-rotary": (wrapper(causal=True, rotary_pos_emb=True), tokens((16, 9)), False),
            "encoder-alibi-glu": (wrapper(causal=False, alibi_pos_bias=True, ff_glu=True), tokens((16, 9)), False)}


def monai_models() -> dict[str, tuple[Build, Inputs, bool]]:
    nets = importlib.import_module("monai.networks.nets")
    return {
        "unet": (functools.partial(nets.UNet, spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16),
                                   strides=(2, 2), num_res_units=2), volume((16, 24)), False),
        "segresnet": (functools.partial(nets.SegResNet, spatial_dims=3, init_filters=8, in_channels=1, out_channels=2),
                      volume((16, 24)), False),
        "unetr": (functools.partial(nets.UNETR, in_channels=1, out_channels=2, img_size=(32, 32, 32), feature_size=8,
                                    hidden_size=48, mlp_dim=96, num_heads=3), volume((32, 32), "x_in"), False),
        "swinunetr": (functools.partial(nets.SwinUNETR, in_channels=1, out_channels=2, feature_size=12,
                                        depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)),
                      volume((64, 64), "x_in"), False),
    }


def pyg_models() -> dict[str, tuple[Build, Inputs, bool]]:
    pyg = importlib.import_module("torch_geometric.nn")
    return {
        "gcn": (lambda: pyg.GCN(8, 16, num_layers=3, out_channels=4), graph((10, 17)), False),
        "gat": (lambda: pyg.GAT(8, 16, num_layers=3, out_channels=4, heads=2), graph((10, 17)), False),
        "graphsage": (lambda: pyg.GraphSAGE(8, 16, num_layers=3, out_channels=4), graph((10, 17)), False),
        "gin": (lambda: pyg.GIN(8, 16, num_layers=3, out_channels=4), graph((10, 17)), False),
    }


def vit_pytorch_models() -> dict[str, tuple[Build, Inputs, bool]]:
    cait = importlib.import_module("vit_pytorch.cait")
    max_vit = importlib.import_module("vit_pytorch.max_vit")
    vit = importlib.import_module("vit_pytorch.vit")
    return {
        "vit": (lambda: vit.ViT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64),
                image((32, 32), "img"), False),
        # layer dropout picks the layers to run with a torch draw in Python (dropout_layers)
        "cait-layerdrop-train": (lambda: cait.CaiT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=4,
                                                   cls_depth=1, heads=2, mlp_dim=64, layer_dropout=0.5),
                                 image((32, 32), "img"), True),
        "maxvit": (lambda: max_vit.MaxViT(num_classes=10, dim_conv_stem=16, dim=16, dim_head=8, depth=(1, 1),
                                          window_size=4, mbconv_expansion_rate=2, mbconv_shrinkage_rate=0.25),
                   image((32, 64)), False),
    }


def open_clip_models() -> dict[str, tuple[Build, Inputs, bool]]:
    model = importlib.import_module("open_clip.model")

    def clip() -> nn.Module:
        return model.CLIP(embed_dim=16, vision_cfg=model.CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=8,
                                                                       image_size=32),
                          text_cfg=model.CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=2))
    return {"clip": (clip, lambda batch, later: {"image": torch.randn(batch, 3, 32, 32),
                                                 "text": torch.randint(0, 100, (batch, 16))}, False)}


def tabnet_models() -> dict[str, tuple[Build, Inputs, bool]]:
    network = importlib.import_module("pytorch_tabnet.tab_network")
    build = functools.partial(network.TabNet, input_dim=10, output_dim=3, n_d=8, n_a=8, n_steps=2,
                              virtual_batch_size=2, group_attention_matrix=torch.eye(10))
    # ghost batch norm chunks the batch into ceil(batch / 2) parts: a count computed from a size
    return {"tabnet-train": (build, lambda batch, later: {"x": torch.randn(2 * batch, 10)}, True)}


LIBRARIES = {"torchvision": torchvision_models, "timm": timm_models, "x-transformers": x_transformers_models,
             "monai": monai_models, "pyg": pyg_models, "vit-pytorch": vit_pytorch_models,
             "open_clip": open_clip_models, "pytorch-tabnet": tabnet_models}


def main() -> None:
    wanted = sys.argv[1:]
    checks: dict[str, Callable[[], tuple[str, str, float, str]]] = {}
    for library, models in LIBRARIES.items():
        try:
            entries = models()
        except Exception as exc:  # noqa: BLE001 - an absent or broken library is skipped, and said so
            print(f"skipped {library}: {type(exc).__name__}: {exc}")
            continue
        for name, (build, inputs, training) in entries.items():
            label = f"{library}/{name}"
            if not wanted or label in wanted:
                checks[label] = functools.partial(check, build, inputs, training, (2, 0), (3, 1))
    sweep(checks, "model")


if __name__ == "__main__":
    main()
