"""Benchmark models, written here so the benchmark needs nothing beyond torch.

* ``resnet18``: ResNet-18 for CIFAR-shaped inputs (3x32x32, 10 classes): a 3x3
  stem with stride 1 and no max-pool, four stages of two basic blocks
  (64-128-256-512 channels). 11.17M parameters, the model of the PowerSGD
  paper's image experiments.
* ``lstm``: the paper's WikiText-2 language model: 3-layer LSTM, embedding and
  hidden size 650, decoder weight tied to the embedding. The vocabulary of
  28,869 tokens gives 28.95M parameters.
* ``gpt``: a small GPT-style decoder: 4 pre-norm blocks of width 256 (4 heads,
  MLP 1024), context 128, a vocabulary of 8,192 tokens with the output tied to
  the token embedding: 5.3M parameters, the kind of model AdamW trains (here,
  like the others, with SGD: the benchmark times communication).
* ``manyshapes``: 300 linear layers of random widths (32-288, fixed seed), so
  nearly every layer is a shape of its own, the case where work batched per
  shape alone is slow (docs/benchmarks-overheads.md): 298 shapes, 8.15M
  parameters.

* ``smallstep``: a model whose step takes 10-50 ms, as many do on a GPU: a token
  embedding (8,192 x 128, averaged over 16 tokens), two wide layers (128-1024-128)
  and 24 narrow ones (128 x 128, each with a LayerNorm), 10 classes: 1.72M
  parameters, 6.9 MB of gradients a step in 103 tensors, most of them small.
* ``tiny``: a 3-layer MLP (256-512-512-10, 0.4M parameters) for tests of the benchmark
  itself: a step of a few tens of milliseconds at batch 128-256 on one core.

The GPU kit's models (scripts/gpu/, docs/gpu.md), through ``workload(name, size, device)``;
bench/dispatch.py counts the ops of a step on ResNet-50's shapes (``parameter_shapes``):

* ``resnet50``: ResNet-50 as torchvision builds it (bottleneck blocks 3-4-6-3, the stride
  on the 3x3 convolution, 1000 classes): 25,557,032 parameters, on 3x224x224 images.
* ``gpt2``: GPT-2 small: 12 blocks of width 768 with 12 heads, context 1024, the
  50,257-token vocabulary, the output layer tied to the token embedding: 124,439,808
  parameters.

Size "tiny" keeps each architecture but shrinks widths, depth, images, context and
vocabulary, so that the same code runs on a CPU in seconds.

Each comes with a synthetic batch maker: the benchmark measures speed and bytes,
not accuracy, so the inputs are random tensors of the right shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

LSTM_VOCAB = 28869
LSTM_WIDTH = 650
LSTM_LAYERS = 3
LSTM_SEQ_LEN = 30  # tokens of back-propagation through time per sample


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers = []
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(
                nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1))
            )
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM with tied input/output embeddings."""

    def __init__(self, vocab: int = LSTM_VOCAB, width: int = LSTM_WIDTH, layers: int = LSTM_LAYERS):
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, layers, batch_first=True)
        self.decoder = nn.Linear(width, vocab)
        # Tied weights: the decoder's gradient lands in the embedding's .grad.
        self.decoder.weight = self.encoder.weight

    def forward(self, tokens):
        out, _ = self.lstm(self.encoder(tokens))
        return self.decoder(out)


MANY_SHAPES_LAYERS = 300


def _many_shapes_widths(layers: int = MANY_SHAPES_LAYERS) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(32, 289, (layers + 1,), generator=g).tolist()


GPT_VOCAB, GPT_WIDTH, GPT_LAYERS, GPT_HEADS, GPT_CONTEXT = 8192, 256, 4, 4, 128


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A small decoder-only transformer (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(GPT_VOCAB, GPT_WIDTH)
        self.positions = nn.Embedding(GPT_CONTEXT, GPT_WIDTH)
        self.blocks = nn.ModuleList(GPTBlock(GPT_WIDTH, GPT_HEADS) for _ in range(GPT_LAYERS))
        self.norm = nn.LayerNorm(GPT_WIDTH)
        mask = torch.triu(torch.full((GPT_CONTEXT, GPT_CONTEXT), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask[: tokens.shape[1], : tokens.shape[1]])
        return self.norm(x) @ self.tokens.weight.T  # output tied to the token embedding


def _gpt_batch(batch_size: int, generator: torch.Generator):
    tokens = torch.randint(0, GPT_VOCAB, (batch_size, GPT_CONTEXT + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class ManyShapes(nn.Module):
    """A stack of linear layers whose widths are drawn at random, the same every time."""

    def __init__(self, layers: int = MANY_SHAPES_LAYERS):
        super().__init__()
        widths = _many_shapes_widths(layers)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _many_shapes_batch(batch_size: int, generator: torch.Generator):
    x = torch.randn(batch_size, _many_shapes_widths()[0], generator=generator)
    return (x,)


def _many_shapes_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def _resnet_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    return x, y


def _lstm_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, LSTM_VOCAB, (batch_size, LSTM_SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _resnet_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lstm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


SMALL_VOCAB, SMALL_WIDTH, SMALL_WIDE, SMALL_NARROW, SMALL_TOKENS = 8192, 128, 1024, 24, 16


class SmallStep(nn.Module):
    """A model with a GPU-sized step on a CPU (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(SMALL_VOCAB, SMALL_WIDTH)
        self.wide = nn.Sequential(
            nn.Linear(SMALL_WIDTH, SMALL_WIDE), nn.GELU(), nn.Linear(SMALL_WIDE, SMALL_WIDTH)
        )
        self.narrow = nn.ModuleList(
            nn.Sequential(nn.Linear(SMALL_WIDTH, SMALL_WIDTH), nn.LayerNorm(SMALL_WIDTH))
            for _ in range(SMALL_NARROW)
        )
        self.head = nn.Linear(SMALL_WIDTH, 10)

    def forward(self, tokens):
        x = self.tokens(tokens).mean(dim=1)
        x = x + self.wide(x)
        for layer in self.narrow:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def _small_step_batch(batch_size: int, generator: torch.Generator):
    tokens = torch.randint(0, SMALL_VOCAB, (batch_size, SMALL_TOKENS), generator=generator)
    return tokens, torch.randint(0, 10, (batch_size,), generator=generator)


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))  # fmt: skip


def _tiny_batch(batch_size: int, generator: torch.Generator):
    x = torch.randn(batch_size, 256, generator=generator)
    return x, torch.randint(0, 10, (batch_size,), generator=generator)


# name -> (model factory, synthetic batch maker, loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
    "resnet18": (ResNet18, _resnet_batch, _resnet_loss),
    "lstm": (LSTMLanguageModel, _lstm_batch, _lstm_loss),
    "manyshapes": (ManyShapes, _many_shapes_batch, _many_shapes_loss),
    "gpt": (GPT, _gpt_batch, _lstm_loss),  # the same next-token loss
    "smallstep": (SmallStep, _small_step_batch, _resnet_loss),  # classification too
    "tiny": (_tiny, _tiny_batch, _resnet_loss),  # classification, like ResNet-18's
}


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# -- the GPU kit's models ------------------------------------------------------------------
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
    """torchvision's ResNet-50 (``blocks=(3, 4, 23, 3)``: ResNet-101), parameters in its order."""

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


class GPT2Block(nn.Module):
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
        self.blocks = nn.Sequential(*(GPT2Block(width, heads) for _ in range(layers)))
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


def parameter_shapes(factory: Callable[[], nn.Module]) -> list[tuple[int, ...]]:
    """The shapes of a model's parameters in their order, built on the meta device (no memory)."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in factory().parameters()]


@dataclass
class Workload:
    """A model with its inputs: what one step of the GPU kit trains."""

    name: str
    model: nn.Module
    batch: Callable[[torch.Generator], tuple]  # random inputs and targets on the model's device
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    description: str


# Per size: the architecture's knobs and the batch ("full": the GPU kit's on a device).
RESNET50_SIZES = {
    "full": {"width": 64, "num_classes": 1000, "image": 224, "batch": 64},
    "tiny": {"width": 8, "num_classes": 10, "image": 32, "batch": 4},
}
GPT2_SIZES = {
    "full": {"vocab": 50257, "context": 1024, "width": 768, "layers": 12, "heads": 12, "batch": 8},
    "tiny": {"vocab": 256, "context": 32, "width": 64, "layers": 2, "heads": 2, "batch": 2},
}


def workload(name: str, size: str, device: torch.device, seed: int = 0) -> Workload:
    """The model `name` ("resnet50" or "gpt2") at `size` ("full" or "tiny") on `device`."""
    torch.manual_seed(seed)
    if name == "resnet50":
        knobs = dict(RESNET50_SIZES[size])
        image, batch = knobs.pop("image"), knobs.pop("batch")
        with torch.device(device):
            model = ResNet50(**knobs)

        def make_batch(g):
            x = torch.randn(batch, 3, image, image, generator=g).to(device)
            return x, torch.randint(0, knobs["num_classes"], (batch,), generator=g).to(device)

        loss = _resnet_loss
        description = f"ResNet-50 (width {knobs['width']}), batch {batch} of 3x{image}x{image}"
    elif name == "gpt2":
        knobs = dict(GPT2_SIZES[size])
        batch = knobs.pop("batch")
        with torch.device(device):
            model = GPT2(**knobs)

        def make_batch(g):
            tokens = torch.randint(0, knobs["vocab"], (batch, knobs["context"] + 1), generator=g)
            tokens = tokens.to(device)
            return tokens[:, :-1], tokens[:, 1:]

        def loss(m, b):
            return F.cross_entropy(m(b[0]).flatten(0, 1).float(), b[1].flatten())

        description = (
            f"GPT-2 ({knobs['layers']} x {knobs['width']}, context {knobs['context']}, "
            f"vocabulary {knobs['vocab']}), batch {batch}"
        )
    else:
        raise ValueError(f"unknown model {name!r}: resnet50 or gpt2")
    count = sum(p.numel() for p in model.parameters())
    return Workload(name, model, make_batch, loss, f"{description}, {count:,} parameters")
