"""Unit tests for models/corpus.py: loading, the split, batch streams and evaluation."""

import itertools
import json

import pytest
import torch

from models import DataConfig, ModelConfig, batches, build_model, eval_batches, evaluate, load_corpus
from models.corpus import _is_val, stdlib_files


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(DataConfig(max_train_bytes=1_000_000, max_val_bytes=200_000))


def test_stdlib_corpus_deterministic_and_nonempty(stdlib_corpus):
    again = load_corpus(DataConfig(max_train_bytes=1_000_000, max_val_bytes=200_000))
    c = stdlib_corpus
    assert torch.equal(c.train, again.train) and torch.equal(c.val, again.val)
    assert c.train.dtype == torch.uint8 and c.train.dim() == 1
    assert c.train.numel() == 1_000_000 and c.val.numel() == 200_000
    assert c.train_files > 0 and c.val_files > 0
    assert c.source.startswith("stdlib:")


def test_stdlib_split_disjoint():
    root, files = stdlib_files()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any("site-packages" in r or "/test/" in f"/{r}" for r in rels)
    val = {r for r in rels if _is_val(r, 0.1)}
    train = set(rels) - val
    assert val and train and not (val & train)
    assert 0.03 < len(val) / len(rels) < 0.2
    assert "os.py" in train | val


def _write_user_data(folder):
    (folder / "a.txt").write_text("hello world. " * 200, encoding="utf-8")
    (folder / "sub").mkdir()
    (folder / "sub" / "b.md").write_text("# title\nnaïve café " * 100, encoding="utf-8")
    (folder / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": f"record {i} " * 20, "id": i}) for i in range(30)) + "\n\n",
        encoding="utf-8")
    (folder / "ignored.bin").write_bytes(b"\x00" * 1000)


def test_user_folder_txt_and_jsonl(tmp_path):
    _write_user_data(tmp_path)
    c = load_corpus(DataConfig(path=str(tmp_path), max_train_bytes=None, max_val_bytes=None))
    everything = bytes(c.train.tolist()) + bytes(c.val.tolist())
    assert b"hello world" in everything and b"record 29" in everything
    assert "naïve".encode() in everything and b"\x00" not in everything
    assert b'"id"' not in everything                   # only the text field is read
    assert c.train.numel() > 0 and c.val.numel() > 0
    assert c.train_files + c.val_files >= 1
    again = load_corpus(DataConfig(path=str(tmp_path), max_train_bytes=None, max_val_bytes=None))
    assert torch.equal(c.train, again.train) and torch.equal(c.val, again.val)


def test_single_file_split_by_bytes(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("x" * 1000)
    c = load_corpus(DataConfig(path=str(f), val_fraction=0.1))
    assert c.val.numel() == 100 and c.train.numel() == 900


def test_jsonl_field_option(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "abc"}) + "\n")
    c = load_corpus(DataConfig(path=str(tmp_path), jsonl_field="body", val_fraction=0.0))
    assert bytes(c.train.tolist()) == b"abc"


def test_malformed_jsonl_names_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        load_corpus(DataConfig(path=str(tmp_path)))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2.*'text'.*data\.jsonl_field"):
        load_corpus(DataConfig(path=str(tmp_path)))


def test_missing_or_empty_path_errors(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*data\.path"):
        load_corpus(DataConfig(path=str(tmp_path / "nope")))
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match=r"no .*\.txt.*files found.*data\.path"):
        load_corpus(DataConfig(path=str(tmp_path)))


def _take(it, n):
    return list(itertools.islice(it, n))


TOKENS = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)


@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
def test_batches_deterministic_sharded_resumable(layout):
    kw = dict(batch_size=4, seq_len=16, layout=layout)
    a = _take(batches(TOKENS, seed=1, num_shards=2, shard=0, **kw), 8)
    b = _take(batches(TOKENS, seed=1, num_shards=2, shard=0, **kw), 8)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x, y = a[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                       # y is x shifted by one
    other = _take(batches(TOKENS, seed=1, num_shards=2, shard=1, **kw), 8)
    assert not any(torch.equal(p[0], q[0]) for p, q in zip(a, other))
    reseeded = _take(batches(TOKENS, seed=2, num_shards=2, shard=0, **kw), 1)
    assert not torch.equal(reseeded[0][0], a[0][0])
    resumed = _take(batches(TOKENS, seed=1, num_shards=2, shard=0, start_step=5, **kw), 3)
    for (xa, ya), (xr, yr) in zip(a[5:8], resumed):
        assert torch.equal(xa, xr) and torch.equal(ya, yr)


def _window_starts(x, tokens):
    """Recover where each window starts in the stream (random tokens make this unique)."""
    raw, T = bytes(tokens.tolist()), x.shape[1]
    first = {}
    for i in range(len(raw) - T + 1):
        first.setdefault(raw[i:i + T], i)
    return [first[bytes(row.tolist())] for row in x]


def test_shards_draw_from_disjoint_regions():
    seq = 16
    chunk = 4 * (seq + 1)
    seen = {0: set(), 1: set(), 2: set()}
    for shard in seen:
        xs = torch.cat([x for x, _ in _take(batches(TOKENS, 8, seq, 0, shard, 3), 5)])
        seen[shard] |= {s // chunk % 3 for s in _window_starts(xs, TOKENS)}
    assert seen == {0: {0}, 1: {1}, 2: {2}}


def test_batches_too_little_data():
    with pytest.raises(ValueError, match="shards"):
        next(batches(TOKENS[:100], 2, 16, seed=0, num_shards=4))


def test_eval_batches_and_evaluate(stdlib_corpus):
    ev = eval_batches(stdlib_corpus.val, batch_size=4, seq_len=32, max_batches=3)
    again = eval_batches(stdlib_corpus.val, batch_size=4, seq_len=32, max_batches=3)
    assert len(ev) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(ev, again))
    assert ev[0][0].shape == (4, 32) and ev[0][0].dtype == torch.int64
    model = build_model(ModelConfig(d_model=32, max_seq_len=32), 0)
    model.train()
    loss = evaluate(model, ev)
    assert model.training and 4.5 < loss < 6.5
    assert evaluate(model, ev) == loss
    short = eval_batches(TOKENS[:50], batch_size=4, seq_len=16, max_batches=10)
    assert sum(x.shape[0] for x, _ in short) == 3                # (50 - 1) // 16 windows
    assert eval_batches(TOKENS[:10], 4, 16, 10) == []
    with pytest.raises(ValueError, match="val"):
        evaluate(model, [])
