"""The examples' data readers: IDX parsing (Fashion-MNIST) and rst -> prose (LSTM)."""

import gzip
import os
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import fashion_mnist
import lstm_language_model as lm


def idx_bytes(tensor: torch.Tensor, code: int, fmt: str) -> bytes:
    header = bytes([0, 0, code, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    return header + struct.pack(f">{tensor.numel()}{fmt}", *tensor.flatten().tolist())


# --- IDX ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, code, fmt",
    [
        (torch.uint8, 0x08, "B"),
        (torch.int8, 0x09, "b"),
        (torch.int16, 0x0B, "h"),
        (torch.int32, 0x0C, "i"),
        (torch.float32, 0x0D, "f"),
        (torch.float64, 0x0E, "d"),
    ],
)
def test_parse_idx_round_trips_every_type_big_endian(dtype, code, fmt):
    values = torch.arange(-5, 19).reshape(2, 3, 4)
    if dtype == torch.uint8:
        values = values + 5
    values = values.to(dtype) * (1.5 if dtype.is_floating_point else 1)
    parsed = fashion_mnist.parse_idx(idx_bytes(values, code, fmt))
    assert parsed.dtype == dtype
    assert torch.equal(parsed, values)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x1f\x8b\x08\x00", "magic"),
        (bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 5]), "magic"),
        (bytes([0, 0, 8, 2, 0, 0, 0, 2]), "header"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 3, 1, 2]), "size mismatch"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 1, 1, 2]), "size mismatch"),
    ],
)
def test_parse_idx_rejects_malformed_files(data, message):
    with pytest.raises(ValueError, match=message):
        fashion_mnist.parse_idx(data)


def write_fake_fashion_mnist(directory, gzipped):
    images = torch.randint(
        0, 256, (7, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 9], dtype=torch.uint8)
    for split in ("train", "t10k"):
        for kind, tensor in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            data = idx_bytes(tensor, 0x08, "B")
            name = f"{split}-{kind}" + (".gz" if gzipped else "")
            (directory / name).write_bytes(gzip.compress(data) if gzipped else data)
    return images, labels


@pytest.mark.parametrize("gzipped", [True, False])
def test_load_split_reads_gz_or_plain_and_normalises(tmp_path, gzipped):
    images, labels = write_fake_fashion_mnist(tmp_path, gzipped)
    dataset = fashion_mnist.load_split(str(tmp_path), "train", limit=5)
    x, y = dataset.tensors
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == labels[:5].tolist()
    expected = (images[:5].float() / 255 - fashion_mnist.MEAN) / fashion_mnist.STD
    assert torch.allclose(x[:, 0], expected)


def test_gzip_is_detected_by_content_not_by_name(tmp_path):
    values = torch.arange(6, dtype=torch.uint8)
    path = tmp_path / "no-extension"
    path.write_bytes(gzip.compress(idx_bytes(values, 0x08, "B")))
    assert fashion_mnist.read_idx(str(path)).tolist() == values.tolist()


def test_missing_data_names_the_folder_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset-fashion-mnist"):
        fashion_mnist.load_split(str(tmp_path), "train")


def test_mismatched_images_and_labels_fail(tmp_path):
    write_fake_fashion_mnist(tmp_path, gzipped=False)
    short = idx_bytes(torch.tensor([1, 2], dtype=torch.uint8), 0x08, "B")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(short)
    with pytest.raises(ValueError, match="do not match"):
        fashion_mnist.load_split(str(tmp_path), "train")


# --- reStructuredText -> prose --------------------------------------------------------

RST = """\
.. _tut-example:

*****************
An Example Title
*****************

Use the :func:`len` function with ``x`` and :ref:`the tutorial <tut-intro>`,
as *shown* in **bold** and `the docs <https://example.org>`_ below::

   >>> len([1, 2, 3])
   3

.. code-block:: python

   def hidden():
       return "code"

.. note::

   Notes keep their prose, even when
   wrapped over two lines.

>>> print("a session")
a session

+------+------+
| cell | cell |
+------+------+

.. index:: single: indexed entry

* First bullet item.
* Second bullet item.

.. Just a comment
   over two lines.

Last paragraph.
"""


def test_rst_to_prose_keeps_prose_and_drops_markup_and_code():
    assert lm.rst_to_prose(RST) == [
        "An Example Title",
        "Use the len function with x and the tutorial, as shown in bold and the docs below:",
        "Notes keep their prose, even when wrapped over two lines.",
        "First bullet item.",
        "Second bullet item.",
        "Last paragraph.",
    ]


def test_rst_to_prose_on_a_real_document_has_no_code_left():
    path = os.path.join(lm.DEFAULT_DOCS_DIR, "tutorial", "controlflow.rst.txt")
    if not os.path.exists(path):
        pytest.skip("python3.11-doc is not installed")
    with open(path, encoding="utf-8") as f:
        prose = " ".join(lm.rst_to_prose(f.read()))
    assert "Perhaps the most well-known statement type is the if statement." in prose
    for leftover in (">>>", "::", ":keyword:", "``", "print('Negative changed to zero')"):
        assert leftover not in prose


def test_tokenize_lowercases_and_ends_each_paragraph():
    assert lm.tokenize("Don't PANIC: 42 towels.") == [
        "don't", "panic", ":", "42", "towels", ".", "<eos>"
    ]  # fmt: skip


def test_split_is_fixed_by_text_and_about_90_5_5():
    paragraphs = [f"paragraph number {i}" for i in range(20000)]
    splits = [lm.split_of(p) for p in paragraphs]
    assert splits == [lm.split_of(p) for p in paragraphs]
    share = {s: splits.count(s) / len(splits) for s in ("train", "valid", "test")}
    assert share["train"] == pytest.approx(0.90, abs=0.01)
    assert share["valid"] == pytest.approx(0.05, abs=0.01)
    assert share["test"] == pytest.approx(0.05, abs=0.01)


def test_corpus_vocabulary_comes_from_the_training_split_only():
    paragraphs = [f"alpha beta {i}" for i in range(400)]
    corpus = lm.Corpus(paragraphs, vocab_size=4)
    assert corpus.words == ["<unk>", "<eos>", "alpha", "beta"]
    eval_words = {
        corpus.words[i] for split in ("valid", "test") for i in corpus.ids[split].tolist()
    }
    assert eval_words <= set(corpus.words)
    # The numbers are rare and fall out of a 4-word vocabulary: they become <unk> (id 0).
    assert (corpus.ids["train"] == 0).sum() == len(corpus.ids["train"]) // 4


# --- LSTM learning-rate schedule ------------------------------------------------------


def test_lr_drop_after_divides_by_4_after_each_listed_epoch():
    args = lm.build_parser().parse_args(["--lr-drop-after", "2,4"])
    assert [lm.scheduled_lr(8.0, args.lr_drop_after, e) for e in range(1, 6)] == [8, 8, 2, 2, 0.5]
    assert lm.build_parser().parse_args([]).lr_drop_after == ()


@pytest.mark.parametrize("bad", ["4,2", "2,2", "0", "x"])
def test_lr_drop_after_refuses_epochs_out_of_order(bad, capsys):
    with pytest.raises(SystemExit):
        lm.build_parser().parse_args(["--lr-drop-after", bad])
    assert "--lr-drop-after" in capsys.readouterr().err
