"""PP-OCR models from the ``rapidocr-onnxruntime==1.4.4`` wheel: three tasks in one module.

* ``ocr_cls``: text-direction classifier (MobileNetV3-small). Input ``x`` [N,3,48,192]. Labels: an
  upright text-line crop is class 0, the same crop turned 180 degrees is class 1. Metrics: accuracy
  against those labels, top-1 agreement with the float model (on all crops, and on the crops the
  float model classifies with probability >= 0.7), and agreement of RapidOCR's decision to turn a
  line (class 180 with score > 0.9).
* ``ocr_det``: PP-OCRv4 text detector (DBNet). Input ``x`` [1,3,H,W], H and W multiples of 32,
  images of different sizes. Metrics against the float model: IoU of the probability map
  thresholded at 0.3, cosine of the map, and F1 of text boxes (DB's own box filter, IoU >= 0.5).
* ``ocr_rec``: PP-OCRv4 text recognizer (CTC). Input ``x`` [1,3,48,320]. Metrics against the float
  model: exact match of the greedy CTC decoding and character error rate; against the ground truth
  too when the lines were rendered here.

Data: with ``shared`` (``../shared/data``), real text-line crops come from ``shared/ocr-images``:
the float detector (run here with a DB post-process in numpy/scipy) finds the lines and they are
cut out of the photos. Without it, text lines and pages are rendered with PIL and a TrueType font
(matplotlib's DejaVu fonts when matplotlib is installed, the system's, or Pillow's own).
Needs Pillow (``pip install pillow``); numpy, scipy and onnxruntime besides.

PaddleOCR feeds its models BGR images (cv2 order); so does this module.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from . import Task, session, write_calib

WHEEL = ("rapidocr-onnxruntime", "1.4.4")
MODEL_FILES = {
    "cls": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "det": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "rec": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
}
CLS_W, REC_W, LINE_H = 192, 320, 48
DET_LIMIT = 640          # long side of the detector's evaluation inputs
DET_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
DET_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
DB_THRESH, DB_BOX_THRESH, DB_UNCLIP = 0.3, 0.5, 1.6
EVAL_MAX = {"cls": 700, "det": 28, "rec": 300}   # cls: crops, each in both orientations
SEED = 0

_SCRIPTS = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------- model files
def _fetch_module():
    spec = importlib.util.spec_from_file_location("_dipoorlet_scripts_fetch", _SCRIPTS / "fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cache_dir() -> Path:
    return Path(os.environ.get("DIPOORLET_CACHE", _SCRIPTS / ".cache"))


def model_path(kind: str) -> Path:
    """Path of the float ONNX model ``kind`` in {cls, det, rec}, fetching the wheel if needed."""
    root = _fetch_module().fetch_wheel(*WHEEL, cache_dir())
    p = root / MODEL_FILES[kind]
    if not p.exists():
        raise FileNotFoundError(p)
    return p


def _pil():
    try:
        from PIL import Image  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("the OCR tasks need Pillow: pip install pillow") from e
    import PIL.Image

    return PIL.Image


# ----------------------------------------------------------------------------------- images
def load_rgb(path: Path) -> np.ndarray | None:
    """An image as uint8 HxWx3 RGB, EXIF-rotated; transparent images handled as RapidOCR does."""
    Image = _pil()
    from PIL import ImageOps

    try:
        im = Image.open(path)
        im = ImageOps.exif_transpose(im)
    except Exception:
        return None
    if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
        a = np.asarray(im.convert("RGBA"), np.float32)
        alpha = a[..., 3:4] / 255.0
        prem = a[..., :3] * alpha
        if prem.mean() <= 0.0:   # black text on transparent: put it on white
            out = prem + (1.0 - alpha) * 255.0
        else:                    # coloured/white text: invert, as RapidOCR does
            out = 255.0 - prem
        return np.clip(out, 0, 255).astype(np.uint8)
    return np.asarray(im.convert("RGB"), np.uint8)


def _resize(img: np.ndarray, w: int, h: int) -> np.ndarray:
    Image = _pil()
    return np.asarray(Image.fromarray(img).resize((int(w), int(h)), Image.BILINEAR))


def _bgr_chw(img: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1), dtype=np.float32)


# ----------------------------------------------------------------------------------- detector
def det_size(h: int, w: int, limit: int = DET_LIMIT, upscale: bool = False) -> tuple[int, int]:
    """PP-OCR's resize: long side to ``limit`` (only down unless ``upscale``), rounded to 32."""
    ratio = limit / max(h, w)
    if not upscale:
        ratio = min(ratio, 1.0)
    rh = max(32, int(round(h * ratio / 32)) * 32)
    rw = max(32, int(round(w * ratio / 32)) * 32)
    return rh, rw


def det_input(img: np.ndarray, limit: int = DET_LIMIT, upscale: bool = False) -> np.ndarray:
    rh, rw = det_size(img.shape[0], img.shape[1], limit, upscale)
    x = _bgr_chw(_resize(img, rw, rh)) / 255.0
    return ((x - DET_MEAN) / DET_STD)[None].astype(np.float32)


def db_components(prob: np.ndarray, thresh: float = DB_THRESH, box_thresh: float = DB_BOX_THRESH,
                  min_size: int = 3, dilate: bool = False):
    """Connected text regions of a DB probability map [H,W] that DB's post-process keeps:
    components of ``prob > thresh`` whose mean probability is >= ``box_thresh`` and whose bounding
    box has both sides >= ``min_size``. Returns (label image, [(label, slice, score), ...])."""
    from scipy import ndimage

    mask = prob > thresh
    if dilate:
        mask = ndimage.binary_dilation(mask, structure=np.ones((2, 2), bool))
    lab, n = ndimage.label(mask, structure=np.ones((3, 3), int))
    if n == 0:
        return lab, []
    scores = ndimage.mean(prob, lab, index=np.arange(1, n + 1))
    out = []
    for k, (sl, s) in enumerate(zip(ndimage.find_objects(lab), scores), start=1):
        if sl is None or s < box_thresh:
            continue
        if sl[0].stop - sl[0].start < min_size or sl[1].stop - sl[1].start < min_size:
            continue
        out.append((k, sl, float(s)))
    return lab, out


def _oriented_box(lab: np.ndarray, k: int, sl, unclip: float = DB_UNCLIP) -> np.ndarray | None:
    """Corners (tl, tr, br, bl) of an approximately minimal rotated rectangle around component k,
    grown by DB's unclip distance. Coordinates are (x, y) in the map's pixels."""
    ys, xs = np.nonzero(lab[sl] == k)
    pts = np.stack([xs + sl[1].start, ys + sl[0].start], 1).astype(np.float64) + 0.5
    c = pts.mean(0)
    if len(pts) >= 3:
        cov = np.cov((pts - c).T)
        evals, evecs = np.linalg.eigh(cov)
        u = evecs[:, 1]
    else:
        u = np.array([1.0, 0.0])
    v = np.array([-u[1], u[0]])
    # frame axes: fx the one closer to image +x, fy perpendicular pointing down
    fx, fy = (u, v) if abs(u[0]) >= abs(v[0]) else (v, u)
    if fx[0] < 0:
        fx = -fx
    fy = np.array([-fx[1], fx[0]])
    if fy[1] < 0:
        fy = -fy
    ang = math.degrees(math.atan2(fx[1], fx[0]))
    if abs(ang) < 3.0:   # near-horizontal: axis-aligned
        fx, fy = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    s, t = (pts - c) @ fx, (pts - c) @ fy
    s0, s1, t0, t1 = s.min() - 0.5, s.max() + 0.5, t.min() - 0.5, t.max() + 0.5
    w, h = s1 - s0, t1 - t0
    if min(w, h) < 3:
        return None
    d = w * h * unclip / (2 * (w + h))
    s0, s1, t0, t1 = s0 - d, s1 + d, t0 - d, t1 + d
    return np.array([c + s0 * fx + t0 * fy, c + s1 * fx + t0 * fy,
                     c + s1 * fx + t1 * fy, c + s0 * fx + t1 * fy])


def crop_quad(img: np.ndarray, quad: np.ndarray) -> np.ndarray | None:
    """Cut the quadrilateral (tl, tr, br, bl) out of ``img``, straightened; tall crops are turned
    90 degrees counter-clockwise, as RapidOCR does."""
    Image = _pil()
    h, w = img.shape[:2]
    q = quad.copy()
    q[:, 0] = np.clip(q[:, 0], 0, w)
    q[:, 1] = np.clip(q[:, 1], 0, h)
    cw = int(round(max(np.linalg.norm(q[0] - q[1]), np.linalg.norm(q[3] - q[2]))))
    ch = int(round(max(np.linalg.norm(q[0] - q[3]), np.linalg.norm(q[1] - q[2]))))
    if cw < 4 or ch < 4:
        return None
    data = (q[0, 0], q[0, 1], q[3, 0], q[3, 1], q[2, 0], q[2, 1], q[1, 0], q[1, 1])
    out = np.asarray(Image.fromarray(img).transform((cw, ch), Image.QUAD, data, Image.BILINEAR))
    if ch / cw >= 1.5:
        out = np.ascontiguousarray(np.rot90(out))
    return out


def detect_lines(sess, img: np.ndarray, limit: int = 960, upscale: bool = True,
                 unclips: tuple = (DB_UNCLIP,)) -> list[np.ndarray]:
    """Text-line crops of ``img`` found by the float detector (DB post-process, dilated mask),
    one per text box and unclip ratio (the margin around the text)."""
    x = det_input(img, limit, upscale)
    prob = sess.run(None, {"x": x})[0][0, 0]
    lab, comps = db_components(prob, dilate=True)
    sy, sx = img.shape[0] / prob.shape[0], img.shape[1] / prob.shape[1]
    crops = []
    for k, sl, _ in comps:
        for u in unclips:
            q = _oriented_box(lab, k, sl, u)
            if q is None:
                continue
            c = crop_quad(img, q * np.array([sx, sy]))
            if c is not None and c.shape[0] >= 6:
                crops.append(c)
    return crops


# ----------------------------------------------------------------------------------- cls / rec inputs
def line_input(crop: np.ndarray, width: int) -> np.ndarray:
    """[3,48,width]: height 48 keeping aspect, width <= ``width``, (x/255-0.5)/0.5, zero-padded."""
    h, w = crop.shape[:2]
    rw = max(1, min(width, int(math.ceil(LINE_H * w / h))))
    x = _bgr_chw(_resize(crop, rw, LINE_H)) / 255.0
    x = (x - 0.5) / 0.5
    out = np.zeros((3, LINE_H, width), np.float32)
    out[:, :, :rw] = x
    return out


def rot180(crop: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(crop[::-1, ::-1])


# ----------------------------------------------------------------------------------- rendering
_WORDS = (
    "the of and to in is for on with as by at from this that total price date invoice page "
    "number order name address phone email account balance amount due paid tax item qty unit "
    "street road city north south east west station market hotel open close daily hours monday "
    "friday sale new free service quality report summary table figure section chapter model "
    "data value input output result error warning notice exit entrance floor room level street "
    "Apple Berlin London Paris Tokyo Python ONNX Linux Quantize Receipt Coffee Tea Water Bread"
).split()


def _fonts() -> list:
    """TrueType fonts to render with: matplotlib's DejaVu set, else the system's, else Pillow's."""
    paths: list[Path] = []
    try:
        import matplotlib

        paths = sorted((Path(matplotlib.get_data_path()) / "fonts" / "ttf").glob("DejaVu*.ttf"))
    except Exception:
        pass
    if not paths:
        for d in ("/usr/share/fonts", "/usr/local/share/fonts", "/Library/Fonts", "C:/Windows/Fonts"):
            paths += sorted(Path(d).rglob("*.ttf")) if Path(d).exists() else []
        paths = [p for p in paths if "dejavu" in p.name.lower() or "liberation" in p.name.lower()] or paths[:20]
    paths = [p for p in paths if "display" not in p.name.lower() and "math" not in p.name.lower()]
    return paths or [None]   # None: Pillow's built-in font


def _font(path, size: int):
    from PIL import ImageFont

    if path is None:
        return ImageFont.load_default(size=size)
    return ImageFont.truetype(str(path), size)


def _random_text(rng: np.random.Generator) -> str:
    kind = rng.integers(0, 6)
    if kind == 0:
        return f"{rng.integers(1, 28):02d}/{rng.integers(1, 13):02d}/{rng.integers(1990, 2030)}"
    if kind == 1:
        return f"{rng.choice(_WORDS).upper()} {rng.integers(1, 999)}.{rng.integers(0, 100):02d}"
    if kind == 2:
        alnum = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
        return "".join(rng.choice(list(alnum), size=int(rng.integers(4, 12))))
    n = int(rng.integers(1, 6))
    words = [str(rng.choice(_WORDS)) for _ in range(n)]
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    return " ".join(words)


def render_line(rng: np.random.Generator, fonts: list, text: str | None = None):
    """A rendered text line crop (uint8 HxWx3 RGB) and its text."""
    Image = _pil()
    from PIL import ImageDraw, ImageFilter

    text = text or _random_text(rng)
    font = _font(fonts[int(rng.integers(0, len(fonts)))], int(rng.integers(18, 44)))
    l, t, r, b = font.getbbox(text)
    mx, my = int(rng.integers(2, 14)), int(rng.integers(2, 10))
    W, H = max(8, r - l + 2 * mx), max(8, b - t + 2 * my)
    dark_bg = rng.random() < 0.15
    bg = tuple(int(v) for v in (rng.integers(0, 70, 3) if dark_bg else rng.integers(180, 256, 3)))
    fg = tuple(int(v) for v in (rng.integers(190, 256, 3) if dark_bg else rng.integers(0, 90, 3)))
    im = Image.new("RGB", (W, H), bg)
    ImageDraw.Draw(im).text((mx - l, my - t), text, font=font, fill=fg)
    if rng.random() < 0.3:
        im = im.rotate(float(rng.uniform(-2, 2)), resample=Image.BILINEAR, expand=False, fillcolor=bg)
    if rng.random() < 0.3:
        im = im.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.0))))
    a = np.asarray(im, np.float32) + rng.normal(0, rng.uniform(0, 8), (H, W, 1))
    return np.clip(a, 0, 255).astype(np.uint8), text


def render_page(rng: np.random.Generator, fonts: list) -> np.ndarray:
    """A page-like image (uint8 RGB) with several text lines at random places and sizes."""
    Image = _pil()
    from PIL import ImageDraw

    W, H = int(rng.integers(256, 720)), int(rng.integers(192, 640))
    base = rng.integers(150, 256, 3)
    grad = np.linspace(0, rng.uniform(-40, 40), W)[None, :, None]
    a = np.clip(base[None, None, :] + grad + rng.normal(0, 4, (H, W, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(a)
    d = ImageDraw.Draw(im)
    y = int(rng.integers(4, 30))
    while y < H - 20:
        font = _font(fonts[int(rng.integers(0, len(fonts)))], int(rng.integers(12, 40)))
        text = _random_text(rng)
        l, t, r, b = font.getbbox(text)
        x = int(rng.integers(4, max(5, W // 3)))
        if y + (b - t) >= H:
            break
        fg = tuple(int(v) for v in rng.integers(0, 100, 3))
        if rng.random() < 0.85:
            d.text((x - l, y - t), text, font=font, fill=fg)
        y += (b - t) + int(rng.integers(6, 40))
    return np.asarray(im)


# ----------------------------------------------------------------------------------- data sets
def _image_paths(shared: Path | None) -> list[Path]:
    if shared is None:
        return []
    d = Path(shared) / "ocr-images"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".bmp"))


def load_images(shared: Path | None, min_side: int = 8) -> list[tuple[str, np.ndarray]]:
    """(name, RGB image) for the images in ``shared/ocr-images``; exact duplicates dropped."""
    out, seen = [], set()
    for p in _image_paths(shared):
        img = load_rgb(p)
        if img is None or min(img.shape[:2]) < min_side:
            continue
        h = hashlib.md5(img.tobytes()).hexdigest()
        if h not in seen:
            seen.add(h)
            out.append((p.name, img))
    return out


def real_crops(work: Path, shared: Path | None) -> list[tuple[str, np.ndarray]]:
    """(image name, crop) for every text line the float detector finds in ``shared/ocr-images``,
    at three detector scales and two margins each (the crops differ in framing and resolution).
    Cached in the cache folder (scripts/.cache), shared by the tasks."""
    paths = _image_paths(shared)
    if not paths:
        return []
    # keyed by the images' contents, not only their names: other images under the same names
    # (another shared/data) had been given the first ones' crops
    key = hashlib.sha1(json.dumps([[p.name, hashlib.sha1(p.read_bytes()).hexdigest()] for p in paths]
                                  + ["v5"]).encode()).hexdigest()[:10]
    cache = cache_dir() / f"ocr_crops_{key}.npz"
    if cache.exists():
        try:
            with np.load(cache, allow_pickle=False) as z:
                names = json.loads(str(z["names"]))
                return [(names[i], z[f"c{i}"]) for i in range(len(names))]
        except Exception as exc:  # noqa: BLE001 - a damaged cache file: computed again
            print(f"{cache} is damaged ({type(exc).__name__}: {exc}); computing the crops again", file=sys.stderr)
    sess = session(model_path("det"), simulated=False)
    out = []
    for name, img in load_images(shared):
        for limit, unclips in ((1280, (1.6, 1.2)), (960, (1.6, 2.0)), (640, (1.6, 1.3))):
            out += [(name, c) for c in detect_lines(sess, img, limit, True, unclips)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, names=json.dumps([n for n, _ in out]), **{f"c{i}": c for i, (_, c) in enumerate(out)})
    os.replace(tmp, cache)
    return out


def _split(items: list, n_calib: int, rng: np.random.Generator, group=None):
    """Split into (calib, eval), disjoint. With ``group`` (item -> key, the source image),
    calibration takes at most ``ceil(n_calib / 8)`` items (at least 2) from each of randomly
    drawn images until it has ``n_calib`` (at least 8 images contribute where ``n_calib`` is a
    multiple of 8 from 16 on; fewer for other N: N = 12 takes 6), and evaluation
    keeps only the images calibration did not touch (the rest of a drawn image is used by neither).

    Until session 12 calibration took whole images: with this seed the 32 calibration crops all
    came from one image (a dark screenshot; pixel values -0.78..0.21 where evaluation spans
    -1..1) and the 64 from three, so every tensor range, the network input's first, was
    calibrated on a band the evaluation crops leave half the time."""
    idx = rng.permutation(len(items))
    if group is None:
        return [items[i] for i in idx[:n_calib]], [items[i] for i in idx[n_calib:]]
    keys = sorted({group(it) for it in items})
    keys = [keys[i] for i in rng.permutation(len(keys))]
    cap = max(2, -(-n_calib // 8))
    calib, taken = [], set()
    for k in keys:
        if len(calib) >= n_calib:
            break
        members = [it for it in items if group(it) == k]
        pick = rng.permutation(len(members))[:min(cap, n_calib - len(calib))]
        calib += [members[i] for i in sorted(pick)]
        taken.add(k)
    calib = [calib[i] for i in rng.permutation(len(calib))]
    ev = [it for it in items if group(it) not in taken]
    ev = [ev[i] for i in rng.permutation(len(ev))]
    return calib, ev


def _split_crops(crops: list, n_calib: int, rng: np.random.Generator, task: str) -> tuple[list, list, str]:
    """(calibration crops, evaluation crops, how they were split). By image (see _split) where
    that leaves enough evaluation crops; else crop by crop, which puts crops of the images
    calibration used (other framings of the same lines among them) into the evaluation set:
    said on stderr and in the metrics' ``split``."""
    calib_c, eval_c = _split(crops, n_calib, rng, group=lambda it: it[0])
    split = "by image (evaluation images disjoint from calibration's)"
    if len(eval_c) < max(100, len(crops) // 3):
        calib_c, eval_c = _split(crops, n_calib, rng)
        split = "crop by crop (evaluation crops from the images calibration used)"
        print(f"{task}: --n-calib {n_calib} leaves too few crops of unused images for evaluation; split crop by "
              f"crop instead: evaluation crops come from the images calibration used (in distribution, not "
              f"held out)", file=sys.stderr)
    if not eval_c:
        raise SystemExit(f"{task}: --n-calib {n_calib} leaves no evaluation crops of the {len(crops)} there are; "
                         f"use a smaller --n-calib")
    return [c for _, c in calib_c], [c for _, c in eval_c], split


def _run_batched(sess, xs: np.ndarray, bs: int = 64) -> np.ndarray:
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: xs[i:i + bs]})[0] for i in range(0, len(xs), bs)])


# ----------------------------------------------------------------------------------- ocr_cls
def prepare_cls(work: Path, n_calib: int, shared: Path | None) -> Task:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model_path("cls")
    rng = np.random.default_rng(SEED)
    crops = real_crops(work, shared)
    source = "real"
    if len(crops) >= 50:
        # calibration crops from several images (see _split); if that would leave too few for
        # evaluation, split crop by crop instead
        calib_c, eval_c, split = _split_crops(crops, n_calib, rng, "ocr_cls")
    else:
        source, split = "rendered", "rendered"
        fonts = _fonts()
        calib_c = [render_line(rng, fonts)[0] for _ in range(n_calib)]
        eval_c = [render_line(rng, fonts)[0] for _ in range(EVAL_MAX["cls"])]
    eval_c = eval_c[:EVAL_MAX["cls"]]
    # calibration: upright and rotated crops mixed
    cal = []
    for i in range(n_calib):
        c = calib_c[i % len(calib_c)]
        if i >= len(calib_c):   # reuse with a different orientation / framing
            c = c[:, int(rng.integers(0, max(1, c.shape[1] // 8))):]
        cal.append(line_input(rot180(c) if rng.random() < 0.5 else c, CLS_W)[None])
    calib_dir = write_calib(work, cal)
    xs = np.stack([line_input(c, CLS_W) for c in eval_c] + [line_input(rot180(c), CLS_W) for c in eval_c])
    labels = np.array([0] * len(eval_c) + [1] * len(eval_c))
    ref = {}

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = _run_batched(session(model), xs)
        f, q = ref["float"], _run_batched(session(path), xs)
        # RapidOCR turns a line only when class "180" wins with a score above cls_thresh 0.9
        turn_f, turn_q = (f.argmax(1) == 1) & (f[:, 1] > 0.9), (q.argmax(1) == 1) & (q[:, 1] > 0.9)
        agree = q.argmax(1) == f.argmax(1)
        sure = f.max(1) >= 0.7
        return {"agreement": float(agree.mean()),
                # most flips are crops the float model itself is unsure of (p < 0.7: ~14% of them)
                "agreement_p70": float(agree[sure].mean()) if sure.any() else float("nan"),
                "accuracy": float((q.argmax(1) == labels).mean()),
                "turn_agreement": float((turn_f == turn_q).mean()),
                "n_eval": int(len(xs)), "data": source, "split": split}

    return Task("ocr_cls", model, calib_dir, n_calib, evaluate, "agreement")


# ----------------------------------------------------------------------------------- ocr_det
def _box_iou(a, b) -> float:
    y0, y1 = max(a[0].start, b[0].start), min(a[0].stop, b[0].stop)
    x0, x1 = max(a[1].start, b[1].start), min(a[1].stop, b[1].stop)
    inter = max(0, y1 - y0) * max(0, x1 - x0)
    area = lambda s: (s[0].stop - s[0].start) * (s[1].stop - s[1].start)  # noqa: E731
    return inter / (area(a) + area(b) - inter) if inter else 0.0


def box_matches(ref_boxes: list, boxes: list, thr: float = 0.5) -> int:
    """Greedy one-to-one matching by bounding-box IoU (highest first); the number of pairs >= thr."""
    pairs = sorted(((_box_iou(a, b), i, j) for i, a in enumerate(ref_boxes) for j, b in enumerate(boxes)),
                   reverse=True)
    used_i, used_j, n = set(), set(), 0
    for iou, i, j in pairs:
        if iou < thr:
            break
        if i in used_i or j in used_j:
            continue
        used_i.add(i)
        used_j.add(j)
        n += 1
    return n


def det_metrics(ref_probs: list[np.ndarray], probs: list[np.ndarray]) -> dict:
    inter = union = 0
    cos, cos_text, n_ref, n_out, n_match = [], [], 0, 0, 0
    for r, p in zip(ref_probs, probs):
        mr, mp = r > DB_THRESH, p > DB_THRESH
        inter += int((mr & mp).sum())
        union += int((mr | mp).sum())
        a, b = r.ravel().astype(np.float64), p.ravel().astype(np.float64)
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        cos.append(float(a @ b / (na * nb)) if na > 0 and nb > 0 else float(na == nb))
        if mr.any():    # an image without text has a near-zero float map: any noise sets its cosine
            cos_text.append(cos[-1])
        rb = [sl for _, sl, _ in db_components(r)[1]]
        pb = [sl for _, sl, _ in db_components(p)[1]]
        n_ref, n_out, n_match = n_ref + len(rb), n_out + len(pb), n_match + box_matches(rb, pb)
    return {"mask_iou": inter / union if union else 1.0,
            "box_f1": 2 * n_match / (n_ref + n_out) if n_ref + n_out else 1.0,
            "cosine": float(np.mean(cos)), "cosine_text": float(np.mean(cos_text)) if cos_text else 1.0,
            "n_boxes_float": n_ref}


def _det_augment(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A calibration input from ``img``: random window (60-100% of each side), long side
    320-640 px, so that shapes vary."""
    h, w = img.shape[:2]
    ch, cw = max(8, int(h * rng.uniform(0.6, 1.0))), max(8, int(w * rng.uniform(0.6, 1.0)))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    return det_input(img[y:y + ch, x:x + cw], int(rng.integers(10, 21)) * 32, upscale=True)


def prepare_det(work: Path, n_calib: int, shared: Path | None, model: Path | None = None) -> Task:
    """``model``: another DB text detector on the same inputs (held-out PP-OCRv5)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model or model_path("det")
    rng = np.random.default_rng(SEED + 1)
    imgs = [img for _, img in load_images(shared, min_side=16)]
    source = "real"
    if len(imgs) >= 8:
        # the 29 images are too few to split: evaluation uses every image at its deployment size
        # (long side <= 640), calibration random windows of them at other scales
        calib_imgs = imgs
        eval_x = [det_input(im) for im in imgs][:EVAL_MAX["det"]]
    else:
        source = "rendered"
        fonts = _fonts()
        calib_imgs = [render_page(rng, fonts) for _ in range(max(8, min(n_calib, 32)))]
        eval_x = [det_input(render_page(rng, fonts)) for _ in range(EVAL_MAX["det"])]
    cal = [_det_augment(calib_imgs[int(rng.integers(0, len(calib_imgs)))], rng) for _ in range(n_calib)]
    calib_dir = write_calib(work, cal)
    ref = {}

    def run(path):
        s = session(path)
        return [s.run(None, {"x": x})[0][0, 0] for x in eval_x]

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = run(model)
        m = det_metrics(ref["float"], run(path))
        m.update(n_eval=len(eval_x), data=source)
        return m

    return Task("ocr_det", model, calib_dir, n_calib, evaluate, "mask_iou")


# ----------------------------------------------------------------------------------- ocr_rec
def ctc_greedy(probs: np.ndarray) -> list[tuple[int, ...]]:
    """[N,T,C] -> index sequences: argmax, collapse repeats, drop blank (0)."""
    out = []
    for a in probs.argmax(-1):
        keep = np.ones(len(a), bool)
        keep[1:] = a[1:] != a[:-1]
        out.append(tuple(int(i) for i in a[keep] if i != 0))
    return out


def edit_distance(a, b) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def rec_charset(model: Path) -> list[str]:
    """Index -> character: blank, the model's ``character`` metadata, then space (as RapidOCR)."""
    import onnx

    m = onnx.load(str(model), load_external_data=False)
    meta = {p.key: p.value for p in m.metadata_props}
    chars = meta.get("character", "").splitlines()
    return ["<blank>"] + chars + [" "]


def _seq_metrics(ref: list, out: list) -> tuple[float, float]:
    exact = float(np.mean([a == b for a, b in zip(ref, out)]))
    errs = sum(edit_distance(a, b) for a, b in zip(ref, out))
    return exact, errs / max(1, sum(len(a) for a in ref))


def prepare_rec(work: Path, n_calib: int, shared: Path | None, model: Path | None = None) -> Task:
    """``model``: another CTC recognizer on the same inputs (held-out PP-OCRv5)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = model or model_path("rec")
    rng = np.random.default_rng(SEED + 2)
    crops = real_crops(work, shared)
    truth = None
    source = "real"
    if len(crops) >= 50:
        calib_c, eval_c, split = _split_crops(crops, n_calib, rng, "ocr_rec")
        eval_c = eval_c[:EVAL_MAX["rec"]]
    else:
        source, split = "rendered", "rendered"
        fonts = _fonts()
        calib_c = [render_line(rng, fonts)[0] for _ in range(n_calib)]
        ev = [render_line(rng, fonts) for _ in range(EVAL_MAX["rec"])]
        eval_c, texts = [c for c, _ in ev], [t for _, t in ev]
        idx = {ch: i for i, ch in enumerate(rec_charset(model))}
        truth = [tuple(idx[ch] for ch in t if ch in idx) for t in texts]
    cal = [line_input(calib_c[i % len(calib_c)], REC_W)[None] for i in range(n_calib)]
    calib_dir = write_calib(work, cal)
    xs = np.stack([line_input(c, REC_W) for c in eval_c])
    ref = {}

    def evaluate(path: Path) -> dict:
        if "float" not in ref:
            ref["float"] = ctc_greedy(_run_batched(session(model), xs, 32))
        seqs = ctc_greedy(_run_batched(session(path), xs, 32))
        exact, cer = _seq_metrics(ref["float"], seqs)
        m = {"exact_match": exact, "cer": cer}
        if truth is not None:
            m["exact_match_gt"], m["cer_gt"] = _seq_metrics(truth, seqs)
        m.update(n_eval=len(xs), data=source, split=split)
        return m

    return Task("ocr_rec", model, calib_dir, n_calib, evaluate, "exact_match")


TASKS = {"ocr_cls": prepare_cls, "ocr_det": prepare_det, "ocr_rec": prepare_rec}
NAME = "ocr_cls"
prepare = prepare_cls
