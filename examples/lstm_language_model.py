"""Word-level 2-layer LSTM language model trained with Horovod + PowerSGD.

Launch (from the repository root):

    # one process, no launcher
    python examples/lstm_language_model.py --epochs 1
    # 2 workers, PowerSGD rank 4
    horovodrun -np 2 -H localhost:2 python examples/lstm_language_model.py --powersgd-rank 4
    # the plain Horovod baseline: same script, compression off
    horovodrun -np 2 -H localhost:2 python examples/lstm_language_model.py --powersgd-rank 0
    # save after every epoch; the same command resumes, a larger --epochs trains on
    horovodrun -np 2 -H localhost:2 python examples/lstm_language_model.py \
        --epochs 16 --checkpoint runs/lm.ckpt
    # TensorBoard scalars (loss, perplexity, bytes, per-layer error) and a PowerSGD log line
    horovodrun -np 2 -H localhost:2 python examples/lstm_language_model.py \
        --tensorboard runs/lm --powersgd-log-every 100
    # cut the LR by 4 after epochs 14 and 18 (default: after a validation stall); runs
    # compared this way see the same LR in every epoch
    horovodrun -np 2 -H localhost:2 python examples/lstm_language_model.py \
        --epochs 20 --lr-drop-after 14,18

The text is the English prose of the Python 3.11 documentation sources that
Debian's ``python3.11-doc`` installs (/usr/share/doc/python3.11/html/_sources,
reStructuredText): markup, code samples, tables and interactive sessions are
dropped, prose is kept. ``--text-file`` trains on any plain-text file instead.
Paragraphs go to train/validation/test (90/5/5 %) by a hash of their text, so
the split is fixed whatever the file order, and a repeated paragraph never
lands in two splits.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import time
import zlib

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

DEFAULT_DOCS_DIR = "/usr/share/doc/python3.11/html/_sources"
UNK, EOS = "<unk>", "<eos>"

# --- reStructuredText -> prose ---------------------------------------------------
# Directives whose indented body is code, tables or index entries, not prose.
_NON_PROSE_DIRECTIVES = {
    "code-block", "sourcecode", "code", "literalinclude", "doctest", "testcode",
    "testoutput", "testsetup", "testcleanup", "productionlist", "index", "toctree",
    "highlight", "csv-table", "list-table", "table", "math", "raw", "only", "include",
    "image", "figure", "moduleauthor", "sectionauthor", "audit-event", "opcode",
    "cmdoption", "option", "envvar", "program", "literal", "parsed-literal",
    "graphviz", "digraph", "impl-detail", "availability",
}  # fmt: skip
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$")
_COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s|$)")
_SECTION_LINE = re.compile(r"^\s*([=\-~^\"'`#*+_:.<>])\1{2,}\s*$")
_TABLE_LINE = re.compile(r"^\s*[+|]|^\s*=+(\s+=+)+\s*$")
_FIELD = re.compile(r"^\s*:[\w .-]+:\s*")
_BULLET = re.compile(r"^\s*(?:[-*+•]|\d+\.|#\.|\([a-z0-9]\))\s+")
_INLINE = [
    (re.compile(r":[\w:+-]+:`~?!?([^`<]*?)\s*(?:<[^`>]*>)?`"), r"\1"),  # :role:`text <target>`
    (re.compile(r"``([^`]*)``"), r"\1"),  # ``literal``
    (re.compile(r"`([^`<]*?)\s*(?:<[^`>]*>)?`_{0,2}"), r"\1"),  # `link <url>`_ / `interpreted`
    (re.compile(r"\[#?\w*\]_"), " "),  # footnote references
    (re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*"), r"\1\2"),  # **strong**, *emphasis*
    (re.compile(r"\|([\w -]+)\|"), r"\1"),  # |substitution|
    (re.compile(r"https?://\S+"), " "),
]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_prose(text: str) -> list:
    """The prose paragraphs of a reStructuredText document, markup removed.

    Drops titles' underlines, comments, link targets, code and literal blocks
    (``::``), doctest sessions (``>>>``), tables and the bodies of non-prose
    directives; keeps the text of notes, function descriptions and lists.

    Example:
        >>> rst_to_prose("Use :func:`len` here::\\n\\n   len(x)\\n\\nIt *counts*.\\n")
        ['Use len here:', 'It counts.']
    """
    paragraphs, current = [], []
    skip_deeper_than = None  # drop lines indented more than this (a block being skipped)
    literal_next = False  # the previous paragraph ended with '::'
    in_session = False  # inside a '>>>' interactive session (ends at a blank line)

    def flush():
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if in_session:
            in_session = bool(stripped)
            continue
        if skip_deeper_than is not None:
            if not stripped or _indent(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if not stripped:
            flush()
            continue
        if literal_next:
            literal_next = False
            if current == [] and _indent(line) > 0:
                # The indented block after '::' is a literal (code) block.
                skip_deeper_than = _indent(line) - 1
                continue
        directive = _DIRECTIVE.match(line)
        if directive:
            flush()
            if directive.group(2) in _NON_PROSE_DIRECTIVES:
                skip_deeper_than = len(directive.group(1))
            continue
        if _COMMENT_OR_TARGET.match(line):  # comment, link target or substitution definition
            flush()
            skip_deeper_than = _indent(line)
            continue
        if stripped.startswith(">>>"):
            flush()
            in_session = True
            continue
        if _SECTION_LINE.match(line) or _TABLE_LINE.match(line):
            flush()
            continue
        if _BULLET.match(line):
            flush()
            stripped = _BULLET.sub("", line).strip()
        stripped = _FIELD.sub("", stripped)
        if stripped.endswith("::"):
            literal_next = True
            stripped = stripped[:-2].rstrip()
            stripped = stripped + ":" if stripped and not stripped.endswith(":") else stripped
            for pattern, repl in _INLINE:
                stripped = pattern.sub(repl, stripped)
            if stripped:
                current.append(stripped)
            flush()
            continue
        for pattern, repl in _INLINE:
            stripped = pattern.sub(repl, stripped)
        if stripped:
            current.append(stripped)
    flush()
    return [" ".join(p.split()) for p in paragraphs if re.search(r"[A-Za-z]{2}", p)]


_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+|[.,;:!?()\"-]")


def tokenize(paragraph: str) -> list:
    """Lower-case words, numbers and basic punctuation, then an end-of-paragraph mark.

    Example:
        >>> tokenize("It's 42, OK.")
        ["it's", '42', ',', 'ok', '.', '<eos>']
    """
    return [*_TOKEN.findall(paragraph.lower()), EOS]


def split_of(paragraph: str) -> str:
    """'train', 'valid' or 'test' (90/5/5 %), fixed by the paragraph's text."""
    bucket = zlib.crc32(paragraph.encode("utf-8")) % 100
    return "test" if bucket < 5 else "valid" if bucket < 10 else "train"


def load_paragraphs(docs_dir: str, text_file: str | None) -> list:
    if text_file:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
        return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    paths = []
    for root, _dirs, files in os.walk(docs_dir):
        paths += [os.path.join(root, f) for f in files if f.endswith(".rst.txt")]
    if not paths:
        raise FileNotFoundError(
            f"no .rst.txt files under {docs_dir}; install Debian's python3.11-doc "
            "(scripts/bootstrap.sh does) or pass --text-file"
        )
    paragraphs = []
    for path in sorted(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            paragraphs += rst_to_prose(f.read())
    return paragraphs


class Corpus:
    """Token ids of the three splits; vocabulary from the training split only."""

    def __init__(self, paragraphs: list, vocab_size: int, train_limit: int = 0):
        tokens = {"train": [], "valid": [], "test": []}
        for paragraph in paragraphs:
            tokens[split_of(paragraph)] += tokenize(paragraph)
        if train_limit:
            tokens["train"] = tokens["train"][:train_limit]
        counts = collections.Counter(tokens["train"])
        counts.pop(EOS, None)
        counts.pop(UNK, None)
        # Most frequent first, ties alphabetical: the same vocabulary on every rank.
        common_words = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
        self.words = [UNK, EOS] + [w for w, _ in common_words]
        index = {w: i for i, w in enumerate(self.words)}
        self.ids = {
            split: torch.tensor([index.get(t, 0) for t in toks], dtype=torch.long)
            for split, toks in tokens.items()
        }


def shard_streams(ids: torch.Tensor, batch_size: int, limit: int = 0) -> torch.Tensor:
    """This worker's ``batch_size`` parallel token streams, shape (time, batch_size).

    The whole split is cut into size x batch_size equally long streams; each
    worker takes a disjoint block of columns.
    """
    if limit:
        ids = ids[:limit]
    columns = hvd.size() * batch_size  # Horovod: one block of streams per worker.
    length = len(ids) // columns
    if length < 2:
        raise ValueError(f"{len(ids)} tokens are too few for {columns} streams")
    streams = ids[: length * columns].view(columns, length).t()
    return streams[:, hvd.rank() * batch_size : (hvd.rank() + 1) * batch_size].contiguous()


class LanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM -> linear decoder tied to the embedding."""

    def __init__(self, vocab_size: int, size: int, layers: int, dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, size)
        self.lstm = nn.LSTM(size, size, layers, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.decoder = nn.Linear(size, vocab_size)
        # Tying halves the parameters and helps on small corpora.
        self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens, state=None):
        out, state = self.lstm(self.dropout(self.embedding(tokens)), state)
        return self.decoder(self.dropout(out)), state


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Word-level LSTM language model with Horovod + PowerSGD",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--docs-dir", default=DEFAULT_DOCS_DIR, help="folder of .rst.txt sources")
    parser.add_argument("--text-file", default=None, help="train on this plain-text file instead")
    parser.add_argument("--vocab-size", type=int, default=10000, help="words kept, incl. <unk>")
    parser.add_argument("--size", type=int, default=200, help="embedding and LSTM width")
    parser.add_argument("--layers", type=int, default=2, help="LSTM layers")
    parser.add_argument("--dropout", type=float, default=0.2, help="dropout probability")
    parser.add_argument("--bptt", type=int, default=35, help="steps of back-propagation in time")
    parser.add_argument("--batch-size", type=int, default=20, help="token streams per worker")
    parser.add_argument("--lr", type=float, default=10.0, help="SGD learning rate per worker")
    parser.add_argument("--clip", type=float, default=0.25, help="gradient-norm clipping")
    parser.add_argument(
        "--lr-drop-after",
        metavar="EPOCHS",
        type=_epoch_list,
        default=(),
        help="divide the LR by 4 after each of these epochs (e.g. 14,18), the same for every "
        "run, instead of after an epoch whose validation perplexity is worse than the best",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        default=None,
        help="save here after every epoch and resume from here if it exists",
    )
    common.add_common_args(parser)
    return parser


def _epoch_list(text: str) -> tuple:
    try:
        epochs = tuple(int(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of epochs"
        ) from None
    if any(e < 1 for e in epochs) or list(epochs) != sorted(set(epochs)):
        raise argparse.ArgumentTypeError(f"{text!r}: epochs must be >= 1 and increasing")
    return epochs


def scheduled_lr(base: float, drop_after, epoch: int) -> float:
    """The learning rate of `epoch` under --lr-drop-after: base / 4 per drop before it."""
    return base / 4 ** sum(d < epoch for d in drop_after)


def _check_lr_history(epochs, base: float, drop_after) -> None:
    """Refuses to go on with --lr-drop-after if the saved epochs trained at other LRs."""
    used = [base] + [e["lr"] for e in epochs[:-1]]  # an epoch's record holds the next LR
    for e, lr in zip(epochs, used):
        want = scheduled_lr(base, drop_after, e["epoch"])
        if not math.isclose(lr, want, rel_tol=1e-9):
            raise ValueError(
                f"--lr-drop-after {','.join(map(str, drop_after)) or '(none)'}: the checkpoint's "
                f"epoch {e['epoch']} trained at LR {lr:g}, this schedule gives {want:g}; use "
                "the drops it was trained with (later ones may be added) or another --checkpoint"
            )


def evaluate(model, streams, bptt: int) -> float:
    """Perplexity over every worker's streams of one split (on the training device)."""
    model.eval()
    loss_sum, count, state = common.zero(streams.device), 0, None
    with torch.no_grad():
        for i in range(0, len(streams) - 1, bptt):
            x, y = streams[i : i + bptt], streams[i + 1 : i + 1 + bptt]
            x = x[: len(y)]
            out, state = model(x, state)
            loss_sum += F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")
            count += y.numel()
    # Horovod: sum every worker's loss and token count, for the whole split.
    loss_sum, count = common.sum_across_ranks(loss_sum, count, name="eval")
    return math.exp(min(loss_sum / count, 50))


# Flags that may change when a run resumes; every other flag must match the checkpoint's.
# --lr-drop-after may change as long as the epochs already trained followed it.
# --no-cuda too: a run may go on on other hardware.
RESUMABLE = {"epochs", "json", "checkpoint", "no_progress", "lr_drop_after", "tensorboard",
             "powersgd_log_every", "no_cuda"}  # fmt: skip
# Flags added after checkpoints were saved: such a checkpoint ran at their defaults.
ADDED_LATER = {"fp16_allreduce": False}


def save(path, model, optimizer, extra) -> None:
    """Checkpoint after an epoch, the Horovod way: rank 0 writes the file."""
    if hasattr(optimizer, "compression_stats"):
        # PowerSGD: error buffers differ per rank, so every rank writes its own
        # state beside rank 0's file (horovod_powersgd.save_checkpoint).
        hps.save_checkpoint(path, model, optimizer, **extra)
    elif hvd.rank() == 0:  # Horovod: rank 0 alone saves the (identical) weights.
        tmp = path + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "extra": extra}, tmp)  # fmt: skip
        os.replace(tmp, path)  # a crash while saving keeps the previous epoch's file


def resume(path, model, optimizer, settings) -> dict | None:
    """Load `path` if it exists, before the broadcasts; returns its extra (None: no file).

    Horovod's way: rank 0 reads the file and the broadcasts that follow hand its
    state to every rank. With PowerSGD every rank reads it, for its own error
    buffers (horovod_powersgd.load_checkpoint).
    """
    powersgd = hasattr(optimizer, "compression_stats")
    checkpoint = problem = None
    if (powersgd or hvd.rank() == 0) and os.path.exists(path):
        try:
            # Onto the CPU: a GPU run's file also resumes with --no-cuda; the loads
            # below copy the tensors to the model's device.
            checkpoint = torch.load(path, weights_only=True, map_location="cpu")
            _same_settings(checkpoint["extra"]["settings"], settings)
        except Exception as e:
            problem = f"cannot resume from {path}: {e}"
    # Agree before anything changes: a rank that cannot resume stops every rank.
    found = hvd.allgather_object((checkpoint is not None, problem), name="resume.check")
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(found) if p]
    if problems:
        raise ValueError("; ".join(problems))
    present = [f for r, (f, _) in enumerate(found) if powersgd or r == 0]
    if len(set(present)) > 1:
        raise FileNotFoundError(f"{path} is missing on some ranks; save to a shared folder")
    if not present[0]:
        return None
    if powersgd:
        return hps.load_checkpoint(path, model, optimizer)
    if hvd.rank() == 0:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    extra = checkpoint["extra"] if checkpoint else None
    return hvd.broadcast_object(extra, root_rank=0, name="resume.extra")


def _same_settings(saved, settings) -> None:
    saved = {**ADDED_LATER, **saved}
    changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if changed:
        listed = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
        raise ValueError(
            f"saved by a run with other settings ({listed}); resume with the same flags "
            "(only --epochs may grow) or use another --checkpoint"
        )


def main(argv=None) -> dict:
    """Train and evaluate; returns the metrics record (also written with --json)."""
    args = common.parse(build_parser(), argv)
    hvd.init()  # Horovod: initialise (a no-op when already done).
    device = common.training_device(args)  # Horovod: the GPU of this local rank, if any.
    common.seed_everything(args.seed)
    recorder = common.Recorder("lstm_language_model", args, argv, device)

    corpus = Corpus(load_paragraphs(args.docs_dir, args.text_file), args.vocab_size)
    # This worker's streams go to its device once; every window is a slice of them there.
    train = shard_streams(corpus.ids["train"], args.batch_size, args.train_subset).to(device)
    valid = shard_streams(corpus.ids["valid"], 10, args.eval_subset).to(device)
    test = shard_streams(corpus.ids["test"], 10, args.eval_subset).to(device)

    model = LanguageModel(len(corpus.words), args.size, args.layers, args.dropout).to(device)
    # Horovod: scale the learning rate by the number of workers (the batch grows with it).
    base_lr = args.lr * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr)
    # Horovod (+ PowerSGD): average gradients across workers.
    optimizer = common.distributed_optimizer(optimizer, model, args)
    if args.checkpoint:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in RESUMABLE}
    settings["world_size"] = hvd.size()
    saved = resume(args.checkpoint, model, optimizer, settings) if args.checkpoint else None
    # Horovod: start every worker from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    meter = common.CommunicationMeter(optimizer, model, common.wire_compression(args))
    board = common.TensorBoardLog(args.tensorboard, meter)  # rank 0 only
    method = f"PowerSGD rank {args.powersgd_rank}" if args.powersgd_rank else "plain all-reduce"
    common.log(
        f"LSTM LM: {len(corpus.ids['train']):,} train / {len(corpus.ids['valid']):,} valid / "
        f"{len(corpus.ids['test']):,} test tokens, vocabulary {len(corpus.words):,}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {common.workers()}, {method}, "
        f"rank 0 on {device}"
    )

    valid_ppl = test_ppl = float("nan")
    best_valid, first_epoch = float("inf"), 1
    if saved:  # go on where the checkpoint's run stopped, as if it never had
        if saved.get("lr_drop_after") and not args.lr_drop_after:  # every rank has `saved`
            raise ValueError(
                "saved by a run with --lr-drop-after "
                f"{','.join(map(str, saved['lr_drop_after']))}; pass it again (later drops "
                "may be added) or the run would go on cutting the LR at validation stalls"
            )
        if args.lr_drop_after:  # every rank has `saved`: all raise together, none waits
            _check_lr_history(saved["epochs"], base_lr, args.lr_drop_after)
            # The last record's "lr" is the next epoch's, which this schedule decides.
            next_lr = scheduled_lr(base_lr, args.lr_drop_after, len(saved["epochs"]) + 1)
            saved["epochs"][-1]["lr"] = next_lr
            for group in optimizer.param_groups:
                group["lr"] = next_lr
        best_valid = saved["best_valid"]
        first_epoch, valid_ppl, test_ppl = common.lm_resume(
            saved, recorder, meter, args.checkpoint, device
        )
    for epoch in range(first_epoch, args.epochs + 1):
        model.train()
        start, before = time.perf_counter(), meter.totals()
        starts = range(0, len(train) - 1, args.bptt)
        steps_per_epoch = min(len(starts), args.max_steps) if args.max_steps else len(starts)
        loss_sum, state = common.zero(device), None  # summed on the device: no wait per step
        bar = common.progress(starts, steps_per_epoch, args, f"epoch {epoch}")
        for step, i in enumerate(bar, 1):
            x, y = train[i : i + args.bptt], train[i + 1 : i + 1 + args.bptt]
            x = x[: len(y)]
            if state is not None:  # carry the state, not its history, into the next window
                state = tuple(s.detach() for s in state)
            optimizer.zero_grad()
            out, state = model(x, state)
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
            loss.backward()
            # Horovod: finish the all-reduce first, so clipping sees the averaged gradient.
            optimizer.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            with optimizer.skip_synchronize():
                optimizer.step()
            meter.step()
            loss_sum += loss.detach()
            board.train_step(loss)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if step == steps_per_epoch:
                break
        train_time = common.close(bar, start)
        comm = common.epoch_communication(before, meter.totals())
        # Horovod: mean training loss over all workers' steps (one all-reduce).
        train_loss = common.mean_across_ranks(loss_sum / steps_per_epoch, name="train_loss")
        valid_ppl = evaluate(model, valid, args.bptt)
        test_ppl = evaluate(model, test, args.bptt)
        if args.lr_drop_after:  # fixed epochs: runs compare at the same LR every epoch
            # Set for the next epoch here (a fresh run starts at base_lr, a resumed one above).
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(base_lr, args.lr_drop_after, epoch + 1)
        elif valid_ppl > best_valid:
            # Classic LM schedule: divide the learning rate by 4 when validation stalls.
            for group in optimizer.param_groups:
                group["lr"] /= 4
        best_valid = min(best_valid, valid_ppl)
        wall = time.perf_counter() - start
        board.scalar("valid/perplexity", valid_ppl)
        board.scalar("test/perplexity", test_ppl)
        lr = optimizer.param_groups[0]["lr"]  # the next epoch's
        recorder.add_epoch(
            common.lm_epoch_record(
                epoch, comm, train_loss, valid_ppl, test_ppl, lr, train_time, wall
            )
        )
        if args.checkpoint:
            extra = common.lm_checkpoint_extra(settings, recorder, meter, device,
                                               best_valid=best_valid,
                                               lr_drop_after=list(args.lr_drop_after))  # fmt: skip
            save(args.checkpoint, model, optimizer, extra)
        common.log_lm_epoch(recorder.record["epochs"][-1])

    board.close()
    return common.lm_final(recorder, meter, model, args, method, valid_ppl, test_ppl)


if __name__ == "__main__":
    main(sys.argv[1:])
