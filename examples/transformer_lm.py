"""Small decoder-only transformer language model trained with Horovod + PowerSGD and AdamW.

Launch (from the repository root):

    # one process, no launcher
    python examples/transformer_lm.py --epochs 1
    # 2 workers, PowerSGD rank 8; plain all-reduce for the LR warm-up (--start-iter)
    horovodrun -np 2 -H localhost:2 python examples/transformer_lm.py --powersgd-rank 8
    # the plain Horovod baseline: same script, compression off
    horovodrun -np 2 -H localhost:2 python examples/transformer_lm.py --powersgd-rank 0
    # save after every epoch; the same command resumes, a larger --epochs trains on
    # (the cosine schedule spans --decay-epochs, so fix it when a run may be extended)
    horovodrun -np 2 -H localhost:2 python examples/transformer_lm.py \\
        --epochs 8 --decay-epochs 8 --checkpoint runs/transformer.ckpt

The text and its word-level tokens are those of examples/lstm_language_model.py
(the Python 3.11 documentation's prose from Debian's ``python3.11-doc``, or
``--text-file``): the corpus reader, tokenizer, 90/5/5 % split and vocabulary are
imported from there. Each worker cuts its share of the tokens into windows of
``--block`` tokens; the order of the windows is shuffled every epoch, alike on
every rank (a seeded generator), so a resumed run sees the same order.

The model is GPT-style: token and learned position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, a final LayerNorm, and an output
layer tied to the token embedding. AdamW decays the weight matrices of the
attention and MLP layers only; biases, LayerNorm gains and both embeddings
(the tied output layer is the token embedding) are not decayed, as in GPT-2 and
nanoGPT. The learning rate rises linearly over ``--warmup-steps`` and then
follows a cosine to ``--min-lr-ratio`` of its peak over ``--decay-epochs``.
The gradient norm is clipped after ``optimizer.synchronize()``, so it is the
norm of the averaged gradient.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import lstm_language_model as lstm


class CausalSelfAttention(nn.Module):
    def __init__(self, size: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(size, 3 * size)
        self.proj = nn.Linear(size, size)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, time_, size = x.shape
        q, k, v = self.qkv(x).split(size, dim=2)
        q, k, v = (t.view(batch, time_, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(batch, time_, size)))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, size: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(size)
        self.attention = CausalSelfAttention(size, heads, dropout)
        self.norm2 = nn.LayerNorm(size)
        self.mlp = nn.Sequential(
            nn.Linear(size, 4 * size), nn.GELU(), nn.Linear(4 * size, size), nn.Dropout(dropout)
        )

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Token + position embeddings -> blocks -> LayerNorm -> output tied to the embedding."""

    def __init__(self, vocab_size, size, layers, heads, block, dropout):
        super().__init__()
        if size % heads:
            raise ValueError(f"--size {size} is not a multiple of --heads {heads}")
        self.tokens = nn.Embedding(vocab_size, size)
        self.positions = nn.Embedding(block, size)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(size, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(size)
        self.output = nn.Linear(size, vocab_size, bias=False)
        self.output.weight = self.tokens.weight  # tied: one matrix, one gradient
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: the layers that write into the residual stream start smaller, by depth.
        for block_ in self.blocks:
            for residual in (block_.attention.proj, block_.mlp[2]):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens):  # tokens: (batch, time)
        where = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.tokens(tokens) + self.positions(where))
        for block_ in self.blocks:
            x = block_(x)
        return self.output(self.norm(x))


def parameter_groups(model, weight_decay: float) -> list:
    """AdamW groups: decay the attention and MLP weight matrices, nothing else.

    Biases and LayerNorm gains are 1-D; the token embedding (also the output
    layer) and the position embedding are left undecayed too, as in GPT-2.
    """
    decay = {
        id(m.weight)
        for block_ in model.blocks
        for m in block_.modules()
        if isinstance(m, nn.Linear)
    }
    params = list(model.parameters())  # tied weights appear once
    return [
        {"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0},
    ]


def learning_rate(step: int, peak: float, warmup: int, decay_steps: int, min_ratio: float):
    """Linear warm-up to `peak` over `warmup` steps, then a cosine to `min_ratio` x peak.

    The cosine ends `decay_steps` after step 0; later steps keep the floor.

    Example:
        >>> [round(learning_rate(s, 1.0, 2, 6, 0.1), 3) for s in range(7)]
        [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1]
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(streams: torch.Tensor, block: int) -> list:
    """Start rows of the (time, batch) streams' windows of `block` tokens plus a target."""
    return list(range(0, len(streams) - 1, block))


def window(streams: torch.Tensor, start: int, block: int):
    """(inputs, targets) of one window, shape (batch, time): targets are inputs shifted by one."""
    y = streams[start + 1 : start + 1 + block]
    x = streams[start : start + len(y)]
    return x.t(), y.t()


def evaluate(model, streams, block: int) -> float:
    """Perplexity over every worker's streams of one split (on the training device)."""
    model.eval()
    loss_sum, count = common.zero(streams.device), 0
    with torch.no_grad():
        for start in windows(streams, block):
            x, y = window(streams, start, block)
            logits = model(x)
            loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            count += y.numel()
    # Horovod: sum every worker's loss and token count, for the whole split.
    loss_sum, count = common.sum_across_ranks(loss_sum, count, name="eval")
    return math.exp(min(loss_sum / count, 50))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Decoder-only transformer language model with Horovod + PowerSGD and AdamW",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--docs-dir", default=lstm.DEFAULT_DOCS_DIR, help="folder of .rst.txt sources"
    )
    parser.add_argument("--text-file", default=None, help="train on this plain-text file instead")
    parser.add_argument("--vocab-size", type=int, default=10000, help="words kept, incl. <unk>")
    parser.add_argument("--size", type=int, default=384, help="model width")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=6, help="attention heads per block")
    parser.add_argument("--block", type=int, default=64, help="context length in tokens")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per worker and step")
    # Adam's step size does not grow with the batch as SGD's does, so the peak LR is
    # not multiplied by the number of workers here.
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    parser.add_argument("--warmup-steps", type=int, default=200, help="linear LR warm-up steps")
    parser.add_argument(
        "--decay-epochs",
        type=int,
        default=0,
        help="the cosine reaches its floor after this many epochs; 0 = --epochs",
    )
    parser.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, times the peak"
    )
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        default=None,
        help="save here after every epoch and resume from here if it exists",
    )
    common.add_common_args(
        parser,
        start_iter_help="uncompressed steps before PowerSGD starts; None: --warmup-steps, as "
        "the README advises (plain all-reduce while the LR warms up)",
    )
    return parser


# Flags that may change when a run resumes; every other flag must match the checkpoint's.
# --no-cuda too: a run may go on on other hardware.
RESUMABLE = {"epochs", "json", "checkpoint", "no_progress", "tensorboard", "powersgd_log_every",
             "no_cuda"}  # fmt: skip


def main(argv=None) -> dict:
    """Train and evaluate; returns the metrics record (also written with --json)."""
    parser = build_parser()
    args = common.parse(parser, argv)
    if args.start_iter is None:
        args.start_iter = args.warmup_steps
    if args.warmup_steps < 1 or args.decay_epochs < 0:
        parser.error("--warmup-steps must be >= 1 and --decay-epochs >= 0")
    decay_epochs = args.decay_epochs or args.epochs
    hvd.init()  # Horovod: initialise (a no-op when already done).
    device = common.training_device(args)  # Horovod: the GPU of this local rank, if any.
    common.seed_everything(args.seed)
    recorder = common.Recorder("transformer_lm", args, argv, device)

    corpus = lstm.Corpus(lstm.load_paragraphs(args.docs_dir, args.text_file), args.vocab_size)
    # Horovod: each worker takes its own block of token streams (shard_streams), once
    # onto its device; every window is a slice of them there.
    train = lstm.shard_streams(corpus.ids["train"], args.batch_size, args.train_subset).to(device)
    valid = lstm.shard_streams(corpus.ids["valid"], args.batch_size, args.eval_subset).to(device)
    test = lstm.shard_streams(corpus.ids["test"], args.batch_size, args.eval_subset).to(device)
    starts = windows(train, args.block)
    steps_per_epoch = min(len(starts), args.max_steps) if args.max_steps else len(starts)
    decay_steps = decay_epochs * steps_per_epoch

    model = TransformerLM(
        len(corpus.words), args.size, args.layers, args.heads, args.block, args.dropout
    ).to(device)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95)
    )
    # Horovod (+ PowerSGD): average gradients across workers.
    optimizer = common.distributed_optimizer(optimizer, model, args)
    if args.checkpoint:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in RESUMABLE}
    # The schedule's length, not the flag: a run of --epochs 4 goes on only with its cosine.
    settings["decay_epochs"] = decay_epochs
    settings["world_size"] = hvd.size()
    saved = lstm.resume(args.checkpoint, model, optimizer, settings) if args.checkpoint else None
    # Horovod: start every worker from rank 0's optimizer state and weights. The state
    # goes first: a rank with an empty AdamW state gets one from a step on zero
    # gradients (hvd.broadcast_optimizer_state does that), and AdamW's weight decay in
    # that step moves its weights; broadcasting the weights afterwards undoes it.
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    meter = common.CommunicationMeter(optimizer, model, common.wire_compression(args))
    board = common.TensorBoardLog(args.tensorboard, meter)  # rank 0 only
    method = f"PowerSGD rank {args.powersgd_rank}" if args.powersgd_rank else "plain all-reduce"
    common.log(
        f"Transformer LM: {len(corpus.ids['train']):,} train / {len(corpus.ids['valid']):,} "
        f"valid / {len(corpus.ids['test']):,} test tokens, vocabulary {len(corpus.words):,}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {common.workers()}, "
        f"{method}, {steps_per_epoch} steps an epoch, rank 0 on {device}"
    )

    valid_ppl = test_ppl = float("nan")
    first_epoch = 1
    if saved:  # go on where the checkpoint's run stopped, as if it never had
        first_epoch, valid_ppl, test_ppl = common.lm_resume(
            saved, recorder, meter, args.checkpoint, device
        )
    for epoch in range(first_epoch, args.epochs + 1):
        model.train()
        start, before = time.perf_counter(), meter.totals()
        # The same window order on every rank (each rank reads its own streams).
        order = torch.randperm(len(starts), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch))[:steps_per_epoch].tolist()  # fmt: skip
        loss_sum = common.zero(device)  # summed on the device: no wait per step
        bar = common.progress(order, steps_per_epoch, args, f"epoch {epoch}")
        for step, index in enumerate(bar):
            lr = learning_rate(
                (epoch - 1) * steps_per_epoch + step,
                args.lr,
                args.warmup_steps,
                decay_steps,
                args.min_lr_ratio,
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = window(train, starts[index], args.block)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            # Horovod: finish the all-reduce first, so clipping sees the averaged gradient.
            optimizer.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            with optimizer.skip_synchronize():
                optimizer.step()
            meter.step()
            board.train_step(loss)
            loss_sum += loss.detach()
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        train_time = common.close(bar, start)
        comm = common.epoch_communication(before, meter.totals())
        # Horovod: mean training loss over all workers' steps (one all-reduce).
        train_loss = common.mean_across_ranks(loss_sum / steps_per_epoch, name="train_loss")
        valid_ppl = evaluate(model, valid, args.block)
        test_ppl = evaluate(model, test, args.block)
        wall = time.perf_counter() - start
        recorder.add_epoch(  # "lr": the epoch's last step's
            common.lm_epoch_record(
                epoch, comm, train_loss, valid_ppl, test_ppl, lr, train_time, wall
            )
        )
        board.scalar("valid/perplexity", valid_ppl)
        board.scalar("test/perplexity", test_ppl)
        if args.checkpoint:
            extra = common.lm_checkpoint_extra(settings, recorder, meter, device)
            lstm.save(args.checkpoint, model, optimizer, extra)
        common.log_lm_epoch(recorder.record["epochs"][-1], f", lr {lr:.2e}")

    board.close()
    return common.lm_final(recorder, meter, model, args, method, valid_ppl, test_ppl)


if __name__ == "__main__":
    main(sys.argv[1:])
