"""The GPU check's models, written here so the kit needs nothing beyond torch.

* ``resnet50``: ResNet-50 as torchvision builds it (bottleneck blocks 3-4-6-3, the
  stride on the 3x3 convolution, 1000 classes): 25,557,032 parameters, on
  3x224x224 images.
* ``gpt2``: GPT-2 small: 12 blocks of width 768 with 12 heads, context 1024, the
  50,257-token vocabulary, the output layer tied to the token embedding:
  124,439,808 parameters.

``build(name, size)`` gives the model, a batch maker and the loss; ``size`` "tiny"
keeps each architecture but shrinks widths, depth, images, context and vocabulary
so that the same code runs on a CPU in seconds. The inputs are random: the check
measures time and correctness, not accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

RESNET50_PARAMETERS = 25_557_032
GPT2_PARAMETERS = 124_439_808


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here, as torchvision's "v1.5") -> 1x1, with a projection shortcut."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or in_planes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, width: int = 64, num_classes: int = 1000, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, in_planes = [], width
        for i, count in enumerate(blocks):
            planes = width * 2**i
            for j in range(count):
                stages.append(Bottleneck(in_planes, planes, stride=2 if i > 0 and j == 0 else 1))
                in_planes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=50257, context=1024, width=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2: counted and sent once
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


@dataclass
class Workload:
    """A model with its inputs: what one step of the check trains."""

    name: str
    model: nn.Module
    batch: Callable[[torch.Generator], tuple]  # random inputs and targets on the model's device
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    description: str


# Per size: the architecture's knobs and the batch. "full" is what issue 39 asks for.
RESNET_SIZES = {
    "full": {"width": 64, "num_classes": 1000, "image": 224, "batch": 64},
    "tiny": {"width": 8, "num_classes": 10, "image": 32, "batch": 4},
}
GPT_SIZES = {
    "full": {"vocab": 50257, "context": 1024, "width": 768, "layers": 12, "heads": 12, "batch": 8},
    "tiny": {"vocab": 256, "context": 32, "width": 64, "layers": 2, "heads": 2, "batch": 2},
}


def build(name: str, size: str, device: torch.device, seed: int = 0) -> Workload:
    """The model `name` ("resnet50" or "gpt2") at `size` ("full" or "tiny") on `device`."""
    torch.manual_seed(seed)
    if name == "resnet50":
        knobs = dict(RESNET_SIZES[size])
        image, batch = knobs.pop("image"), knobs.pop("batch")
        with torch.device(device):
            model = ResNet50(**knobs)

        def make_batch(g):
            x = torch.randn(batch, 3, image, image, generator=g).to(device)
            y = torch.randint(0, knobs["num_classes"], (batch,), generator=g).to(device)
            return x, y

        def loss(m, b):
            return F.cross_entropy(m(b[0]), b[1])

        description = f"ResNet-50 (width {knobs['width']}), batch {batch} of 3x{image}x{image}"
    elif name == "gpt2":
        knobs = dict(GPT_SIZES[size])
        batch = knobs.pop("batch")
        with torch.device(device):
            model = GPT2(**knobs)

        def make_batch(g):
            tokens = torch.randint(0, knobs["vocab"], (batch, knobs["context"] + 1), generator=g)
            tokens = tokens.to(device)
            return tokens[:, :-1], tokens[:, 1:]

        def loss(m, b):
            logits = m(b[0])
            return F.cross_entropy(logits.flatten(0, 1).float(), b[1].flatten())

        description = (
            f"GPT-2 ({knobs['layers']} x {knobs['width']}, context {knobs['context']}, "
            f"vocabulary {knobs['vocab']}), batch {batch}"
        )
    else:
        raise ValueError(f"unknown model {name!r}: resnet50 or gpt2")
    count = sum(p.numel() for p in model.parameters())
    return Workload(name, model, make_batch, loss, f"{description}, {count:,} parameters")
